"""Compile the kernels for GPUs on a machine without one: every specialisation the runtime launches.

    python -m benchmarks.aot [--targets sm_90,sm_80,gfx942] [--models ...] [--json FILE] [--no-cache]

The launch functions (`launch_perturb`, `launch_update`, `launch_fill`, `launch_normals`,
`launch_virtual_linear`, `launch_lowrank_linear`: its products, then its GEMM) are called on CPU tensors
with Triton's `JITFunction.run` replaced by a recorder (`capture`), and so is one ES iteration of each
real model of MODEL_CONFIGS, on the meta device, through fastes.ES and population_batched in every
dtype, noise and mode (`model_launches`). Each recorded launch is specialised by Triton's own binder,
exactly as `run` would on a GPU (signature, constexprs, divisibility attributes), and compiled with
`triton.compile` for a `GPUTarget`: PTX and a cubin via the ptxas shipped in the Triton wheel (AMD: an
hsaco). `cuobjdump` from the same wheel gives registers, local memory and the SASS. Launches that
specialise alike are compiled once per target, and each result is cached (`compile_cached`). Exit status
1 when a launch fails to compile or spills registers, or when launches of one label compile to more than
one variant.
docs/gpu.md has the counts and timings.

This needs compiled kernels, so it refuses to run under TRITON_INTERPRET=1 (the test suite starts it in
a subprocess without it). Nothing is launched and no GPU is needed.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

# (name, triton backend, arch, warp size): the targets checked by default.
TARGETS = {
    "sm_90": ("cuda", 90, 32),
    "sm_80": ("cuda", 80, 32),
    "gfx942": ("hip", "gfx942", 64),
}
# Data values that must never change what is compiled (1 used to become a constexpr; 16 a divisibility
# variant; 2^31 and 2^32 - 1 an i64 one).
EDGE_WORDS = (1, 16, 1 << 31, (1 << 32) - 1)


@dataclass
class Launch:
    """One recorded kernel launch: the JIT function, its arguments and a label saying what it stands for."""

    kernel: Any
    args: tuple
    kwargs: dict
    grid: tuple
    label: str = ""


@contextmanager
def capture() -> Iterator[list[Launch]]:
    """Record the launches made inside the block instead of running them (no GPU needed)."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        raise RuntimeError(
            "benchmarks.aot needs compiled kernels; run it in a process without TRITON_INTERPRET=1 "
            "(python -m benchmarks.aot)"
        )
    from triton.runtime.jit import JITFunction

    launches: list[Launch] = []

    def record(self, *args, grid, warmup, **kwargs):
        launches.append(Launch(self, args, dict(kwargs), grid))

    original = JITFunction.run
    JITFunction.run = record
    try:
        yield launches
    finally:
        JITFunction.run = original


