"""A predicted ES iteration of real models on an H100 and an H200: not measured.

For each model of `benchmarks.aot.MODEL_CONFIGS` (shapes only, built on the meta device), one ES
generation of POPULATION members x PROMPTS prompts x NEW_TOKENS new tokens in bf16 is costed in each
evaluation mode from two kinds of figures:
- the noise work of fastes, from the kernels' sm_90 SASS counts (`benchmarks.static`): perturb per
  member (restore is a pointer swap: free), the in-matmul noise of virtual evaluation, the low-rank
  factors and their GEMMs, and the update;
- the generation, from the bytes it must read (weights, member weight copies, the KV cache) at the copy
  bandwidth and its FLOPs at the tensor-core peak, step by step (a floor: no kernel launch latency,
  no attention FLOPs, perfect overlap of reads and math).
Each mode runs its members in the largest groups that fit in 90% of the GPU's memory.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch

from fastes.engine.kernels.lowrank_linear import BLOCK_N, products_first

POPULATION = 32  # members (16 antithetic directions)
PROMPTS = 64  # prompts per member
NEW_TOKENS = 256
PROMPT_TOKENS = 64  # assumed prompt length (prefill)
RANK = 1  # low-rank noise
# A launch of a small kernel (the low-rank products): its start and drain, which a kernel reading a few
# MB does not hide. The generation's own launches are left out (a floor); this one is fastes' extra.
LAUNCH_US = 3.0
MODES = ("member", "materialised", "virtual", "lowrank")
NOTES = [
    f"Scenario: population {POPULATION} (antithetic: {POPULATION // 2} directions) x {PROMPTS} prompts "
    f"of {PROMPT_TOKENS} tokens x {NEW_TOKENS} new tokens, bf16 weights, Gaussian noise, low-rank rank "
    f"{RANK}; every projection matrix evolves (fastes.linear_weights: a tied lm_head does not).",
    "Generation per step = sum over its parts of max(bytes read / copy bandwidth, FLOPs / dense bf16 "
    "peak): the evolved projections (one weight copy per member in 'member' and 'materialised' mode, "
    "and in 'virtual' mode too: its grid walks member by member, so each member re-reads the weights), "
    "then the other matmuls and the KV cache (mean context). Kernel launch latency (CUDA graphs), "
    "attention FLOPs and sampling are left out: a floor.",
    "Members run in the largest groups that fit in 90% of HBM: bf16 weights, the group's KV cache at "
    "full context, plus one weight copy per member of the group ('materialised') or one work buffer "
    "('member').",
    "Noise work: perturb = members x evolved elements at the perturb kernel's predicted rate; virtual = "
    "the virtual_linear kernel's noise (its SASS loop per noise element, tile of 64 rows in decode, 128 "
    "in prefill, regenerated per 128-row tile) beyond the time of the same step without noise; "
    "low-rank = the factors' normals, the rank-r term of the low-rank layer "
    "(fastes/engine/kernels/lowrank_linear.py: its epilogue multiplies each row's r products into the "
    "output factors; the products are summed inside the GEMM's K loop, redone by each of the out / 64 "
    "column tiles, or, where rank x tiles >= 32 (products_first), first by a launch per projection and "
    "forward pass that reads x once at the copy bandwidth, reads each member's input factors and writes "
    f"r fp32 numbers per row, plus {LAUNCH_US:g} us per launch; the FMAs on the CUDA cores at the fp32 "
    "peak, not overlapped with the GEMM; each member's factors read from HBM once per forward pass) and "
    "the update's fp32 GEMM on the CUDA cores; update = the fused update over 16 directions at its "
    "predicted rate.",
    "'fastes share' = noise work / predicted iteration; 'x floor' = iteration / plain inference of the "
    "same tokens with shared weights (all members in one batch where it fits).",
]


@dataclass(frozen=True)
class Device:
    name: str
    sms: int
    clock_ghz: float
    copy_tb_s: float  # achievable device-to-device copy, read + write bytes per second
    memory_gb: float  # HBM
    bf16_tflops: float  # dense tensor-core peak
    fp32_tflops: float  # FP32 on the CUDA cores (the low-rank update's GEMM)


DEVICES = [
    Device("H100 SXM", 132, 1.755, 3.0, 80, 989, 67),
    Device("H200 SXM", 132, 1.755, 4.3, 141, 989, 67),
]


@dataclass(frozen=True)
class ModelShape:
    """What the cost model needs of a model: parameter counts and the KV cache per token."""

    name: str
    evolved: int  # elements of the evolved projection matrices
    matmul: int  # elements of every matmul weight read per token (a tied lm_head included)
    total: int  # every parameter, stored once
    shapes: tuple  # (outputs, inputs) of each evolved projection matrix
    factor_rows: int  # sum over evolved matrices of (rows + columns): low-rank factor numbers at rank 1
    input_features: int  # sum over evolved matrices of their columns (the projection's input width)
    kv_bytes_per_token: int  # bf16 keys and values of all layers, one row


def model_shape(name: str) -> ModelShape:
    """Count a real model's parameters from its transformers config, built on the meta device."""
    from transformers import AutoModelForCausalLM

    from benchmarks import aot

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(aot.model_config(name), dtype=torch.bfloat16)
    return shape_of(model, name)


