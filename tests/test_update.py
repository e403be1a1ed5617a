"""Fused ES update: interpreted kernel vs torch reference vs naive N-pass computation; stochastic rounding."""

import math

import pytest
import torch
from conftest import NOISE_KINDS, bits, make_tensors, ordered

from fastes.engine import noise, ops

SHAPES = [(1,), (7,), (33, 5), (4097,)]
IDS = [noise.tensor_id(n) for n in ("emb", "layers.0.q.weight", "layers.0.mlp.weight", "lm_head.weight")]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
INF = float("inf")

# (seed, generation, weights, coef, decay): a few populations, with and without weight decay.
CASES = [
    (0, 0, [0.75, -1.25, 0.5], 0.02, 1.0),
    (977, 12, [1.0, -0.5], 0.03, 0.995),
]


def assert_close_to(result, expected, magnitude, fraction=0.01):
    """fp32: within 1e-6 of `magnitude`; 16-bit: within one ulp, and off by that ulp in < `fraction`
    of the elements (fp32 sums and normals differ by ~1e-7 between paths, which can flip a rounding)."""
    assert result.shape == expected.shape
    if result.dtype == torch.float32:
        assert ((result.double() - expected.double()).abs() <= 1e-6 * magnitude).all()
        return
    ulps = (ordered(result) - ordered(expected.to(result.dtype))).abs()
    assert ulps.max().item() <= 1
    assert (ulps > 0).float().mean().item() < fraction


def assert_kernel_matches(noise_kind, result, reference, magnitude):
    """The kernel against the torch reference: bit for bit for sign noise (sign arithmetic is exact, and
    both sum in the same order), within assert_close_to for Gaussian noise."""
    if noise_kind == "rademacher":
        assert torch.equal(*bits([result, reference]))
    else:
        assert_close_to(result, reference, magnitude)


def naive(theta, tid, keys, weights, coef, decay=1.0, noise_kind="gaussian"):
    """theta * decay + coef * sum_j w_j * eps_j in float64, one pass per direction (the slow way)."""
    total = torch.zeros(theta.numel(), dtype=torch.float64)
    for key, w in zip(keys, weights):
        total += w * noise.sample(noise_kind, key, tid, theta.numel()).double()
    return (theta.double().view(-1) * decay + coef * total).view(theta.shape)


def magnitude_of(theta, weights, coef, decay=1.0):
    return theta.double().abs() * abs(decay) + abs(coef) * sum(abs(w) for w in weights) * 6  # |eps| <= 5.8


def run(backend, params, keys, weights, **kwargs):
    ops.es_update(params, IDS[: len(params)], keys, weights, backend=backend, **kwargs)
    return params