def runtime_launches() -> list[Launch]:
    """The launches fastes makes, over every dtype and mode, with edge values for keys, ids, offsets.

    The label names what should decide the compiled variant (kernel, dtype, mode, shape): launches with
    the same label must specialise identically whatever their keys, tensor ids or offsets.
    """
    import triton.language as tl

    from fastes.engine.kernels import (
        MODE_APPLY,
        MODE_APPLY_STOCHASTIC,
        MODE_GRADIENT,
        build_tile_table,
        table,
    )
    from fastes.engine.kernels.lowrank_linear import launch_lowrank_linear
    from fastes.engine.kernels.noise import launch_fill, launch_normals
    from fastes.engine.kernels.perturb import launch_perturb
    from fastes.engine.kernels.update import launch_update
    from fastes.engine.kernels.virtual_linear import launch_virtual_linear

    block = 1024  # fastes.engine.ops._BLOCK
    sign_block = 2048  # fastes.engine.ops._SIGN_BLOCK: sign noise runs on larger tiles
    dtypes = {
        "fp32": (torch.float32, tl.float32),
        "bf16": (torch.bfloat16, tl.bfloat16),
        "fp16": (torch.float16, tl.float16),
    }
    keys = [(1, 1), (16, 1 << 31), ((1 << 32) - 1, 0), (0x5D25E919, 0x9FA8B4D7)]
    id_sets = [[1, 16], [1 << 31, (1 << 32) - 1]]
    all_launches: list[Launch] = []

    def add(label: str, launch, *args) -> None:
        with capture() as recorded:
            launch(*args)
        kernels = {one.kernel for one in recorded}
        for one in recorded:  # a launch function of two kernels (lowrank_linear) labels each apart
            one.label = label if len(kernels) == 1 else f"{label} {one.kernel.__name__}"
        all_launches.extend(recorded)

    for name, (torch_dtype, dtype) in dtypes.items():
        for ids in id_sets:
            tensors = [torch.zeros(37, dtype=torch_dtype), torch.zeros(4096, dtype=torch_dtype)]
            tiles = build_tile_table(tensors, ids, block)
            sign_tiles = build_tile_table(tensors, ids, sign_block)
            outputs = table.addresses([torch.empty_like(t) for t in tensors], torch.device("cpu"))
            for key in keys:
                add(f"perturb {name}", launch_perturb, tiles, outputs, key, 1e-3, dtype)
                add(
                    f"perturb {name} sign",
                    launch_perturb,
                    sign_tiles,
                    outputs,
                    key,
                    1e-3,
                    dtype,
                    "rademacher",
                )
            modes = {"apply": MODE_APPLY, "gradient": MODE_GRADIENT}
            if name != "fp32":
                modes["stochastic"] = MODE_APPLY_STOCHASTIC
            for mode_name, mode in modes.items():
                for directions in (1, 16, 30):
                    key_column = torch.tensor(keys * 8, dtype=torch.int64)[:directions]
                    weights = torch.linspace(-1, 1, directions)
                    grads = [torch.empty_like(t) for t in tensors] if mode == MODE_GRADIENT else None
                    for rounding in [(1, (1 << 32) - 1), (16, 1 << 31)]:
                        add(
                            f"update {name} {mode_name}",
                            launch_update,
                            *(tiles, grads, key_column, weights, 2e-3, 1.0, rounding, mode, dtype),
                        )
                        add(
                            f"update {name} {mode_name} sign",
                            launch_update,
                            *(
                                sign_tiles,
                                grads,
                                key_column,
                                weights,
                                2e-3,
                                1.0,
                                rounding,
                                mode,
                                dtype,
                                "rademacher",
                            ),
                        )
        for members, rows, n_in, n_out in [(2, 1, 64, 48), (3, 17, 64, 48), (2, 3, 37, 33)]:
            x = torch.zeros(members * rows, n_in, dtype=torch_dtype)
            weight = torch.zeros(n_out, n_in, dtype=torch_dtype)
            y = torch.empty(members * rows, n_out, dtype=torch_dtype)
            member_keys = torch.tensor(keys[:members] * 2, dtype=torch.int64)[:members]
            scales = torch.full((members,), 1e-3)
            for tid in EDGE_WORDS:
                add(
                    f"virtual_linear {name} K={n_in} N={n_out} rows={rows}",
                    launch_virtual_linear,
                    *(x, weight, y, member_keys, scales, tid, rows, dtype),
                )
                if rows == 17:  # sign noise: the word path (K = 64) and the per-element path (K = 37)
                    continue  # are covered by the other shapes; fewer variants to compile
                add(
                    f"virtual_linear {name} K={n_in} N={n_out} rows={rows} sign",
                    launch_virtual_linear,
                    *(x, weight, y, member_keys, scales, tid, rows, dtype, None, 32, 32, False, "rademacher"),
                )
            # A Conv1D weight is stored [in, out]: the transposed variant (GPT-2 models).
            conv_weight = torch.zeros(n_in, n_out, dtype=torch_dtype)
            add(
                f"virtual_linear {name} transposed K={n_in} N={n_out} rows={rows}",
                launch_virtual_linear,
                *(x, conv_weight, y, member_keys, scales, 1, rows, dtype),
                *(None, 32, 32, True),  # block_m, block_n, block_k, transposed
            )
            if rows == 17:
                continue
            add(
                f"virtual_linear {name} transposed K={n_in} N={n_out} rows={rows} sign",
                launch_virtual_linear,
                *(x, conv_weight, y, member_keys, scales, 1, rows, dtype),
                *(None, 32, 32, True, "rademacher"),
            )
        # The low-rank layer's GEMM, with its products inside or computed first: 16- and 64-row tiles,
        # with a bias, and a Conv1D's transposed weight without one (models without biases cover the
        # rest); ranks 1, 3 (in a block of 4) and 8, and at odd sizes 1 and 2, products first at rank 1
        # only (gfx942 spills a few scalar registers at odd sizes: products inside at ranks 3 and 8, first
        # in fp32 at rank 2; real models' sizes are multiples of 16). Launches of a label differ in their
        # rows per member only: they must share one variant per kernel.
        for n_in, n_out, ranks in [(64, 48, (1, 3, 8)), (37, 33, (1, 2))]:
            weight = torch.zeros(n_out, n_in, dtype=torch_dtype)
            bias = torch.zeros(n_out, dtype=torch_dtype)
            for rank in ranks:
                for members, rows in [(2, 8), (16, 1), (4, 17), (68, 1)]:
                    x = torch.zeros(members * rows, n_in, dtype=torch_dtype)
                    y = torch.empty(members * rows, n_out, dtype=torch_dtype)
                    inputs = torch.zeros(members, rank, n_in, dtype=torch_dtype)
                    outputs = torch.zeros(members, rank, n_out, dtype=torch_dtype)
                    shape = f"K={n_in} N={n_out} rank={rank} rows={members * rows}"
                    for first in (False, True) if n_in % 16 == 0 or rank == 1 else (False,):
                        way = "products first " if first else ""
                        add(
                            f"lowrank_linear {name} {way}{shape}",
                            launch_lowrank_linear,
                            *(x, weight, bias, inputs, outputs, y, dtype, False, None, 64, 32, first),
                        )
                        add(
                            f"lowrank_linear {name} {way}transposed {shape}",
                            launch_lowrank_linear,
                            *(
                                x,
                                weight.T.contiguous(),
                                None,
                                inputs,
                                outputs,
                                y,
                                dtype,
                                True,
                                None,
                                64,
                                32,
                                first,
                            ),
                        )
    for raw_bits in (True, False):
        out = torch.empty(4099, dtype=torch.int64 if raw_bits else torch.float32)
        for key, tid, offset in [((1, 1), 1, 0), ((16, 1 << 31), (1 << 32) - 1, 16), ((0, 0), 16, 1 << 34)]:
            for stream in (0, 1):
                add(
                    f"fill {'bits' if raw_bits else 'normal'} stream={stream}",
                    launch_fill,
                    *(out[: 1 + offset % 4099], key, tid, offset, stream, raw_bits),
                )
    # Many tensors' normals in one launch (fastes.engine.ops.normals: the low-rank factors, streams 2 and 3).
    numels = [37, 4096, 1]
    flat = torch.empty(table.segment_starts(numels)[1], dtype=torch.float32)
    for ids in id_sets:
        layout = table.build_flat_table(numels, ids + [1], block, 4, torch.device("cpu"))
        normals_table = table.at(layout, flat)
        for key in keys:
            for stream in (2, 3):
                add(f"normals stream={stream}", launch_normals, normals_table, key, stream)
    signs = torch.empty(4099, dtype=torch.float32)
    for key, tid, offset in [((1, 1), 1, 0), ((16, 1 << 31), (1 << 32) - 1, 128), ((0, 0), 16, 1 << 34)]:
        add("fill sign stream=4", launch_fill, signs, key, tid, offset, 4, False, 1024, "rademacher")
    return all_launches