def shape_of(model: torch.nn.Module, name: str) -> ModelShape:
    """The ModelShape of a transformers causal LM (any device, meta included)."""
    import fastes

    config = model.config
    evolved = [p for _, p in fastes.linear_weights(model, warn=False)]
    matmul = [m.weight for m in model.modules() if isinstance(m, torch.nn.Linear)]
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return ModelShape(
        name=name,
        evolved=sum(p.numel() for p in evolved),
        matmul=sum(w.numel() for w in matmul),
        total=sum(p.numel() for p in model.parameters()),
        shapes=tuple(tuple(p.shape) for p in evolved),
        factor_rows=sum(sum(p.shape) for p in evolved),
        input_features=sum(p.shape[1] for p in evolved),
        kv_bytes_per_token=config.num_hidden_layers * 2 * config.num_key_value_heads * head_dim * 2,
    )


@dataclass(frozen=True)
class NoiseRates:
    """Predicted seconds per element of the noise kernels on one device (from their SASS)."""

    perturb: float  # per evolved element and member
    update: float  # per evolved element, all directions
    fill: float  # per normal (low-rank factors)
    virtual_decode: float  # per noise element of one 64-row tile
    virtual_prefill: float  # per noise element of one 128-row tile


def _seconds(bytes_: float, flops: float, device) -> float:
    return max(bytes_ / (device.copy_tb_s * 1e12), flops / (device.bf16_tflops * 1e12))


