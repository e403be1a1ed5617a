"""The compiled CPU backend (fastes.engine.cpu_library, backend "cpu") against the eager reference.

Raw Philox words and uniforms must be bit-identical; normals within the contract's 1e-6; perturb and
update (every mode) within the dtype-aware tolerances of test_perturb / test_update for Gaussian noise,
and bit for bit for sign noise (packed into chunks on 128-aligned lanes; sign arithmetic is exact).
Also: chunking, packing and the thread count never change a tensor's noise, the library is built once per
machine and reused, and without a C compiler the reference runs after one warning.
"""

import os
import subprocess
import sys
import warnings

import pytest
import torch
from conftest import NOISE_KINDS, bits, make_tensors
from test_noise import PHILOX_KAT
from test_perturb import assert_matches_reference
from test_update import assert_close_to, magnitude_of

import fastes
from fastes.engine import chunks, cpu_library, lowrank, noise, ops

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# Odd sizes, one spanning two chunks (its second chunk starts at element CHUNK).
SHAPES = [(1,), (7,), (33, 5), (4097,), (chunks.CHUNK + 5,)]
IDS = [noise.tensor_id(n) for n in ("emb", "q.weight", "mlp.weight", "lm_head.weight", "big.weight")]
SEEDS = [0, 31337]


def reference_words(key, tid, numel, offset, stream):
    c0, c1, first, _ = noise._counter_words(numel, offset, "cpu")
    words = torch.stack(noise.philox4x32(c0, c1, tid, stream, *key), dim=1).reshape(-1)
    return words[offset - first : offset - first + numel]


# ---------------------------------------------------------------------------------------------------
# The stream
# ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "n_blocks", [1, 5, 9, 300]
)  # AVX2 takes 8 blocks at a time, then scalar; 256-block tiles
def test_philox_known_answers_bit_exact(n_blocks):
    """Block 0 of a part with counter (c0, c1, c2) is the known answer; the following blocks are the
    reference's words of the next counters."""
    for (c0, c1, c2, c3), key, expected in PHILOX_KAT:
        first = c0 | c1 << 32
        table = cpu_library._table([(0, 4 * first, 4 * n_blocks, 0)], [c2], 4)
        out = cpu_library._run("words", table, c3, cpu_library.round_keys(key), n_blocks).view(-1, 4)
        assert [w & 0xFFFFFFFF for w in out[0].tolist()] == list(expected)
        blocks = [(first + i) % 2**64 for i in range(n_blocks)]  # 64-bit block indices wrap
        low = torch.tensor([b & noise.MASK32 for b in blocks])
        words = noise.philox4x32(low, torch.tensor([b >> 32 for b in blocks]), c2, c3, *key)
        assert torch.equal(out.to(torch.int64) & noise.MASK32, torch.stack(words, dim=1))


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("stream", [noise.STREAM_NOISE, noise.STREAM_ROUNDING, noise.STREAM_LOWRANK_B])
def test_raw_words_and_uniforms_bit_exact(seed, stream):
    key = noise.member_key(seed, 7, 3)
    # Offsets: unaligned, across the 2^32-block boundary (counter word 1 becomes non-zero), past 2^34.
    for tid in (noise.tensor_id("a"), 0xFFFFFFFF):
        for offset, numel in ((0, 9), (3, 70_001), (4 * (2**32 - 8) + 1, 100), (2**34 + 2, 37)):
            words = cpu_library.words(key, tid, numel, offset=offset, stream=stream)
            assert torch.equal(words, reference_words(key, tid, numel, offset, stream))
            u = cpu_library.uniform(key, tid, numel, offset=offset, stream=stream)
            assert torch.equal(u, noise.uniform(key, tid, numel, offset=offset, stream=stream))


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("offset, numel", [(0, 1), (5, 4099), (0, 2 * 65536 + 3), (2**34 + 1, 1000)])
def test_normals_within_contract_tolerance(seed, offset, numel):
    key = noise.member_key(seed, 1, 2)
    tid = noise.tensor_id("model.layers.0.mlp.up_proj.weight")
    fast = cpu_library.normal(key, tid, numel, offset=offset)
    ref = noise.normal(key, tid, numel, offset=offset)
    assert fast.shape == ref.shape and fast.dtype == torch.float32
    assert (fast - ref).abs().max().item() <= 1e-6