# The shapes of real models, from their published transformers configs. Only shapes matter: the models
# are built on the meta device (no weights), and the launch check builds one decoder layer (every layer
# launches the same shapes).
MODEL_CONFIGS = {
    "SmolLM2-135M": dict(
        num_hidden_layers=30,
        model_type="llama",
        hidden_size=576,
        intermediate_size=1536,
        num_attention_heads=9,
        num_key_value_heads=3,
        vocab_size=49152,
        tie_word_embeddings=True,
    ),
    "Qwen2.5-0.5B": dict(
        num_hidden_layers=24,
        model_type="qwen2",
        hidden_size=896,
        intermediate_size=4864,
        num_attention_heads=14,
        num_key_value_heads=2,
        vocab_size=151936,
        tie_word_embeddings=True,
    ),
    "Qwen2.5-1.5B": dict(
        num_hidden_layers=28,
        model_type="qwen2",
        hidden_size=1536,
        intermediate_size=8960,
        num_attention_heads=12,
        num_key_value_heads=2,
        vocab_size=151936,
        tie_word_embeddings=True,
    ),
    "Llama-3-8B": dict(
        num_hidden_layers=32,
        model_type="llama",
        hidden_size=4096,
        intermediate_size=14336,
        num_attention_heads=32,
        num_key_value_heads=8,
        vocab_size=128256,
        tie_word_embeddings=False,
    ),
}
# Rows per member of a population-batched projection: one decode step of one prompt up to a prefill of
# 4096 tokens; the edges of each tile height (16, 32, 64, 128 rows) are among them.
MEMBER_ROWS = (1, 16, 17, 33, 64, 65, 256, 4096)
MODEL_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def model_config(name: str, layers: int | None = None):
    """A transformers config of a real model's shapes (with `layers` decoder layers: all by default)."""
    from transformers import AutoConfig

    if name not in MODEL_CONFIGS:
        raise ValueError(f"unknown model {name!r}; choose from {list(MODEL_CONFIGS)}")
    fields = dict(MODEL_CONFIGS[name])
    if layers is not None:
        fields["num_hidden_layers"] = layers
    return AutoConfig.for_model(fields.pop("model_type"), **fields)


