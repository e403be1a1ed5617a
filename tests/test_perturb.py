"""Multi-tensor perturb: interpreted Triton kernel vs the torch reference, exact restore, bad input."""

import math

import pytest
import torch
import triton
import triton.language as tl
from conftest import NOISE_KINDS, bits, make_tensors, ordered

from fastes.engine import cpu_library, noise, ops
from fastes.engine.kernels.rounding import round_to

SHAPES = [(1,), (7,), (33, 5), (4097,)]  # odd sizes; the last spans 33 sign blocks and 5 kernel tiles
NAMES = ["emb", "layers.0.q.weight", "layers.0.mlp.weight", "lm_head.weight"]
IDS = [noise.tensor_id(n) for n in NAMES]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
SIGMA = 0.05


def assert_matches_reference(result, expected, theta, scale):
    """fp32: within 1e-6 of the operands' magnitude; 16-bit: equal except < 1% off by exactly one ulp
    (normals differ by ~1e-7 between the interpreter's numpy and torch, which can flip a rounding)."""
    assert result.dtype == expected.dtype and result.shape == expected.shape
    if result.dtype == torch.float32:
        magnitude = theta.abs() + abs(scale) * 6  # |eps| <= 5.8
        assert ((result - expected).abs() <= 1e-6 * magnitude).all()
        return
    ulps = (ordered(result) - ordered(expected)).abs()
    assert ulps.max().item() <= 1
    assert (ulps > 0).float().mean().item() < 0.01


def assert_kernel_matches(noise_kind, results, expected, sources, scale):
    """Sign noise: bit for bit (sign arithmetic is exact); Gaussian: assert_matches_reference."""
    if noise_kind == "rademacher":
        assert all(torch.equal(a, b) for a, b in zip(bits(results), bits(expected)))
        return
    for r, e, t in zip(results, expected, sources):
        assert_matches_reference(r, e, t.float(), scale)


def naive(theta, tid, key, scale, noise_kind="gaussian"):
    """The formula, one tensor at a time: round(fp32(theta) + scale * eps) to theta's dtype."""
    eps = noise.sample(noise_kind, key, tid, theta.numel()).view(theta.shape)
    return (theta.to(torch.float32) + scale * eps).to(theta.dtype)