def _group(model: ModelShape, device, per_member_bytes: float) -> int:
    """The most members whose generation fits in 90% of the device's memory (0: not even one)."""
    free = 0.9 * device.memory_gb * 1e9 - 2 * model.total
    kv = PROMPTS * (PROMPT_TOKENS + NEW_TOKENS) * model.kv_bytes_per_token
    return max(0, min(POPULATION, int(free // (per_member_bytes + kv))))


def _generation(model: ModelShape, device, group: int, evolved_copies: int) -> float:
    """Seconds to generate for all members in groups of `group`, reading `evolved_copies` copies of
    the evolved weights per group and step (1: shared weights)."""
    calls = math.ceil(POPULATION / group)
    rows = group * PROMPTS
    other = model.matmul - model.evolved
    kv_read = rows * (PROMPT_TOKENS + NEW_TOKENS / 2) * model.kv_bytes_per_token
    step = _seconds(evolved_copies * 2 * model.evolved, 2 * model.evolved * rows, device) + _seconds(
        2 * other + kv_read, 2 * other * rows, device
    )
    prefill = _seconds(
        evolved_copies * 2 * model.evolved + 2 * other, 2 * model.matmul * rows * PROMPT_TOKENS, device
    )
    return calls * (prefill + NEW_TOKENS * step)


def perturb_seconds(model: ModelShape, rates: NoiseRates, members: int) -> float:
    """Perturb every evolved weight for `members` members (restore swaps pointers back: free)."""
    return members * model.evolved * rates.perturb


def update_seconds(model: ModelShape, rates: NoiseRates) -> float:
    """The fused full-rank update (all directions in one pass)."""
    return model.evolved * rates.update


def virtual_noise_seconds(
    model: ModelShape, device, rates: NoiseRates, members: int, rows_per_member: int
) -> float:
    """What regenerating the noise inside virtual_linear adds to one forward pass of `members` x
    `rows_per_member` rows: its noise work beyond the time of the same matmuls without noise (one weight
    copy read per member). Up to 64 rows one tile per member (the 64-row rate), else 128-row tiles."""
    rows = members * rows_per_member
    clean = _seconds(members * 2 * model.evolved, 2 * model.evolved * rows, device)
    if rows_per_member <= 64:
        noise = members * model.evolved * rates.virtual_decode
    else:
        noise = members * model.evolved * math.ceil(rows_per_member / 128) * rates.virtual_prefill
    return max(clean, noise) - clean


def lowrank_noise_seconds(
    model: ModelShape, device, rates: NoiseRates, members: int, tokens: int, forwards: int = 1
) -> float:
    """Low-rank evaluation: the members' factors (normals), and what the rank-r term adds to the base
    GEMM over `tokens` rows in `forwards` forward passes, as fastes.es.population.LowRankLinear computes
    it on a GPU. Each row's r products with its member's input factors are computed one of two ways per
    matrix (`products_first` of fastes/engine/kernels/lowrank_linear.py):
    - inside the GEMM's K loop, redone by each of the out / BLOCK_N column tiles (2 in FLOPs per rank,
      row and tile);
    - or first, by a launch per forward pass that reads x once (2 bytes per input feature of every row)
      and each member's input factors and writes r fp32 numbers per row, at the copy bandwidth (its FLOPs
      are far below the bf16 peak's balance), plus LAUNCH_US; the GEMM's K loop is then the plain one.
    The epilogue multiplies the products into the output factors (2 out FLOPs per rank). The FLOPs are
    fp32 FMAs on the CUDA cores, priced at their peak and not overlapped with the tensor cores' GEMM; the
    GEMM reads each member's factors from HBM once per forward pass, the rest from L1/L2."""
    factors = members * RANK * model.factor_rows * rates.fill
    first = [(n_out, n_in) for n_out, n_in in model.shapes if products_first(RANK, n_out)]
    in_gemm = [(n_out, n_in) for n_out, n_in in model.shapes if not products_first(RANK, n_out)]
    first_inputs = sum(n_in for _, n_in in first)
    products_bytes = tokens * (2 * first_inputs + 4 * RANK * len(first))
    products_bytes += forwards * members * RANK * 2 * first_inputs
    products = products_bytes / (device.copy_tb_s * 1e12) + forwards * len(first) * LAUNCH_US * 1e-6
    outputs = sum(n_out for n_out, _ in model.shapes)
    recomputed = sum(n_in * math.ceil(n_out / BLOCK_N) for n_out, n_in in in_gemm)
    flops = 2 * tokens * RANK * (recomputed + outputs)
    reads = forwards * members * RANK * 2 * (outputs + sum(n_in for _, n_in in in_gemm))
    gemm = max(flops / (device.fp32_tflops * 1e12), reads / (device.copy_tb_s * 1e12))
    return factors + products + gemm


def lowrank_update_seconds(model: ModelShape, device, rates: NoiseRates, directions: int) -> float:
    """The low-rank update: the directions' factors again and one fp32 GEMM per matrix on the CUDA cores,
    reading and writing theta and the fp32 step."""
    factors = directions * RANK * model.factor_rows * rates.fill
    gemm = 2 * model.evolved * directions * RANK / (device.fp32_tflops * 1e12)
    return factors + gemm + (2 + 2 + 4 + 4) * model.evolved / (device.copy_tb_s * 1e12)


def iteration(model: ModelShape, device, rates: NoiseRates) -> dict:
    """Predicted seconds of one ES iteration per evaluation mode: generation, noise work, their sum."""
    directions = POPULATION // 2
    buffer = 2 * model.evolved
    plain_group = _group(model, device, 0)
    floor = _generation(model, device, plain_group, 1) if plain_group else math.inf
    modes = {}
    for mode in MODES:
        if mode == "member":  # one member at a time, perturbed into one work buffer
            group = min(1, _group(model, device, buffer))
        else:  # materialised: one weight copy per member of the batch
            group = _group(model, device, buffer if mode == "materialised" else 0)
        if group == 0:
            modes[mode] = {"fits": False}
            continue
        calls = math.ceil(POPULATION / group)
        if mode in ("member", "materialised"):
            generation = _generation(model, device, group, group)
            noise = perturb_seconds(model, rates, POPULATION) + update_seconds(model, rates)
        elif mode == "virtual":
            generation = _generation(model, device, group, group)
            decode = virtual_noise_seconds(model, device, rates, group, PROMPTS)
            prefill = virtual_noise_seconds(model, device, rates, group, PROMPTS * PROMPT_TOKENS)
            noise = calls * (NEW_TOKENS * decode + prefill) + update_seconds(model, rates)
        else:  # lowrank: shared weights
            generation = _generation(model, device, group, 1)
            tokens = POPULATION * PROMPTS * (PROMPT_TOKENS + NEW_TOKENS)
            forwards = calls * (1 + NEW_TOKENS)  # a prefill, then one pass per new token
            noise = lowrank_noise_seconds(model, device, rates, POPULATION, tokens, forwards)
            noise += lowrank_update_seconds(model, device, rates, directions)
        total = generation + noise
        modes[mode] = {
            "fits": True,
            "group": group,
            "generation_s": generation,
            "noise_s": noise,
            "total_s": total,
            "fastes_share": noise / total,
            "x_floor": total / floor,
        }
    return {"floor_s": floor, "modes": modes, "choice": choose(modes)}


def choose(modes: dict) -> dict:
    """The fastest mode that fits, and the fastest full-rank one (low-rank noise is another search
    distribution, so the choice of full-rank noise is given too)."""
    fitting = {m: v for m, v in modes.items() if v["fits"]}
    best = min(fitting, key=lambda m: fitting[m]["total_s"])
    full = {m: v for m, v in fitting.items() if m != "lowrank"}
    best_full = min(full, key=lambda m: full[m]["total_s"]) if full else None
    return {"mode": best, "full_rank_mode": best_full}


def reason(model: str, device: str, result: dict) -> str:
    """Which mode the figures choose, and the figures that decide it."""
    modes = result["modes"]
    chosen = result["choice"]["full_rank_mode"]
    if chosen is None:
        return f"{model} on {device}: no full-rank mode fits"
    v = modes[chosen]
    others = ", ".join(
        f"{m} {o['total_s']:.1f} s" for m, o in modes.items() if o["fits"] and m not in (chosen, "lowrank")
    )
    text = (
        f"{model} on {device}: full-rank noise -> {chosen}, {v['total_s']:.1f} s "
        f"({others or 'nothing else fits'}): its generation reads one weight copy per member and step, "
        f"{v['x_floor']:.1f}x plain inference, and "
        f"fastes' own noise work is {100 * v['fastes_share']:.1f}% of the iteration."
    )
    materialised, virtual = modes["materialised"], modes["virtual"]
    if chosen == "materialised":
        text += f" A batch of {materialised['group']} members shares the reads of the unevolved weights."
    elif materialised["fits"]:
        text += f" Materialised fits only {materialised['group']} members per batch."
    if virtual["fits"] and chosen != "virtual":
        text += (
            f" Virtual reads the same copies and regenerates every member's noise at every step: "
            f"+{virtual['noise_s']:.1f} s."
        )
    lowrank = modes["lowrank"]
    if lowrank["fits"]:
        text += (
            f" With low-rank noise (rank {RANK}; another search distribution): lowrank, "
            f"{lowrank['total_s']:.1f} s, {lowrank['x_floor']:.2f}x the floor."
        )
    return text


def model_iterations(rates: dict, models: list[str] | None = None) -> dict:
    """Predictions for each model and device; `rates` maps a device name to its NoiseRates."""
    from benchmarks import aot

    out = {}
    for name in models or list(aot.MODEL_CONFIGS):
        shape = model_shape(name)
        per_device = {d.name: iteration(shape, d, rates[d.name]) for d in DEVICES}
        out[name] = {
            "shape": asdict(shape),
            "devices": per_device,
            "reasons": [reason(name, d, r) for d, r in per_device.items()],
        }
    return out


def markdown(iterations: dict) -> list[str]:
    """The report's section on real models (predicted)."""
    lines = [
        f"## Predicted ES iteration of real models (bf16, population {POPULATION} x {PROMPTS} prompts x "
        f"{NEW_TOKENS} new tokens) -- predicted, not measured",
        "",
        "| model | evolved params | GPU | floor (plain inference) | mode | members per batch | generation "
        "| noise work | iteration | fastes share | x floor |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, m in iterations.items():
        for device, result in m["devices"].items():
            for mode, v in result["modes"].items():
                if not v["fits"]:
                    lines.append(f"| {name} | | {device} | | {mode} | does not fit | | | | | |")
                    continue
                chosen = " (chosen)" if mode == result["choice"]["full_rank_mode"] else ""
                lines.append(
                    f"| {name} | {m['shape']['evolved'] / 1e6:.0f}M | {device} | {result['floor_s']:.2f} s | "
                    f"{mode}{chosen} | {v['group']} | {v['generation_s']:.2f} s | {v['noise_s']:.3f} s | "
                    f"{v['total_s']:.2f} s | {100 * v['fastes_share']:.1f}% | {v['x_floor']:.2f} |"
                )
    lines += ["", "Which mode, and why:", ""]
    lines += [f"- {r}" for m in iterations.values() for r in m["reasons"]]
    lines += ["", "Assumptions of this section:", ""] + [f"- {n}" for n in NOTES]
    return lines