@contextmanager
def _as_on_a_gpu() -> Iterator[None]:
    """fastes.engine.ops dispatches meta tensors to the Triton backend, as it would CUDA tensors."""
    from unittest import mock

    from fastes.engine import ops

    with mock.patch.object(ops, "resolve_backend", lambda tensors, backend="auto": "triton"):
        yield


def model_launches(models: list[str] | None = None) -> list[Launch]:
    """The launches one ES iteration of each real model makes, through the runtime's own code.

    Per model, dtype and noise distribution: member-by-member and materialised evaluation (perturb),
    virtual evaluation (virtual_linear at every row count of MEMBER_ROWS), low-rank evaluation (the
    factors' noise fill and lowrank_linear at every row count) and the update in each mode (apply,
    stochastic rounding, gradient). The model is built on the meta device, so nothing is allocated and
    no kernel runs. Each label names the kernel and its constexpr arguments: what should decide the
    compiled variant.
    """
    from transformers import AutoModelForCausalLM

    import fastes

    launches: list[Launch] = []
    for name in models or list(MODEL_CONFIGS):
        for dtype_name, dtype in MODEL_DTYPES.items():
            with torch.device("meta"):
                model = AutoModelForCausalLM.from_config(model_config(name, layers=1), dtype=dtype)
            params = fastes.linear_weights(model, warn=False)
            for noise in ("gaussian", "rademacher"):
                # Low-rank sign factors come from the torch reference (fastes.engine.lowrank.factors): no
                # launch to record, and its Philox on meta tensors would only cost time.
                for noise_type in ("full", "lowrank") if noise == "gaussian" else ("full",):
                    options = dict(sigma=1e-3, lr=1e-4, population=4, noise=noise, noise_type=noise_type)
                    with capture() as recorded, _as_on_a_gpu():
                        _one_iteration(model, params, options)
                    for one in recorded:
                        one.label = f"{name} {dtype_name} {noise} {noise_type}: {_describe(one)}"
                    launches.extend(recorded)
    return launches