@pytest.mark.parametrize("seed", SEEDS)
def test_many_tensors_normals_in_shared_calls_equal_each_tensors(seed):
    """cpu_library.normals packs small tensors into shared calls (views of the call's lanes) and cuts large
    ones at CHUNK: each tensor's normals are still its own stream's, bit for bit against one call per
    tensor, empty and chunk-sized tensors included."""
    key = noise.member_key(seed, 3, 0)
    numels = [1, 5, 4099, chunks.CHUNK + 3, 0, 70, 2 * chunks.CHUNK, chunks.CHUNK]
    ids = [noise.tensor_id(f"t{i}") for i in range(len(numels))]
    together = cpu_library.normals(key, ids, numels, noise.STREAM_LOWRANK_A)
    for tid, numel, values in zip(ids, numels, together):
        assert values.shape == (numel,)
        assert torch.equal(values, cpu_library.normal(key, tid, numel, stream=noise.STREAM_LOWRANK_A))


@pytest.mark.parametrize("threads", [1, 2])
def test_every_keys_normals_in_one_call_equal_each_keys(monkeypatch, threads):
    """normals_into (the low-rank factors of every direction at once) writes each key's normals of all
    the tensors into that key's row, bit for bit what `normals` makes key by key, in rows that are a
    column slice of a wider buffer and nowhere else, split over threads or not; it refuses a buffer of
    another dtype or shape in one line."""
    monkeypatch.setattr(cpu_library, "_MIN_BLOCKS_PER_THREAD", 1)  # split even these small calls
    monkeypatch.setattr(torch, "get_num_threads", lambda: threads)
    numels = [1, 5, 4099, 70, 0, 33]
    ids = [noise.tensor_id(f"f{i}") for i in range(len(numels))]
    keys = [noise.member_key(7, 2, j) for j in range(4)]
    starts, lanes = cpu_library.whole_tensors_lanes(tuple(numels))
    wide = torch.full((len(keys), lanes + 9), float("nan"))
    cpu_library.normals_into(wide[:, 3 : 3 + lanes], keys, ids, numels, noise.STREAM_LOWRANK_B)
    for row, key in zip(wide, keys):
        own = cpu_library.normals(key, ids, numels, noise.STREAM_LOWRANK_B)
        for start, numel, values in zip(starts, numels, own):
            assert torch.equal(row[3 + start : 3 + start + numel], values)
    assert wide[:, :3].isnan().all() and wide[:, 3 + lanes :].isnan().all()
    for bad, says in (
        (torch.empty(len(keys), lanes, dtype=torch.float64), "not fp32"),
        (torch.empty(len(keys) - 1, lanes), "not fp32"),
        (torch.empty(lanes, len(keys)).T, "contiguous rows"),
        (torch.empty(len(keys), lanes + 4), f"take {lanes}"),
    ):
        with pytest.raises(ValueError, match=says):
            cpu_library.normals_into(bad, keys, ids, numels, noise.STREAM_LOWRANK_B)


def test_normals_are_fp32_whatever_the_default_dtype():
    """The library writes fp32: the buffers it writes into are fp32 even where torch's default is not."""
    key, numels = noise.member_key(5, 1, 0), [3, 40, 0]
    ids = [noise.tensor_id(f"d{i}") for i in range(len(numels))]
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        together = cpu_library.normals(key, ids, numels, noise.STREAM_LOWRANK_B)
    finally:
        torch.set_default_dtype(previous)
    for tid, numel, values in zip(ids, numels, together):
        assert values.dtype == torch.float32
        assert torch.equal(values, cpu_library.normal(key, tid, numel, stream=noise.STREAM_LOWRANK_B))


def test_docs_test_vectors():
    """docs/noise.md section 12: member_key(42, 0, 0), tensor model.layers.0.mlp.up_proj.weight."""
    key, tid = noise.member_key(42, 0, 0), 0xB16528AF
    words = cpu_library.words(key, tid, 4).tolist()
    assert words == [0x827C992A, 0x1394FBFD, 0x285EB7F1, 0xB19010E4]
    expected = torch.tensor([1.029431, 0.536736, -0.666893, -1.802619])
    assert torch.allclose(cpu_library.normal(key, tid, 4), expected, atol=2e-6)