@pytest.mark.parametrize("noise_kind", NOISE_KINDS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("seed", [0, 31337])
@pytest.mark.parametrize("sign", [1, -1])
def test_kernel_matches_reference(noise_kind, dtype, seed, sign):
    key = noise.member_key(seed, 3, 1)
    scale = sign * SIGMA
    src = make_tensors(dtype, seed, SHAPES)
    before = [t.clone() for t in src]
    expected = [torch.empty_like(t) for t in src]
    ops.perturb(src, expected, IDS, key, scale, noise_kind=noise_kind, backend="torch")
    for e, t, tid in zip(expected, src, IDS):
        assert torch.equal(e, naive(t, tid, key, scale, noise_kind))
    # Out of place.
    out = [torch.full_like(t, float("nan")) for t in src]
    ops.perturb(src, out, IDS, key, scale, noise_kind=noise_kind, backend="triton")
    assert_kernel_matches(noise_kind, out, expected, before, scale)
    assert all(torch.equal(a, b) for a, b in zip(bits(src), bits(before)))
    # In place (dst is src).
    ops.perturb(src, src, IDS, key, scale, noise_kind=noise_kind, backend="triton")
    assert_kernel_matches(noise_kind, src, expected, before, scale)
    # The perturbation is visible: most elements moved.
    changed = sum((a != b).sum().item() for a, b in zip(src, before))
    assert changed > 0.9 * sum(t.numel() for t in src)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_noise_does_not_depend_on_other_tensors(backend):
    key = noise.member_key(8, 0, 2)
    a = make_tensors(torch.float32, 1, [(1030,)])[0]
    b, c = make_tensors(torch.float32, 2, [(7,), (2049,)])
    alone = [torch.empty_like(a)]
    ops.perturb([a], alone, [IDS[1]], key, SIGMA, backend=backend)
    together = [torch.empty_like(t) for t in (b, a, c)]
    ops.perturb([b, a, c], together, [IDS[0], IDS[1], IDS[2]], key, SIGMA, backend=backend)
    assert torch.equal(together[1], alone[0])
    # Mixed dtypes (one launch per dtype) do not change it either.
    mixed = [torch.empty_like(t) for t in (b.bfloat16(), a, c.half())]
    ops.perturb([b.bfloat16(), a, c.half()], mixed, [IDS[0], IDS[1], IDS[2]], key, SIGMA, backend=backend)
    assert torch.equal(mixed[1], alone[0])
    # ...but the noise does depend on the tensor id: same tensor, another id, another perturbation.
    other = [torch.empty_like(a)]
    ops.perturb([a], other, [IDS[3]], key, SIGMA, backend=backend)
    assert not torch.equal(other[0], alone[0])


@pytest.mark.parametrize("noise_kind", NOISE_KINDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_antithetic_pair_differs_in_sign_only(noise_kind, dtype, backend):
    key = noise.member_key(4, 4, 4)
    zeros = [torch.zeros(s, dtype=dtype) for s in SHAPES]
    plus = [torch.empty_like(t) for t in zeros]
    minus = [torch.empty_like(t) for t in zeros]
    ops.perturb(zeros, plus, IDS, key, SIGMA, noise_kind=noise_kind, backend=backend)
    ops.perturb(zeros, minus, IDS, key, -SIGMA, noise_kind=noise_kind, backend=backend)
    for p, m in zip(plus, minus):
        assert torch.equal(p, -m)
        assert (p != 0).float().mean().item() > 0.99
        if noise_kind == "rademacher":  # every element moves by exactly sigma
            assert set(p.abs().unique().tolist()) == {torch.tensor(SIGMA, dtype=dtype).item()}
    # Without noise_kind the noise is Gaussian: the default is unchanged.
    default = [torch.empty_like(t) for t in zeros]
    ops.perturb(zeros, default, IDS, key, SIGMA, backend=backend)
    assert torch.equal(default[3], plus[3]) == (noise_kind == "gaussian")


def test_zero_scale_is_identity():
    src = make_tensors(torch.bfloat16, 5, SHAPES)
    out = [torch.empty_like(t) for t in src]
    ops.perturb(src, out, IDS, noise.member_key(0, 0, 0), 0.0, backend="triton")
    assert all(torch.equal(a, b) for a, b in zip(out, src))


@pytest.mark.parametrize("backend, cycles", [("torch", 300), ("triton", 12)])
def test_out_of_place_perturb_never_modifies_weights(backend, cycles):
    # The exact-restore design: weights stay where they are, each member's perturbed copy is written to
    # one work buffer, so "restoring" is a no-op and the weights are bit-identical after any number of
    # evaluations. Shapes are kept small for the interpreted kernel.
    shapes = SHAPES if backend == "torch" else [(7,), (33, 5), (1030,)]
    ids = IDS[: len(shapes)]
    weights = make_tensors(torch.bfloat16, 9, shapes)
    pristine = [w.clone() for w in weights]
    work = [torch.empty_like(w) for w in weights]
    for cycle in range(cycles):
        key = noise.member_key(77, cycle // 2, cycle % 5)
        scale = SIGMA if cycle % 2 == 0 else -SIGMA
        ops.perturb(weights, work, ids, key, scale, backend=backend)
        if cycle == cycles - 1:
            for w, buf, tid in zip(pristine, work, ids):
                assert_matches_reference(buf, naive(w, tid, key, scale), w.float(), scale)
    for w, p in zip(weights, pristine):
        assert torch.equal(w.view(torch.int16), p.view(torch.int16))


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_in_place_add_then_subtract_does_not_restore_bf16(backend):
    # The documented reason for the design above: theta + sigma*eps - sigma*eps != theta once rounded to
    # bf16 in between (DESIGN.md measured ~5-8% of elements at sigma = 1e-3). Weights at a typical LM
    # scale (std 0.02), where sigma * eps is a few bf16 ulps.
    before = (make_tensors(torch.float32, 3, [(4096,)])[0] * 0.02).bfloat16()
    weights = [before.clone()]
    key = noise.member_key(1, 0, 0)
    ops.perturb(weights, weights, IDS[:1], key, 1e-3, backend=backend)
    ops.perturb(weights, weights, IDS[:1], key, -1e-3, backend=backend)
    differ = (weights[0] != before).float().mean().item()
    assert differ > 0.01
    # In fp32 the same cycle is not exact either, but it is far closer: the bf16 drift is the problem.
    w32 = [before.float()]
    ops.perturb(w32, w32, IDS[:1], key, 1e-3, backend=backend)
    ops.perturb(w32, w32, IDS[:1], key, -1e-3, backend=backend)
    assert (w32[0] - before.float()).abs().max().item() < 1e-6


@triton.jit
def _to_bf16_kernel(src, dst, N: tl.constexpr):
    i = tl.arange(0, N)
    tl.store(dst + i, round_to(tl.load(src + i), tl.bfloat16))


def test_kernel_bf16_rounding_matches_torch():
    # fastes.engine.kernels.rounding.round_to: fp32 -> bf16 to nearest, ties to even, overflow to inf, NaN
    # kept, as torch does. (The interpreter's own cast truncates: 1 + 5/8 ulp would become 1.)
    one_ulp = 2.0**-7
    values = [
        1 + one_ulp / 2,
        1 + 3 * one_ulp / 2,
        1 + 3 * one_ulp / 8,
        1 + 5 * one_ulp / 8,
        -(1 + 5 * one_ulp / 8),
    ]
    values += [0.0, -0.0, 2.0**-130 * 1.7, 3.4e38, float("inf"), -float("inf"), float("nan")]
    src = torch.tensor(values + [0.0] * (16 - len(values)), dtype=torch.float32)
    dst = torch.empty(16, dtype=torch.bfloat16)
    _to_bf16_kernel[(1,)](src, dst, N=16)
    nan = torch.isnan(src)
    assert torch.isnan(dst[nan]).all()
    assert torch.equal(dst[~nan].view(torch.int16), src[~nan].bfloat16().view(torch.int16))
    assert dst[1].item() == 1 + 2 * one_ulp and math.isinf(dst[8].item())


# ---------------------------------------------------------------------------------------------------
# Bad input
# ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_bad_input_raises_clear_errors(backend):
    key = (1, 2)
    good = [torch.zeros(8)]

    def call(sources, destinations=None, ids=None, scale=0.1):
        destinations = [torch.empty_like(s) for s in sources] if destinations is None else destinations
        ops.perturb(
            sources, destinations, [1] * len(sources) if ids is None else ids, key, scale, backend=backend
        )

    with pytest.raises(ValueError, match="no tensors"):
        call([])
    with pytest.raises(ValueError, match="1 tensors but 2 tensor ids"):
        call(good, ids=[1, 2])
    for dtype in (torch.int8, torch.float64):
        with pytest.raises(TypeError, match=f"dtype {dtype}"):
            call([torch.zeros(8, dtype=dtype)])
    with pytest.raises(ValueError, match="several devices"):
        call([torch.zeros(8), torch.zeros(8, device="meta")], destinations=[torch.zeros(8), torch.zeros(8)])
    with pytest.raises(ValueError, match="not contiguous"):
        call([torch.zeros(4, 6).t()])
    with pytest.raises(ValueError, match="destination"):
        call(good, destinations=[torch.zeros(9)])
    with pytest.raises(ValueError, match="destination"):
        call(good, destinations=[torch.zeros(8, dtype=torch.bfloat16)])
    with pytest.raises(ValueError, match="destination"):
        call(good, destinations=[torch.zeros(8, device="meta")])
    with pytest.raises(ValueError, match="destination"):
        call(good, destinations=[torch.zeros(16)[::2]])
    with pytest.raises(ValueError, match="destination"):
        call(good + good, destinations=[torch.zeros(8)])
    for scale in (float("nan"), float("inf")):
        with pytest.raises(ValueError, match="scale must be finite"):
            call(good, scale=scale)
    matrix = [torch.zeros(4, 6)]
    with pytest.raises(ValueError, match="transpose of a contiguous"):  # neither layout: a strided slice
        call(matrix, destinations=[torch.zeros(4, 12)[:, ::2]])
    with pytest.raises(ValueError, match="twin"):
        ops.perturb(matrix, [torch.zeros(4, 6)], [1], key, 0.1, backend=backend, twins=[])
    with pytest.raises(ValueError, match="twin must be laid out"):
        ops.perturb(
            matrix, [torch.zeros(4, 6)], [1], key, 0.1, backend=backend, twins=[torch.zeros(6, 4).t()]
        )
    assert torch.equal(good[0], torch.zeros(8))


# odd shapes; (64, 257) spans library tiles, (3, 1500) has rows longer than a tile (1024 elements)
MATRICES = [(1, 1), (1, 9), (7, 1), (33, 5), (64, 257), (3, 1500)]


def contiguous(tensors):
    return [t.contiguous() for t in tensors]


# the interpreted kernel writes through the same contiguous copies as the torch backend: two cases of it
LAYOUT_CASES = [(b, d, seed) for b in ("cpu", "torch") for d in DTYPES for seed in (0, 31337)] + [
    ("triton", torch.float32, 0),
    ("triton", torch.bfloat16, 31337),
]


@pytest.mark.parametrize("backend, dtype, seed", LAYOUT_CASES)
@pytest.mark.parametrize("noise_kind", NOISE_KINDS)
def test_transposed_destinations_and_twins_hold_what_one_call_per_sign_writes(
    backend, noise_kind, dtype, seed
):
    """The materialised layer's way: each member's [out, in] weights written into the transpose of a
    contiguous [in, out] tensor, an antithetic pair from one pass over the noise (its twin gets -scale).
    Bit for bit what a call per sign into contiguous destinations writes, on every backend, with a 1-d
    tensor (contiguous destination) among the matrices."""
    key = noise.member_key(seed, 2, 5)
    src = make_tensors(dtype, seed, [*MATRICES, (13,)])
    ids = [noise.tensor_id(f"layers.{i}.weight") for i in range(len(src))]
    expected = {sign: [torch.empty_like(t) for t in src] for sign in (1, -1)}
    for sign, destinations in expected.items():
        ops.perturb(src, destinations, ids, key, sign * SIGMA, noise_kind=noise_kind, backend=backend)

    def transposed_buffers():  # [in, out] memory, seen as [out, in]; the 1-d tensor as it is
        return [
            torch.empty(t.shape[::-1], dtype=dtype).t() if t.dim() == 2 else torch.empty_like(t) for t in src
        ]

    plus, minus = transposed_buffers(), transposed_buffers()
    ops.perturb(src, plus, ids, key, SIGMA, noise_kind=noise_kind, backend=backend, twins=minus)
    assert not plus[-2].is_contiguous() and plus[-2].t().is_contiguous()
    assert all(torch.equal(a, b) for a, b in zip(bits(contiguous(plus)), bits(expected[1])))
    assert all(torch.equal(a, b) for a, b in zip(bits(contiguous(minus)), bits(expected[-1])))
    alone = transposed_buffers()  # transposed destinations without twins
    ops.perturb(src, alone, ids, key, -SIGMA, noise_kind=noise_kind, backend=backend)
    assert all(torch.equal(a, b) for a, b in zip(bits(contiguous(alone)), bits(expected[-1])))


@pytest.mark.parametrize("noise_kind", NOISE_KINDS)
@pytest.mark.parametrize("seed", [0, 7])
def test_wide_transposed_destinations_split_over_two_threads(noise_kind, seed):
    """The compiled library writes a transposed destination in panels of whole rows; two threads split a
    wide matrix's blocks mid-row and mid-panel, and the matrix's rows are longer than a panel's tile.
    The destinations and twins still hold, bit for bit, what contiguous ones get from one thread."""
    key = noise.member_key(seed, 1, 3)
    src = make_tensors(torch.float32, seed, [(513, 1031), (37, 19)])
    ids = [noise.tensor_id(f"wide.{i}") for i in range(len(src))]
    blocks = sum(-(-t.numel() // noise.elements_per_block(noise_kind)) for t in src)
    assert blocks >= 2 * cpu_library._MIN_BLOCKS_PER_THREAD  # so that two threads share the call
    expected = {sign: [torch.empty_like(t) for t in src] for sign in (1, -1)}
    for sign, destinations in expected.items():
        ops.perturb(src, destinations, ids, key, sign * SIGMA, noise_kind=noise_kind, backend="cpu")
    plus, minus = ([torch.empty(t.shape[::-1]).t() for t in src] for _ in range(2))
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        ops.perturb(src, plus, ids, key, SIGMA, noise_kind=noise_kind, backend="cpu", twins=minus)
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(a, b) for a, b in zip(bits(contiguous(plus)), bits(expected[1])))
    assert all(torch.equal(a, b) for a, b in zip(bits(contiguous(minus)), bits(expected[-1])))


@pytest.mark.parametrize("noise_kind", NOISE_KINDS)
@pytest.mark.parametrize("seed", [0, 7])
@pytest.mark.parametrize("threads", [1, 2])
def test_several_members_written_in_one_call(noise_kind, seed, threads):
    """perturb_each writes several members' weights (pairs with twins, a member alone, transposed and
    contiguous destinations) in one pass split over the threads as one range, so a thread's range
    starts and ends inside a member's tensors: each destination holds, bit for bit, what a call of its
    own writes."""
    src = make_tensors(torch.float32, seed, [(97, 33), (1,), (4097,), (513, 400)])
    ids = [noise.tensor_id(f"members.{i}") for i in range(len(src))]
    blocks = sum(-(-t.numel() // noise.elements_per_block(noise_kind)) for t in src)
    assert 3 * blocks >= 2 * cpu_library._MIN_BLOCKS_PER_THREAD  # so that two threads share the call
    keys = [noise.member_key(seed, 2, direction) for direction in range(3)]
    scales = [SIGMA, -0.5 * SIGMA, 2 * SIGMA]

    def destinations(transposed: bool) -> list[torch.Tensor]:
        return [
            torch.empty(t.shape[::-1]).t() if transposed and t.dim() == 2 else torch.empty_like(t)
            for t in src
        ]

    writes = [
        ops.Write(keys[0], scales[0], destinations(True), destinations(True)),
        ops.Write(keys[1], scales[1], destinations(False)),
        ops.Write(keys[2], scales[2], destinations(False), destinations(False)),
    ]
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        ops.perturb_each(src, ids, writes, noise_kind=noise_kind, backend="cpu")
    finally:
        torch.set_num_threads(before)
    for write in writes:
        alone = [torch.empty_like(t) for t in src]
        ops.perturb(src, alone, ids, write.key, write.scale, noise_kind=noise_kind, backend="cpu")
        assert all(torch.equal(a, b) for a, b in zip(bits(contiguous(write.destinations)), bits(alone)))
        if write.twins is not None:
            ops.perturb(src, alone, ids, write.key, -write.scale, noise_kind=noise_kind, backend="cpu")
            assert all(torch.equal(a, b) for a, b in zip(bits(contiguous(write.twins)), bits(alone)))


def test_triton_backend_on_cpu_needs_the_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    t = [torch.zeros(8)]
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        ops.perturb(t, [torch.empty_like(t[0])], [1], (1, 2), 0.1, backend="triton")


def test_unknown_backend_is_rejected(monkeypatch):
    t = [torch.zeros(8)]
    with pytest.raises(ValueError, match="unknown backend 'cuda'"):
        ops.perturb(t, [torch.empty_like(t[0])], [1], (1, 2), 0.1, backend="cuda")
    monkeypatch.setenv("FASTES_BACKEND", "fast")
    with pytest.raises(ValueError, match="unknown backend 'fast'"):
        ops.perturb(t, [torch.empty_like(t[0])], [1], (1, 2), 0.1)


def test_auto_backend_compiles_on_cpu(monkeypatch):
    monkeypatch.delenv("FASTES_BACKEND", raising=False)
    t = [torch.zeros(8)]
    assert ops.resolve_backend(t) == "cpu"  # a C compiler is part of the test environment
    assert ops.resolve_backend(t, "torch") == "torch"
    monkeypatch.setenv("FASTES_BACKEND", "triton")
    assert ops.resolve_backend(t) == "triton"