def _one_iteration(model, params, options: dict) -> None:
    """Every evaluation mode and update mode of one ES generation (on meta tensors)."""
    import fastes
    from fastes.es.population import LowRankLinear, VirtualLinear, population_batched

    batched_modes = ("lowrank",) if options["noise_type"] == "lowrank" else ("materialised", "virtual")
    for update_options in ({}, {"stochastic_rounding": True}, {"inner_optimizer": torch.optim.SGD}):
        es = fastes.ES(params, **options, **update_options, backend="triton", checksum_every=0)
        members = list(es.members())
        if not update_options:  # evaluation does not depend on how the update is made
            with members[0]:  # eval mode "member": perturb into the work buffer, then restore
                pass
            for mode in batched_modes:
                with population_batched(es, model, mode, members):
                    for layer in model.modules():
                        if isinstance(layer, (VirtualLinear, LowRankLinear)):
                            features = layer.base.weight.shape[0 if layer.transposed else 1]
                            for rows in MEMBER_ROWS:
                                layer(torch.empty(len(members) * rows, features, device="meta"))
        es.step(torch.linspace(-1, 1, len(members)))


def _describe(launch: Launch) -> str:
    """What decides a recorded launch's variant, in words (its kernel and its constexpr arguments)."""
    constants = {k: v for k, v in launch.kwargs.items() if k.isupper() or k.startswith("num_")}
    return f"{launch.kernel.__name__} " + " ".join(f"{k}={v}" for k, v in constants.items())


@dataclass(frozen=True)
class Specialisation:
    """What Triton compiles for a launch: the cache key of a compiled variant."""

    kernel: str
    signature: tuple
    constexprs: tuple
    attrs: tuple


_binders: dict = {}


def specialise(launch: Launch, target) -> tuple[Specialisation, Any, dict]:
    """Triton's own binder on the recorded arguments: (variant, ASTSource, options), as `run` does."""
    from triton.compiler import ASTSource, make_backend
    from triton.runtime.jit import create_function_from_signature

    fn = launch.kernel
    if (fn, target) not in _binders:
        backend = make_backend(target)
        _binders[fn, target] = backend, create_function_from_signature(fn.signature, fn.params, backend)
    backend, binder = _binders[fn, target]
    bound, specialization, options = binder(*launch.args, **launch.kwargs)
    options, signature, constexprs, attrs = fn._pack_args(
        backend, launch.kwargs, bound, specialization, options
    )
    variant = Specialisation(
        fn.__name__,
        tuple(signature.items()),
        tuple(sorted((k, str(v)) for k, v in constexprs.items())),
        tuple(sorted((k, str(v)) for k, v in attrs.items())),
    )
    return variant, ASTSource(fn, signature, constexprs, attrs), options.__dict__


@dataclass
class CompileResult:
    """One variant compiled for one target."""

    kernel: str
    label: str
    target: str
    ok: bool
    error: str = ""
    seconds: float = 0.0
    registers: int = 0
    spill_bytes: int = 0  # local memory per thread (NVIDIA) or spilled registers (AMD)
    num_warps: int = 0
    constexprs: dict = field(default_factory=dict)
    sass: str = ""  # NVIDIA only
    labels: list = field(default_factory=list)  # of every launch that compiles to this variant

    @property
    def spills(self) -> bool:
        return self.spill_bytes > 0


def gpu_target(name: str):
    from triton.backends.compiler import GPUTarget

    if name not in TARGETS:
        raise ValueError(f"unknown target {name!r}; choose from {sorted(TARGETS)}")
    return GPUTarget(*TARGETS[name])


def compile_variant(source, options: dict, target_name: str, label: str) -> CompileResult:
    """triton.compile for the target, then registers and spills from the binary (and SASS on NVIDIA)."""
    import triton

    target = gpu_target(target_name)
    start = time.perf_counter()
    result = CompileResult(source.fn.__name__, label, target_name, ok=False)
    result.constexprs = {source.fn.arg_names[k[0]]: str(v) for k, v in source.constants.items()}
    try:
        compiled = triton.compile(source, target=target, options=options)
    except Exception as error:  # a compile failure is a result to report, not a crash of the check
        result.error = f"{type(error).__name__}: {error}".strip()[:2000]
        result.seconds = time.perf_counter() - start
        return result
    result.seconds = time.perf_counter() - start
    result.num_warps = compiled.metadata.num_warps
    if target.backend == "cuda":
        result.registers, result.spill_bytes, result.sass = _cubin_facts(compiled.asm["cubin"])
    else:
        result.registers, result.spill_bytes = _amdgcn_facts(compiled.asm["amdgcn"])
    result.ok = True
    return result