# ---------------------------------------------------------------------------------------------------
# Perturb and update
# ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("noise_kind", NOISE_KINDS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("seed", SEEDS)
def test_perturb_matches_reference(noise_kind, dtype, seed):
    key, scale = noise.member_key(seed, 3, 1), -0.05 if seed else 0.05
    src = make_tensors(dtype, seed, SHAPES)
    before = [t.clone() for t in src]
    fast = [torch.empty_like(t) for t in src]
    ref = [torch.empty_like(t) for t in src]
    ops.perturb(src, fast, IDS, key, scale, noise_kind=noise_kind, backend="cpu")
    ops.perturb(src, ref, IDS, key, scale, noise_kind=noise_kind, backend="torch")
    for f, r, t, b in zip(fast, ref, src, before):
        assert torch.equal(t, b)  # out of place: the weights are never written
        if noise_kind == "rademacher":
            assert torch.equal(*bits([f, r]))
        else:
            assert_matches_reference(f, r, t.float(), scale)
    inplace = [t.clone() for t in src]
    ops.perturb(inplace, inplace, IDS, key, scale, noise_kind=noise_kind, backend="cpu")
    assert all(torch.equal(i, f) for i, f in zip(inplace, fast))


@pytest.mark.parametrize("noise_kind", NOISE_KINDS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("mode", ["nearest", "stochastic", "gradient"])
def test_update_matches_reference(noise_kind, dtype, mode):
    seed = DTYPES.index(dtype)
    keys = [noise.member_key(seed, 12, j) for j in range(3)]
    weights, coef, decay = [0.75, -1.25, 0.5], 0.02, 0.995
    theta = make_tensors(dtype, seed, SHAPES)
    options = {"coef": coef, "decay": decay, "noise_kind": noise_kind}
    if mode == "stochastic":
        options["rounding_key"] = noise.rounding_key(seed, 12)
    results = {}
    for backend in ("cpu", "torch"):
        params = [t.clone() for t in theta]
        grads = [torch.full_like(t, float("nan")) for t in theta] if mode == "gradient" else None
        ops.es_update(params, IDS, keys, weights, grads=grads, backend=backend, **options)
        if mode == "gradient":
            assert all(torch.equal(p, t) for p, t in zip(params, theta))
        results[backend] = grads if mode == "gradient" else params
    for f, r, t in zip(results["cpu"], results["torch"], theta):
        if noise_kind == "rademacher":
            assert torch.equal(*bits([f, r]))
            continue
        if mode != "gradient":
            assert_close_to(f, r, magnitude_of(t, weights, coef, decay))
            continue
        # A gradient is a sum of noises that can cancel to ~0, where a 16-bit ulp is far below the
        # ~1e-7 by which the sums may differ: allow that absolute difference, or one ulp of the value.
        ulp = torch.finfo(t.dtype).eps * r.float().abs()
        allowed = torch.maximum(ulp, 1e-6 * magnitude_of(torch.zeros_like(t), weights, coef))
        assert ((f.float() - r.float()).abs() <= allowed).all()
    changed = sum(int((f != t).sum()) for f, t in zip(results["cpu"], theta))
    assert changed > 0.5 * sum(t.numel() for t in theta)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])  # fp32 in place, bf16 chunk by chunk
def test_noise_does_not_depend_on_packing_or_other_tensors(dtype):
    """Within the compiled backend, bit for bit: alone, packed with others, or in a large layout."""
    key = noise.member_key(2, 0, 1)
    a, b, c = make_tensors(dtype, 9, [(1030,), (chunks.CHUNK - 3,), (5,)])
    alone = torch.empty_like(a)
    ops.perturb([a], [alone], [IDS[1]], key, 0.1, backend="cpu")
    together = [torch.empty_like(t) for t in (b, a, c)]
    ops.perturb([b, a, c], together, [IDS[0], IDS[1], IDS[2]], key, 0.1, backend="cpu")
    assert torch.equal(together[1], alone)
    eps = cpu_library.normal(key, IDS[1], a.numel())
    # src + fp32(scale) * eps, the product and the sum each rounded once, then rounded to the dtype
    assert torch.equal(alone, (a.float() + eps * 0.1).to(dtype))
    big = torch.zeros(chunks.CHUNK * 3 + 11, dtype=dtype)  # chunk starts line up with the stream
    ops.perturb([big], [big], [IDS[4]], key, 1.0, backend="cpu")
    assert torch.equal(big, cpu_library.normal(key, IDS[4], big.numel()).to(dtype))