@pytest.mark.parametrize("noise_kind", NOISE_KINDS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("seed, generation, weights, coef, decay", CASES)
def test_update_kernel_matches_reference_and_naive(noise_kind, dtype, seed, generation, weights, coef, decay):
    keys = [noise.member_key(seed, generation, j) for j in range(len(weights))]
    theta = make_tensors(dtype, seed, SHAPES)
    options = {"coef": coef, "decay": decay, "noise_kind": noise_kind}
    ref = run("torch", [t.clone() for t in theta], keys, weights, **options)
    out = run("triton", [t.clone() for t in theta], keys, weights, **options)
    changed = 0
    for t, r, o, tid in zip(theta, ref, out, IDS):
        expected = naive(t, tid, keys, weights, coef, decay, noise_kind)
        magnitude = magnitude_of(t, weights, coef, decay)
        assert_close_to(r, expected, magnitude)
        assert_kernel_matches(noise_kind, o, r, magnitude)
        changed += (o != t).sum().item()
    assert changed > 0.5 * sum(t.numel() for t in theta)


def test_update_of_mixed_dtypes_in_one_call():
    keys = [noise.member_key(5, 5, j) for j in range(2)]
    weights, coef = [1.0, -1.0], 0.05
    shapes = [(7,), (33, 5), (1030,)]
    theta = [make_tensors(dtype, 2, [s])[0] for dtype, s in zip(DTYPES, shapes)]
    ref = run("torch", [t.clone() for t in theta], keys, weights, coef=coef)
    out = run("triton", [t.clone() for t in theta], keys, weights, coef=coef)
    for t, r, o, tid in zip(theta, ref, out, IDS):
        assert o.dtype == t.dtype
        magnitude = magnitude_of(t, weights, coef)
        assert_close_to(r, naive(t, tid, keys, weights, coef), magnitude)
        assert_close_to(o, r, magnitude)


def test_update_does_not_depend_on_other_tensors():
    keys = [noise.member_key(6, 1, j) for j in range(2)]
    a, b, c = make_tensors(torch.float32, 4, [(1030,), (5,), (1025,)])
    alone = [a.clone()]
    ops.es_update(alone, [IDS[2]], keys, [1.0, 0.5], coef=0.1, backend="triton")
    together = [b.clone(), a.clone(), c.clone()]
    ops.es_update(together, [IDS[0], IDS[2], IDS[3]], keys, [1.0, 0.5], coef=0.1, backend="triton")
    assert torch.equal(together[1], alone[0])


@pytest.mark.parametrize("noise_kind", NOISE_KINDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gradient_mode_writes_grad_and_leaves_params(noise_kind, dtype):
    keys = [noise.member_key(11, 2, j) for j in range(3)]
    weights, coef = [0.25, 1.0, -2.0], 0.1
    theta = make_tensors(dtype, 11, SHAPES)
    results = {}
    for backend in ("torch", "triton"):
        params = [t.clone() for t in theta]
        grads = [torch.full_like(t, float("nan")) for t in theta]
        run(backend, params, keys, weights, coef=coef, decay=0.5, grads=grads, noise_kind=noise_kind)
        assert all(torch.equal(p, t) for p, t in zip(params, theta))
        results[backend] = grads
    zero_magnitude = magnitude_of(torch.zeros(1), weights, coef)
    for t, r, o, tid in zip(theta, results["torch"], results["triton"], IDS):
        expected = naive(torch.zeros_like(t), tid, keys, weights, coef, noise_kind=noise_kind)  # no decay
        assert_close_to(r, expected, zero_magnitude)
        assert_close_to(o, expected, zero_magnitude)
        assert_kernel_matches(noise_kind, o, r, zero_magnitude)
        assert torch.isfinite(o).all()


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_sign_update_is_the_sum_of_signed_weights(backend):
    # With two directions of weights 1 and 2, every element moves by coef * (+-1 +-2): {-3, -1, 1, 3}.
    keys = [noise.member_key(3, 0, 0), noise.member_key(3, 0, 1)]
    params = [torch.zeros(1030)]
    ops.es_update(params, [IDS[3]], keys, [1.0, 2.0], coef=0.5, noise_kind="rademacher", backend=backend)
    assert set(params[0].unique().tolist()) == {-1.5, -0.5, 0.5, 1.5}


# ---------------------------------------------------------------------------------------------------
# Stochastic rounding
# ---------------------------------------------------------------------------------------------------


def is_neighbour(rounded, value):
    """True where `rounded` (16-bit) is one of the two representable values bracketing fp32 `value`:
    it equals value, or the next representable value from it towards value lies on value's other side."""
    r = rounded.float()
    step = torch.nextafter(rounded, torch.where(value > r, INF, -INF).to(rounded.dtype)).float()
    return (r == value) | (torch.sign(step - value) * torch.sign(r - value) <= 0)


@pytest.mark.parametrize("noise_kind", NOISE_KINDS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("seed", [0, 4242])
def test_stochastic_rounding_kernel_matches_reference(noise_kind, dtype, seed):
    keys = [noise.member_key(seed, 3, j) for j in range(2)]
    weights, coef = [1.0, -0.75], 2e-3  # updates of about one ulp: rounding decides
    rkey = noise.rounding_key(seed, 3)
    theta = make_tensors(dtype, seed, SHAPES)
    options = {"coef": coef, "noise_kind": noise_kind}
    ref = run("torch", [t.clone() for t in theta], keys, weights, rounding_key=rkey, **options)
    out = run("triton", [t.clone() for t in theta], keys, weights, rounding_key=rkey, **options)
    exact = run("torch", [t.float() for t in theta], keys, weights, **options)  # the fp32 value rounded
    nearest_differs = 0
    for t, r, o, e, tid in zip(theta, ref, out, exact, IDS):
        assert_kernel_matches(noise_kind, o, r, magnitude_of(t, weights, coef))
        assert is_neighbour(r, e).all() and is_neighbour(o, e).all()
        # The reference result is the documented rule applied to the rounding stream.
        u = noise.uniform(rkey, tid, t.numel()).view(t.shape)
        assert torch.equal(r, noise.stochastic_round(e, dtype, u))
        nearest_differs += (r != e.to(dtype)).sum().item()
    # Stochastic rounding is not round-to-nearest in disguise.
    assert nearest_differs > 0.05 * sum(t.numel() for t in theta)


def test_stochastic_rounding_is_reproducible_and_keyed():
    keys = [noise.member_key(1, 1, 0)]
    theta = make_tensors(torch.bfloat16, 1, [(1030,)])
    kwargs = dict(coef=2e-3, rounding_key=noise.rounding_key(1, 1))
    first = run("triton", [theta[0].clone()], keys, [1.0], **kwargs)[0]
    again = run("triton", [theta[0].clone()], keys, [1.0], **kwargs)[0]
    assert torch.equal(first, again)
    kwargs["rounding_key"] = noise.rounding_key(1, 2)
    other = run("triton", [theta[0].clone()], keys, [1.0], **kwargs)[0]
    assert not torch.equal(first, other)


@pytest.mark.parametrize("noise_kind", NOISE_KINDS)
def test_stochastic_rounding_ignored_for_fp32(noise_kind):
    keys = [noise.member_key(2, 2, 0)]
    theta = make_tensors(torch.float32, 2, [(1030,)])
    for backend in ("torch", "triton"):
        sr = run(
            backend, [theta[0].clone()], keys, [1.0], coef=0.1, rounding_key=(3, 4), noise_kind=noise_kind
        )
        rn = run(backend, [theta[0].clone()], keys, [1.0], coef=0.1, noise_kind=noise_kind)
        assert torch.equal(sr[0], rn[0])


@pytest.mark.parametrize("dtype, ulp", [(torch.bfloat16, 2.0**-7), (torch.float16, 2.0**-10)])
@pytest.mark.parametrize("sign", [1, -1])
def test_stochastic_rounding_is_unbiased(dtype, ulp, sign):
    # 1 + ulp/3 rounds up with probability 1/3; round-to-nearest would be off by ulp/3 every time.
    n, n_keys = 4096, 64
    value = torch.full((n,), sign * (1 + ulp / 3), dtype=torch.float32)
    results = torch.cat(
        [
            noise.stochastic_round(value, dtype, noise.uniform(noise.rounding_key(9, g), 1, n))
            for g in range(n_keys)
        ]
    ).double()
    assert set(results.unique().tolist()) == {sign * 1.0, sign * (1 + ulp)}
    # sd of the mean: ulp * sqrt(2/9 / (n * n_keys)) ~= 0.001 ulp
    assert abs(results.mean().item() - value[0].item()) < 0.01 * ulp
    assert abs((results.abs() > 1).double().mean().item() - 1 / 3) < 0.01


def test_stochastic_rounding_kernel_is_unbiased():
    # theta = 1 and decay = 1 + ulp/3 (zero update): the kernel rounds fp32(1 + ulp/3) stochastically.
    ulp = 2.0**-7
    decay = 1 + ulp / 3
    n, n_keys = 4096, 6
    up = 0
    for g in range(n_keys):
        rkey = noise.rounding_key(17, g)
        out = run("triton", [torch.ones(n, dtype=torch.bfloat16)], [(1, 1)], [0.0], coef=0.0, decay=decay,
                  rounding_key=rkey)[0]  # fmt: skip
        ref = run("torch", [torch.ones(n, dtype=torch.bfloat16)], [(1, 1)], [0.0], coef=0.0, decay=decay,
                  rounding_key=rkey)[0]  # fmt: skip
        assert torch.equal(out, ref)
        assert set(out.float().unique().tolist()) <= {1.0, 1 + ulp}
        up += (out.float() > 1).sum().item()
    assert abs(up / (n * n_keys) - 1 / 3) < 0.02  # sd ~0.003


def test_stochastic_round_edge_cases():
    u_values = torch.tensor([2.0**-24, 0.25, 0.5, 0.75, 1 - 2.0**-24])
    for dtype in (torch.bfloat16, torch.float16):
        info = torch.finfo(dtype)
        # Representable values stay as they are, whatever u: zero, subnormals, the max, negatives.
        exact = torch.tensor([0.0, -0.0, 1.0, -3.5, info.max, -info.max, info.tiny, info.smallest_normal / 4])
        exact = exact.to(dtype).float()
        for u in u_values:
            r = noise.stochastic_round(exact, dtype, torch.full_like(exact, u.item()))
            assert r.dtype == dtype and torch.equal(r.float(), exact)
        # Non-finite values pass through.
        special = torch.tensor([INF, -INF, float("nan")])
        r = noise.stochastic_round(special, dtype, torch.full_like(special, 0.5)).float()
        assert r[0].item() == INF and r[1].item() == -INF and math.isnan(r[2].item())
        # Negative values round like their magnitudes, mirrored.
        g = torch.Generator().manual_seed(0)
        x = torch.randn(4096, generator=g)
        u = torch.rand(4096, generator=g).clamp(2.0**-24, 1 - 2.0**-24)
        assert torch.equal(noise.stochastic_round(-x, dtype, u), -noise.stochastic_round(x, dtype, u))
        assert is_neighbour(noise.stochastic_round(x, dtype, u), x).all()
    # Beyond the largest finite value: what rounds to inf to nearest stays inf; below the half-way
    # point to the next power of two it stays finite (stochastic rounding never creates an infinity).
    fp16_max = torch.finfo(torch.float16).max
    beyond = torch.tensor([1e5, -1e5, fp16_max + 8, -(fp16_max + 8)])
    for u in u_values:
        r = noise.stochastic_round(beyond, torch.float16, torch.full_like(beyond, u.item())).float()
        assert r.tolist() == [INF, -INF, fp16_max, -fp16_max]


def test_stochastic_round_subnormals():
    tiny = 2.0**-24  # the smallest fp16 subnormal
    value = torch.full((1 << 16,), tiny / 4)
    r = noise.stochastic_round(value, torch.float16, noise.uniform((7, 8), 9, value.numel())).float()
    assert set(r.unique().tolist()) == {0.0, tiny}
    assert abs((r > 0).double().mean().item() - 0.25) < 0.01


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # numpy inside the interpreter: inf - inf, overflow
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_stochastic_rounding_kernel_edge_values(dtype):
    # Non-finite and extreme parameters through the kernel (zero update, decay 1 or slightly above 1).
    info = torch.finfo(dtype)
    base = torch.tensor([0.0, -0.0, 1.0, -1.0, info.max, -info.max, info.tiny, INF, -INF, float("nan")])
    for decay in (1.0, 1.001, 1.003):
        theta = base.to(dtype)
        out = run("triton", [theta.clone()], [(1, 2)], [0.0], coef=0.0, decay=decay, rounding_key=(3, 4))[0]
        ref = run("torch", [theta.clone()], [(1, 2)], [0.0], coef=0.0, decay=decay, rounding_key=(3, 4))[0]
        assert torch.equal(out.isnan(), ref.isnan())
        assert torch.equal(out.nan_to_num(), ref.nan_to_num())
        if decay == 1.0:
            assert torch.equal(out[:-1], theta[:-1]) and out[-1].isnan()


# ---------------------------------------------------------------------------------------------------
# Bad input
# ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_bad_input_raises_clear_errors(backend):
    keys, weights = [(1, 2), (3, 4)], [1.0, -1.0]
    good = [torch.zeros(8)]

    def call(params, ids=None, keys=keys, weights=weights, **kwargs):
        ids = [1] * len(params) if ids is None else ids
        ops.es_update(params, ids, keys, weights, backend=backend, **{"coef": 0.1, **kwargs})

    with pytest.raises(ValueError, match="no tensors"):
        call([])
    with pytest.raises(ValueError, match="1 tensors but 3 tensor ids"):
        call(good, ids=[1, 2, 3])
    for dtype in (torch.int8, torch.float64):
        with pytest.raises(TypeError, match=f"dtype {dtype}"):
            call([torch.zeros(8, dtype=dtype)])
    with pytest.raises(ValueError, match="several devices"):
        call([torch.zeros(8), torch.zeros(8, device="meta")])
    with pytest.raises(ValueError, match="not contiguous"):
        call([torch.zeros(4, 6).t()])
    with pytest.raises(ValueError, match="one weight per key"):
        call(good, weights=[1.0])
    with pytest.raises(ValueError, match="at least one key"):
        call(good, keys=[], weights=[])
    for bad in (float("nan"), INF, -INF):
        with pytest.raises(ValueError, match="must be finite.*NaN/inf"):
            call(good, weights=[1.0, bad])
        with pytest.raises(ValueError, match="coef="):
            call(good, coef=bad)
        with pytest.raises(ValueError, match="decay="):
            call(good, decay=bad)
    for grads in (
        [torch.zeros(9)],
        [torch.zeros(8, dtype=torch.bfloat16)],
        [torch.zeros(16)[::2]],
        [torch.zeros(8, device="meta")],
        [],
        [torch.zeros(8), torch.zeros(8)],
    ):
        with pytest.raises(ValueError, match="grad"):
            call(good, grads=grads)
    assert torch.equal(good[0], torch.zeros(8))


def test_triton_backend_on_cpu_needs_the_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        ops.es_update([torch.zeros(8)], [1], [(1, 2)], [1.0], coef=0.1, backend="triton")


def test_unknown_backend_is_rejected():
    with pytest.raises(ValueError, match="unknown backend 'gpu'"):
        ops.es_update([torch.zeros(8)], [1], [(1, 2)], [1.0], coef=0.1, backend="gpu")