def _cubin_facts(cubin: bytes) -> tuple[int, int, str]:
    """(registers, local memory bytes per thread, SASS text) of a cubin, from cuobjdump."""
    import triton

    tool = triton.knobs.nvidia.cuobjdump.path
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        usage, sass = (
            subprocess.run([tool, flag, f.name], capture_output=True, text=True, check=True).stdout
            for flag in ("-res-usage", "-sass")
        )
    registers = int(re.search(r"REG:(\d+)", usage).group(1))
    local = int(re.search(r"LOCAL:(\d+)", usage).group(1)) + int(re.search(r"STACK:(\d+)", usage).group(1))
    return registers, local, sass


def _amdgcn_facts(asm: str) -> tuple[int, int]:
    """(VGPRs, spilled VGPRs + SGPRs) from the metadata the AMD backend writes into its assembly."""
    vgprs = re.search(r"\.vgpr_count:\s+(\d+)", asm)
    spills = sum(int(n) for n in re.findall(r"\.[vs]gpr_spill_count:\s+(\d+)", asm))
    return int(vgprs.group(1)) if vgprs else 0, spills


def check(
    targets: list[str], labels: str = "", models: list[str] | None = None, cache: Path | None = None
) -> tuple[list[CompileResult], dict[str, list[Specialisation]]]:
    """Compile every distinct variant launched (whose label matches `labels`) per target.

    The launches are those of `runtime_launches` and, for each of `models` (None: all of MODEL_CONFIGS,
    []: none), those of `model_launches`; launches that specialise alike are compiled once. With
    `cache`, each result is kept there under a hash of its source, specialisation, options, target and
    Triton version, and taken from there next time. Returns the results and, per label, the distinct
    variants its launches produced (one is right).
    """
    launches = runtime_launches() + (model_launches(models) if models != [] else [])
    launches = [launch for launch in launches if re.search(labels, launch.label)]
    results: list[CompileResult] = []
    per_label: dict[str, list[Specialisation]] = {}
    for target_name in targets:
        target = gpu_target(target_name)
        variants: dict[Specialisation, tuple[Any, dict, set]] = {}
        target_labels: dict[str, set] = {}
        for launch in launches:
            variant, source, options = specialise(launch, target)
            variants.setdefault(variant, (source, options, set()))[2].add(launch.label)
            target_labels.setdefault(launch.label, set()).add(_without_pointer_range(variant))
        for source, options, labels in variants.values():
            result = compile_cached(source, options, target_name, min(labels, key=_label_order), cache)
            result.labels = sorted(labels)
            results.append(result)
        for label, found in target_labels.items():  # the target with the most variants per label
            if len(found) > len(per_label.get(label, [])):
                per_label[label] = sorted(found, key=repr)
    return results, per_label


def _label_order(label: str) -> tuple[bool, str]:
    """Name a variant after a test-shape launch (e.g. "perturb bf16") before a real model's."""
    return label.split(" ")[0] in MODEL_CONFIGS, label


def _without_pointer_range(variant: Specialisation) -> Specialisation:
    """The variant without the AMD backend's pointer ranges: it compiles 32-bit offsets for tensors under
    2 GiB, a specialisation on a tensor's size (an lm_head's output at 4096 rows), not on a data value."""
    attrs = tuple((k, re.sub(r", \['tt.pointer_range', \d+\]", "", v)) for k, v in variant.attrs)
    return Specialisation(variant.kernel, variant.signature, variant.constexprs, attrs)


def default_cache() -> Path:
    """$FASTES_CACHE_DIR/aot, else ~/.cache/fastes/aot (where fastes keeps its compiled CPU library)."""
    from fastes.engine.cpu_library import cache_dir

    return cache_dir() / "aot"