def test_lowrank_factors_match_reference():
    key, tid = noise.member_key(3, 1, 0), noise.tensor_id("w")
    a, b = lowrank.factors(key, tid, torch.Size((33, 70)), 3, torch.device("cpu"), "cpu")
    ra, rb = lowrank.factors(key, tid, torch.Size((33, 70)), 3, torch.device("cpu"), "torch")
    assert a.shape == (33, 3) and b.shape == (70, 3)
    assert (a - ra).abs().max() <= 1e-6 and (b - rb).abs().max() <= 1e-6


def test_thread_count_does_not_change_the_noise(monkeypatch):
    monkeypatch.setattr(cpu_library, "_MIN_BLOCKS_PER_THREAD", 1)  # split even small calls across threads
    key, rounding = noise.member_key(5, 2, 7), noise.rounding_key(5, 2)
    keys, weights = [noise.member_key(5, 2, j) for j in range(3)], [0.5, -1.0, 0.25]
    results = []
    previous = torch.get_num_threads()
    try:
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            params = make_tensors(torch.bfloat16, 3, [(4097,), (7,), (chunks.CHUNK + 5,)])
            ops.es_update(params, IDS[:3], keys, weights, coef=0.1, rounding_key=rounding, backend="cpu")
            signs = [t.float() for t in params]
            ops.es_update(signs, IDS[:3], keys, weights, coef=0.1, noise_kind="rademacher", backend="cpu")
            results.append([cpu_library.normal(key, IDS[0], 10_001, offset=3), *params, *signs])
    finally:
        torch.set_num_threads(previous)
    assert all(torch.equal(x, y) for other in results[1:] for x, y in zip(results[0], other))


def test_portable_build_gives_the_same_bits(monkeypatch, tmp_path):
    """Without -march=native (no AVX2 Philox path; fmaf without FMA instructions) every output is the
    same bits as this machine's native build: results do not depend on the CPU."""
    key, tid = noise.member_key(9, 1, 4), noise.tensor_id("portable.weight")
    params = make_tensors(torch.bfloat16, 5, [(3, 333), (4097,)])
    keys, weights = [noise.member_key(9, 1, j) for j in range(3)], [0.5, -1.0, 0.25]

    def outputs():
        updated = [t.clone() for t in params]
        ops.es_update(updated, IDS[:2], keys, weights, coef=0.1, rounding_key=(3, 4), backend="cpu")
        signs = [t.float() for t in params]
        ops.es_update(signs, IDS[:2], keys, weights, coef=0.1, noise_kind="rademacher", backend="cpu")
        return [
            cpu_library.normal(key, tid, 70_001, offset=5),
            cpu_library.words(key, tid, 999),
            *updated,
            *signs,
        ]

    native = outputs()
    monkeypatch.setattr(cpu_library, "_ARCH_FLAGS", {})
    monkeypatch.setattr(cpu_library, "_library", None)
    monkeypatch.setenv("FASTES_CACHE_DIR", str(tmp_path))
    portable = outputs()
    assert cpu_library._load()._name.startswith(str(tmp_path))  # really the portable build
    assert all(torch.equal(a, b) for a, b in zip(native, portable))