def compile_cached(source, options: dict, target_name: str, label: str, cache: Path | None) -> CompileResult:
    """compile_variant, its result kept in `cache` (None: no cache) under a hash of everything it depends
    on: the kernel source with the functions it calls, the specialisation, the options, the target and the
    Triton version."""
    if cache is None:
        return compile_variant(source, options, target_name, label)
    import triton

    fields = sorted(CompileResult.__dataclass_fields__)  # what a cached file holds
    described = json.dumps(
        [source.hash(), sorted(options.items()), target_name, triton.__version__, fields], default=str
    )
    path = cache / f"{hashlib.sha256(described.encode()).hexdigest()}.json"
    if path.exists():
        result = CompileResult(**json.loads(path.read_text()))
        result.label = label
        return result
    result = compile_variant(source, options, target_name, label)
    if result.ok:  # a failure is reported again next time, never remembered
        cache.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(asdict(result)))
        tmp.replace(path)  # atomic: two processes may write the same entry
    return result


def parse_sass(sass: str) -> list[tuple[int, str, str, str]]:
    """(address, predicate, opcode with modifiers, operands) of each instruction of a cuobjdump -sass
    listing."""
    pattern = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(@!?U?P[T0-9]\s+)?([A-Z][A-Z0-9_.]*)\s*([^;]*);")
    return [(int(a, 16), p.strip(), op, rest.strip()) for a, p, op, rest in pattern.findall(sass)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.aot", description=__doc__.split("\n")[0])
    parser.add_argument("--targets", default=",".join(TARGETS), help=f"comma-separated, of {list(TARGETS)}")
    parser.add_argument("--labels", default="", help="only launches whose label matches this regex")
    parser.add_argument(
        "--models",
        default=",".join(MODEL_CONFIGS),
        help=f"real models whose launches are added, comma-separated, of {list(MODEL_CONFIGS)} (none: '')",
    )
    parser.add_argument("--json", type=Path, help="write the results here")
    parser.add_argument(
        "--cache",
        type=Path,
        default=default_cache(),
        help="where compiled results are kept (default $FASTES_CACHE_DIR/aot or ~/.cache/fastes/aot)",
    )
    parser.add_argument("--no-cache", action="store_true", help="compile everything, keep nothing")
    args = parser.parse_args(argv)
    targets = [t for t in args.targets.split(",") if t]
    models = [m for m in args.models.split(",") if m]
    try:  # bad names fail before any work, in one line
        for t in targets:
            gpu_target(t)
        for m in models:
            model_config(m)
    except ValueError as error:
        parser.error(str(error))
    import triton

    start = time.perf_counter()
    results, per_label = check(targets, args.labels, models, None if args.no_cache else args.cache)
    failed = [r for r in results if not r.ok or r.spills]
    for r in results:
        state = "FAIL" if not r.ok else "SPILL" if r.spills else "ok"
        print(
            f"{state:5s} {r.target:7s} {r.label:40s} regs={r.registers:3d} local={r.spill_bytes} "
            f"{r.seconds:5.1f}s {r.error.splitlines()[0] if r.error else ''}"
        )
    ambiguous = {label: len(v) for label, v in per_label.items() if len(v) > 1}
    for label, n in ambiguous.items():
        print(f"VARIANTS {label}: {n} compiled variants where one is expected (a data value is specialised)")
    print(
        f"{len(results)} variants, {len(failed)} failed or spilled, triton {triton.__version__}, "
        f"{time.perf_counter() - start:.0f} s"
    )
    if args.json:
        rows = [{**asdict(r), "spills": r.spills} for r in results]
        args.json.write_text(
            json.dumps(
                {
                    "triton": triton.__version__,
                    "results": rows,
                    "variants_per_label": {label: len(v) for label, v in per_label.items()},
                    "opcodes": {
                        f"{r.target} {r.label}": dict(Counter(op for _, _, op, _ in parse_sass(r.sass)))
                        for r in results
                        if r.sass
                    },
                },
                indent=1,
            )
        )
    return 1 if failed or ambiguous else 0


if __name__ == "__main__":
    sys.exit(main())