def test_library_is_built_once_per_machine_and_reused(tmp_path):
    """Any tensor size, key or process reuses the one cached build: nothing is compiled per shape."""
    code = (
        "import torch; from fastes.engine import cpu_library, noise, ops\n"
        "for i, n in enumerate([1, 5, 333, 65_537, 300_001]):\n"
        "    t = torch.randn(n); ops.perturb([t], [torch.empty_like(t)], [i], (i, 1), 0.1, backend='cpu')\n"
        "    ops.es_update([t.bfloat16()], [i], [(i, 2)] * 3, [1.0] * 3, coef=0.1, rounding_key=(0, i))\n"
        "print(cpu_library._load()._name)\n"
    )
    env = {**os.environ, "FASTES_CACHE_DIR": str(tmp_path)}
    paths, stamps = [], []
    for _ in range(2):
        out = subprocess.run(
            [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300
        )
        assert out.returncode == 0, out.stderr[-2000:]
        paths.append(out.stdout.strip())
        stamps.append(os.stat(paths[-1]).st_mtime_ns)
    assert paths[0] == paths[1] and stamps[0] == stamps[1]
    assert [p.name for p in tmp_path.iterdir()] == [os.path.basename(paths[0])]


# ---------------------------------------------------------------------------------------------------
# Fallback and reproducibility records
# ---------------------------------------------------------------------------------------------------


def test_failed_build_falls_back_to_reference_with_one_warning(monkeypatch, tmp_path):
    broken = tmp_path / "broken-cc"
    broken.write_text("#!/bin/sh\necho 'error: no toolchain here' >&2\nexit 1\n")
    broken.chmod(0o755)
    monkeypatch.setenv("CC", str(broken))
    monkeypatch.setenv("FASTES_CACHE_DIR", str(tmp_path / "cache"))  # no earlier build to reuse
    for name, value in (("_library", None), ("_unavailable", None)):
        monkeypatch.setattr(cpu_library, name, value)
    src = make_tensors(torch.bfloat16, 1, SHAPES)
    ref = [torch.empty_like(t) for t in src]
    ops.perturb(src, ref, IDS, (5, 6), 0.1, backend="torch")
    out = [t.clone() for t in src]
    with pytest.warns(RuntimeWarning, match="compiled CPU backend is unavailable.*no toolchain here"):
        ops.perturb(out, out, IDS, (5, 6), 0.1)
    assert all(torch.equal(o, r) for o, r in zip(out, ref))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # warned once, not again
        assert ops.resolve_backend(src) == "torch"
        params = [t.clone() for t in src]
        ops.es_update(params, IDS, [(5, 6)], [1.0], coef=0.1)


def test_without_a_c_compiler_the_reference_runs(tmp_path):
    code = (
        "import torch, warnings; from fastes.engine import noise, ops\n"
        "t = [torch.randn(1000)]; a = [torch.empty(1000)]; b = [torch.empty(1000)]\n"
        "with warnings.catch_warnings(record=True) as w:\n"
        "    warnings.simplefilter('always')\n"
        "    ops.perturb(t, a, [7], (1, 2), 0.5); ops.perturb(t, a, [7], (1, 2), 0.5)\n"
        "ops.perturb(t, b, [7], (1, 2), 0.5, backend='torch')\n"
        "print(len(w), ops.resolve_backend(t), torch.equal(a[0], b[0]), str(w[0].message)[:80])\n"
    )
    env = {**os.environ, "CC": str(tmp_path / "no-such-cc"), "FASTES_CACHE_DIR": str(tmp_path)}
    env.pop("FASTES_BACKEND", None)
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    count, backend, equal, message = out.stdout.split(" ", 3)
    assert (count, backend, equal) == ("1", "torch", "True")
    assert "compiled CPU backend is unavailable" in message


def test_state_records_backend_and_other_backends_warn():
    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.randn(16, 8))
    es = fastes.ES([("w", w)], sigma=0.1, lr=0.1, population=4, backend="cpu", checksum_every=0)
    es.step(lambda: float(w.sum()))
    state = es.state_dict()
    assert state["backend"] == "cpu"
    same = fastes.ES([("w", w)], sigma=0.1, lr=0.1, population=4, backend="auto", checksum_every=0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        same.load_state_dict(state)
    other = fastes.ES([("w", w)], sigma=0.1, lr=0.1, population=4, backend="torch", checksum_every=0)
    with pytest.warns(RuntimeWarning, match="recorded on backend 'cpu' with backend 'torch'"):
        other.load_state_dict(state)
    with pytest.warns(RuntimeWarning, match="float tolerance"):
        fastes.replay([("w", torch.zeros(16, 8))], state, backend="torch")
