"""Rademacher (sign) noise, docs/noise.md section 6a: the stream, its statistics, and every place it is used.

Sign arithmetic is exact (w * eps and scale * eps are sign flips), so the interpreted kernels must equal the
torch reference bit for bit here, in every dtype and mode, where Gaussian noise is compared to a tolerance.
"""

import math

import pytest
import torch

import fastes
from fastes import kernels, lowrank, noise, ops
from fastes.batched import population_batched
from fastes.cli import main
from fastes.config import ConfigError, load_config
from fastes.kernels import launch_virtual_linear

MASK32 = 0xFFFFFFFF
UP_PROJ = noise.tensor_id("model.layers.0.mlp.up_proj.weight")
KEYS = [noise.member_key(0, 0, 0), noise.member_key(1234, 7, 5), (0, 0), (MASK32, MASK32), (0x80000000, 7)]
SHAPES = [(1,), (7,), (33, 5), (1030,)]  # odd sizes; the last spans 9 sign blocks and 2 kernel tiles
IDS = [noise.tensor_id(n) for n in ("emb", "layers.0.q.weight", "layers.0.mlp.weight", "lm_head.weight")]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def signs_from_spec(key, tensor, first, numel, stream=noise.STREAM_SIGN):
    """Element by element from docs/noise.md 6a, with Python integers: bit e % 32 of word (e % 128) // 32
    of Philox counter (e // 128 low, e // 128 high, tensor, stream); a set bit is -1."""
    out, cache = [], {}
    for e in range(first, first + numel):
        block = e // 128
        if block not in cache:
            cache[block] = [
                int(w) for w in noise.philox4x32(block & MASK32, block >> 32, tensor, stream, *key)
            ]
        bit = (cache[block][(e % 128) // 32] >> (e % 32)) & 1
        out.append(-1.0 if bit else 1.0)
    return torch.tensor(out)


def as_text(signs):
    return "".join("+" if v > 0 else "-" for v in signs.tolist())


def make_tensors(dtype, seed, shapes=SHAPES):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=g).to(dtype) for s in shapes]


def bits(tensors):
    return [t.view(-1).view(torch.uint8).clone() for t in tensors]


# ---------------------------------------------------------------------------------------------------
# The stream: docs/noise.md's known answers, the spec, the kernels
# ---------------------------------------------------------------------------------------------------

# (member key, stream, first element, block words in hex or None, signs) exactly as printed in the doc.
DOC_VECTORS = [
    ((42, 0, 0), 4, 0, "9152bbfa 728f9f8f 5e18d38f 8a49c36f", "+-+-------+---+-+-++-+-+-+++-++-"),
    ((42, 0, 0), 4, 32, None, "----+++------++-----+++-+-++---+"),
    ((42, 0, 0), 4, 128, "d9e7956f 9e531b2c 26f249e5 1c6c1201", "----+--+-+-+-++----++----++--+--"),
    ((42, 0, 0), 4, 2**39, "d560d649 1d64f0e8 d6ba80e7 3b2ca277", "-++-++-++--+-+--+++++--+-+-+-+--"),
    ((42, 7, 3), 4, 0, "5cd4871e e232bfd8 10e786de ed1b0f8f", "+----+++---++++-++-+-+--++---+-+"),
    ((42, 0, 0), 5, 0, None, "-+---+-++--++-++"),
    ((42, 0, 0), 6, 0, None, "--+-+-++----+++-"),
]


@pytest.mark.parametrize("member, stream, first, words, signs", DOC_VECTORS)
def test_known_answers_of_the_doc(member, stream, first, words, signs):
    key = noise.member_key(*member)
    got = noise.rademacher(key, UP_PROJ, len(signs), offset=first, stream=stream)
    assert as_text(got) == signs
    if words is not None:
        block = first // 128
        expected = [int(w, 16) for w in words.split()]
        assert [
            int(w) for w in noise.philox4x32(block & MASK32, block >> 32, UP_PROJ, stream, *key)
        ] == expected


@pytest.mark.parametrize("key", KEYS[:3])
@pytest.mark.parametrize("first, numel", [(0, 300), (2**32 - 70, 200), (2**39 - 100, 230), (2**60 + 5, 9)])
def test_reference_follows_the_spec_at_any_offset(key, first, numel):
    got = noise.rademacher(key, IDS[1], numel, offset=first)
    assert torch.equal(got, signs_from_spec(key, IDS[1], first, numel))
    # Any chunking gives the same signs, including chunks not aligned to a Philox block.
    cuts = sorted({c for c in (0, 1, 31, 32, 100, 129) if c < numel} | {numel})
    parts = [noise.rademacher(key, IDS[1], b - a, offset=first + a) for a, b in zip(cuts, cuts[1:])]
    assert torch.equal(torch.cat(parts), got)


FILL_CASES = [
    (KEYS[0], IDS[0], 0, 1, 1024),
    (KEYS[1], IDS[1], 0, 4097, 256),
    (KEYS[2], MASK32, 2**32 - 1024, 3000, 1024),  # crosses element 2^32
    (KEYS[3], IDS[2], 2**39 - 256, 700, 256),  # crosses sign block 2^32: counter word 1 becomes 1
    (KEYS[4], IDS[3], 2**44 + 128, 129, 128),
]


@pytest.mark.parametrize("key, tid, offset, numel, block", FILL_CASES)
@pytest.mark.parametrize("stream", [noise.STREAM_SIGN, noise.STREAM_LOWRANK_SIGN_A])
def test_kernel_signs_equal_reference_bit_for_bit(key, tid, offset, numel, block, stream):
    out = torch.full((numel,), float("nan"))
    kernels.launch_fill(out, key, tid, offset, stream, False, block, noise="rademacher")
    assert torch.equal(out, noise.rademacher(key, tid, numel, offset=offset, stream=stream))


def test_kernel_fill_of_signs_needs_whole_sign_blocks():
    with pytest.raises(ValueError, match="offset must be a multiple of 128"):
        kernels.launch_fill(torch.zeros(4), KEYS[0], 1, 64, noise.STREAM_SIGN, False, noise="rademacher")
    with pytest.raises(ValueError, match="block must be a multiple of 128"):
        kernels.launch_fill(torch.zeros(4), KEYS[0], 1, 0, noise.STREAM_SIGN, False, 64, noise="rademacher")


def test_kernel_stream_constants_match_the_reference():
    assert kernels.philox.STREAM_SIGN.value == noise.STREAM_SIGN
    assert kernels.philox.SIGN_BLOCK.value == noise.SIGN_BLOCK
    assert list(kernels.philox.NOISE_CODES) == list(noise.NOISES)


# ---------------------------------------------------------------------------------------------------
# Statistics and independence
# ---------------------------------------------------------------------------------------------------

N = 1 << 18


def correlation(a, b):
    a, b = a.double() - a.double().mean(), b.double() - b.double().mean()
    return (a @ b / (a.norm() * b.norm())).item()


def test_sign_statistics():
    s = noise.rademacher(noise.member_key(2024, 0, 1), noise.tensor_id("w"), N).double()
    assert set(s.unique().tolist()) == {-1.0, 1.0}
    assert abs(s.mean().item()) < 5 / math.sqrt(N)  # sd of the mean: 1/sqrt(n)
    assert abs(s.var().item() - 1) < 5 / math.sqrt(N)  # var = 1 - mean^2 (n / (n-1)); sd ~ 2/n
    # Every bit position of the 128 in a block is balanced: no lane is biased.
    per_position = (s.view(-1, 128) < 0).double().mean(0)
    assert (per_position - 0.5).abs().max().item() < 5 * 0.5 / math.sqrt(N / 128)
    # Neighbours are independent: lag 1 (same word), 32 (next word), 128 (next block).
    for lag in (1, 32, 128):
        assert abs(correlation(s[lag:], s[:-lag])) < 5 / math.sqrt(N)


def test_the_statistics_check_can_fail():
    # The per-position balance above catches a biased lane, e.g. a bit that is always clear.
    s = noise.rademacher(noise.member_key(2024, 0, 1), noise.tensor_id("w"), N).view(-1, 128).clone()
    s[:, 77] = 1.0
    assert ((s < 0).double().mean(0) - 0.5).abs().max().item() > 5 * 0.5 / math.sqrt(N / 128)


@pytest.mark.parametrize(
    "other", ["tensor id", "direction", "generation", "seed", "gaussian of the same key", "low-rank stream"]
)
def test_sign_streams_are_independent(other):
    seed, generation, index = 5, 2, 3
    tid = noise.tensor_id("layers.0.attn.q_proj.weight")
    key = noise.member_key(seed, generation, index)
    base = noise.rademacher(key, tid, N)
    if other == "tensor id":
        alt = noise.rademacher(key, noise.tensor_id("layers.0.attn.k_proj.weight"), N)
    elif other == "direction":
        alt = noise.rademacher(noise.member_key(seed, generation, index + 1), tid, N)
    elif other == "generation":
        alt = noise.rademacher(noise.member_key(seed, generation + 1, index), tid, N)
    elif other == "seed":
        alt = noise.rademacher(noise.member_key(seed + 1, generation, index), tid, N)
    elif other == "gaussian of the same key":
        alt = noise.normal(key, tid, N)
    else:
        alt = noise.rademacher(key, tid, N, stream=noise.STREAM_LOWRANK_SIGN_A)
    assert not torch.equal(base, alt)
    assert abs(correlation(base, alt)) < 5 / math.sqrt(N)
    assert abs(correlation(base[1:], alt[:-1])) < 5 / math.sqrt(N)


def test_sign_and_gaussian_streams_never_share_counters():
    # Sign block B of stream 4 and normal block b of stream 0 differ in counter word 3, whatever B and b.
    key, tid = KEYS[1], IDS[2]
    assert noise.STREAM_SIGN not in (noise.STREAM_NOISE, noise.STREAM_ROUNDING, 2, 3, 5, 6)
    sign_words = noise.philox4x32(5, 0, tid, noise.STREAM_SIGN, *key)
    normal_words = noise.philox4x32(5, 0, tid, noise.STREAM_NOISE, *key)
    assert [int(w) for w in sign_words] != [int(w) for w in normal_words]


def test_unknown_noise_is_rejected_everywhere():
    t = [torch.zeros(8)]
    with pytest.raises(ValueError, match="unknown noise 'uniform'"):
        ops.perturb(t, [torch.empty(8)], [1], (1, 2), 0.1, noise_kind="uniform")
    with pytest.raises(ValueError, match="unknown noise 'uniform'"):
        ops.es_update(t, [1], [(1, 2)], [1.0], coef=0.1, noise_kind="uniform")
    with pytest.raises(ValueError, match="unknown noise 'uniform'"):
        noise.sample("uniform", (1, 2), 1, 8)
    with pytest.raises(ValueError, match="unknown noise 'uniform'"):
        fastes.ES([("w", torch.zeros(3))], sigma=0.1, lr=0.1, population=2, noise="uniform")
    assert torch.equal(t[0], torch.zeros(8))


# ---------------------------------------------------------------------------------------------------
# Perturb and update: kernels == reference, bit for bit
# ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype, seed", [(torch.float32, 0), (torch.bfloat16, 31337), (torch.float16, 5)])
@pytest.mark.parametrize("sign", [1, -1])
def test_perturb_kernel_equals_reference_bit_for_bit(dtype, seed, sign):
    key, scale = noise.member_key(seed, 3, 1), sign * 0.05
    src = make_tensors(dtype, seed)
    before = bits(src)
    expected = [torch.empty_like(t) for t in src]
    ops.perturb(src, expected, IDS, key, scale, noise_kind="rademacher", backend="torch")
    for e, t, tid in zip(expected, src, IDS):  # the formula, one tensor at a time
        eps = noise.rademacher(key, tid, t.numel()).view(t.shape)
        assert torch.equal(e, (t.float() + scale * eps).to(dtype))
    out = [torch.full_like(t, float("nan")) for t in src]
    ops.perturb(src, out, IDS, key, scale, noise_kind="rademacher", backend="triton")
    assert all(torch.equal(a, b) for a, b in zip(bits(out), bits(expected)))
    assert all(torch.equal(a, b) for a, b in zip(bits(src), before))  # out of place: weights untouched
    ops.perturb(src, src, IDS, key, scale, noise_kind="rademacher", backend="triton")  # in place
    assert all(torch.equal(a, b) for a, b in zip(bits(src), bits(expected)))


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_antithetic_sign_perturbations_are_opposite_and_exactly_sigma(backend):
    zeros = [torch.zeros(s) for s in SHAPES]
    plus, minus = [torch.empty_like(t) for t in zeros], [torch.empty_like(t) for t in zeros]
    key = noise.member_key(4, 4, 4)
    ops.perturb(zeros, plus, IDS, key, 0.125, noise_kind="rademacher", backend=backend)
    ops.perturb(zeros, minus, IDS, key, -0.125, noise_kind="rademacher", backend=backend)
    for p, m in zip(plus, minus):
        assert torch.equal(p, -m)
        assert set(p.abs().unique().tolist()) == {0.125}
    # The Gaussian perturbation of the same key is another one: the default is unchanged.
    gauss = [torch.empty_like(t) for t in zeros]
    ops.perturb(zeros, gauss, IDS, key, 0.125, backend=backend)
    assert not torch.equal(gauss[3], plus[3])
    torch.testing.assert_close(gauss[3], 0.125 * noise.normal(key, IDS[3], 1030), rtol=0, atol=1e-6)


def naive_update(theta, tid, keys, weights, coef, decay):
    """theta * decay + coef * sum_j w_j s_j in float64, one pass per direction."""
    total = torch.zeros(theta.numel(), dtype=torch.float64)
    for key, w in zip(keys, weights):
        total += w * noise.rademacher(key, tid, theta.numel()).double()
    return (theta.double().view(-1) * decay + coef * total).view(theta.shape)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("mode", ["nearest", "decay", "stochastic", "gradient"])
def test_update_kernel_equals_reference_bit_for_bit(dtype, mode):
    seed = 7 if dtype == torch.float16 else 977
    keys = [noise.member_key(seed, 12, j) for j in range(3)]
    weights, coef = [0.75, -1.25, 0.5], 2e-3 if mode == "stochastic" else 0.03
    options = {"coef": coef, "noise_kind": "rademacher"}
    if mode == "decay":
        options["decay"] = 0.995
    if mode == "stochastic":
        options["rounding_key"] = noise.rounding_key(seed, 12)
    theta = make_tensors(dtype, seed)
    results = {}
    for backend in ("torch", "triton"):
        params = [t.clone() for t in theta]
        grads = [torch.full_like(t, float("nan")) for t in theta] if mode == "gradient" else None
        ops.es_update(params, IDS, keys, weights, grads=grads, backend=backend, **options)
        results[backend] = grads if mode == "gradient" else params
        if mode == "gradient":
            assert all(torch.equal(p, t) for p, t in zip(params, theta))
    assert all(torch.equal(a, b) for a, b in zip(bits(results["torch"]), bits(results["triton"])))
    tolerance = {torch.float32: 1e-6, torch.bfloat16: 8e-3, torch.float16: 1e-3}[dtype]  # about an ulp
    for t, r, tid in zip(theta, results["torch"], IDS):
        base = torch.zeros_like(t) if mode == "gradient" else t
        exact = naive_update(base, tid, keys, weights, coef, options.get("decay", 1.0))
        torch.testing.assert_close(r.double(), exact, rtol=tolerance, atol=tolerance)
        if mode == "stochastic" and dtype != torch.float32:  # the documented rule on the rounding stream
            total = sum(w * noise.rademacher(k, tid, t.numel()).view(t.shape) for k, w in zip(keys, weights))
            u = noise.uniform(options["rounding_key"], tid, t.numel()).view(t.shape)
            assert torch.equal(r, noise.stochastic_round(t.float() + coef * total, dtype, u))


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_sign_update_is_the_sum_of_signed_weights(backend):
    # With two directions of weights 1 and 2, every element moves by coef * (+-1 +-2): {-3, -1, 1, 3}.
    keys = [noise.member_key(3, 0, 0), noise.member_key(3, 0, 1)]
    params = [torch.zeros(1030)]
    ops.es_update(params, [IDS[3]], keys, [1.0, 2.0], coef=0.5, noise_kind="rademacher", backend=backend)
    assert set(params[0].unique().tolist()) == {-1.5, -0.5, 0.5, 1.5}


# ---------------------------------------------------------------------------------------------------
# Virtual linear and low-rank sign factors
# ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("members, rows, n_in, n_out", [(3, 5, 64, 33), (2, 3, 40, 16), (1, 1, 7, 5)])
def test_virtual_linear_with_signs_equals_materialised_weights(dtype, members, rows, n_in, n_out):
    # n_in = 64: each row's signs are whole Philox words (the word path); 40 and 7: the per-element path.
    gen = torch.Generator().manual_seed(members * 100 + n_in)
    x = torch.randn(members * rows, n_in, generator=gen).to(dtype)
    weight = (torch.randn(n_out, n_in, generator=gen) * 0.1).to(dtype)
    keys = [noise.member_key(7, 1, m) for m in range(members)]
    scales = [0.05 * (-1) ** m for m in range(members)]
    tid = noise.tensor_id("layer.weight")
    y = torch.empty(members * rows, n_out, dtype=dtype)
    launch_virtual_linear(
        x,
        weight,
        y,
        torch.tensor(keys),
        torch.tensor(scales),
        tid,
        rows,
        ops.triton_dtype(dtype),
        noise="rademacher",
    )
    expected = []
    for m, (key, scale) in enumerate(zip(keys, scales)):
        w = torch.empty_like(weight)
        ops.perturb_reference([weight], [w], [tid], key, scale, "rademacher")
        expected.append(x[m * rows : (m + 1) * rows].float() @ w.float().T)
    tolerance = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}[dtype]
    torch.testing.assert_close(y.float(), torch.cat(expected), rtol=tolerance, atol=tolerance)


def test_low_rank_sign_factors():
    key, tid, shape = noise.member_key(3, 1, 2), 11, torch.Size((30, 20))
    a, b = lowrank.factors(key, tid, shape, 4, "cpu", noise_kind="rademacher")
    assert torch.equal(a.flatten(), noise.rademacher(key, tid, 120, stream=noise.STREAM_LOWRANK_SIGN_A))
    assert torch.equal(b.flatten(), noise.rademacher(key, tid, 80, stream=noise.STREAM_LOWRANK_SIGN_B))
    eps = lowrank.noise_matrix(key, tid, shape, 4, "cpu", noise_kind="rademacher")
    assert torch.equal(eps, a @ b.T / 2)
    assert set((eps * 2).unique().tolist()) <= {-4.0, -2.0, 0.0, 2.0, 4.0}  # sums of 4 signs, over sqrt(4)
    big = lowrank.noise_matrix(key, tid, torch.Size((400, 300)), 8, "cpu", noise_kind="rademacher")
    assert abs(big.mean().item()) < 0.02 and abs(big.var().item() - 1) < 0.05
    # Rank 1 sign factors give a sign matrix.
    assert set(
        lowrank.noise_matrix(key, tid, shape, 1, "cpu", noise_kind="rademacher").unique().tolist()
    ) == {-1.0, 1.0}


@torch.no_grad()
@pytest.mark.parametrize("noise_type, mode", [("full", "materialised"), ("lowrank", "lowrank")])
def test_batched_evaluation_with_signs_equals_member_by_member(tiny, noise_type, mode):
    model, tokenizer = tiny
    es = fastes.ES(
        fastes.linear_weights(model), sigma=0.05, lr=0.01, population=4, seed=2, noise="rademacher",
        noise_type=noise_type, rank=2,
    )  # fmt: skip
    batch = tokenizer(["cd 2 4 8 > 24:", "12+34="], return_tensors="pt", padding=True)
    expected = []
    for member in es.members():
        with member:
            expected.append(model(**batch).logits)
    grouped = {k: v.repeat(es.population, 1) for k, v in batch.items()}
    with population_batched(es, model, mode=mode):
        got = model(**grouped).logits
    torch.testing.assert_close(got, torch.cat(expected), rtol=1e-4, atol=1e-4)


# ---------------------------------------------------------------------------------------------------
# fastes.ES: perturbation, exact restore, resume, replay, state, config
# ---------------------------------------------------------------------------------------------------


def make_net(seed=0, dtype=torch.float32):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1)).to(dtype)


def snapshot(net):
    return {k: v.clone() for k, v in net.state_dict().items()}


def reward(net):
    x = torch.linspace(-1, 1, 48).view(8, 6)
    return -((net(x.to(net[0].weight.dtype)).float() - x[:, :1].sin()) ** 2).mean().item()


def test_members_are_exactly_sigma_signs_and_restore_exactly():
    net = make_net()
    es = fastes.ES(fastes.linear_weights(net), sigma=0.25, lr=0.1, population=4, seed=3, noise="rademacher")
    before = snapshot(net)
    for member in es.members():
        with member:
            for name, p in fastes.linear_weights(net):
                s = noise.rademacher(member.key, noise.tensor_id(name), p.numel()).view(p.shape)
                assert torch.equal(p, before[name] + member.sign * 0.25 * s)
        assert all(torch.equal(v, before[k]) for k, v in net.state_dict().items())


@pytest.mark.parametrize("dtype, rounding", [(torch.float32, False), (torch.bfloat16, True)])
def test_resume_equals_uninterrupted_and_replay_is_exact(dtype, rounding):
    options = dict(
        sigma=0.05, lr=0.01, population=8, seed=21, stochastic_rounding=rounding, noise="rademacher"
    )
    straight = make_net(dtype=dtype)
    base = snapshot(straight)
    es = fastes.ES(fastes.linear_weights(straight), **options)
    for _ in range(6):
        es.step(lambda: reward(straight))
    assert any(not torch.equal(v, base[k]) for k, v in straight.state_dict().items())

    interrupted = make_net(dtype=dtype)
    es1 = fastes.ES(fastes.linear_weights(interrupted), **options)
    for _ in range(3):
        es1.step(lambda: reward(interrupted))
    state, weights = es1.state_dict(), snapshot(interrupted)
    assert state["options"]["noise"] == "rademacher"
    resumed = make_net(seed=99, dtype=dtype)
    resumed.load_state_dict(weights)
    es2 = fastes.ES(fastes.linear_weights(resumed), **options)
    es2.load_state_dict(state)
    for _ in range(3):
        es2.step(lambda: reward(resumed))
    assert all(torch.equal(v, straight.state_dict()[k]) for k, v in resumed.state_dict().items())

    replayed = make_net(seed=99, dtype=dtype)
    replayed.load_state_dict(base)
    fastes.replay(fastes.linear_weights(replayed), es2.state_dict())
    assert all(torch.equal(v, straight.state_dict()[k]) for k, v in replayed.state_dict().items())


def test_loading_a_state_of_the_other_noise_fails_clearly_and_changes_nothing():
    net = make_net()
    sign = fastes.ES(fastes.linear_weights(net), sigma=0.1, lr=0.1, population=4, noise="rademacher")
    sign.step(lambda: reward(net))
    gauss = fastes.ES(fastes.linear_weights(net), sigma=0.1, lr=0.1, population=4)
    with pytest.raises(ValueError, match="saved with noise='rademacher' but this ES uses noise='gaussian'"):
        gauss.load_state_dict(sign.state_dict())
    assert gauss.generation == 0 and gauss.noise == "gaussian"
    with pytest.raises(ValueError, match="saved with noise='gaussian' but this ES uses noise='rademacher'"):
        sign.load_state_dict(gauss.state_dict())
    # A state from before sign noise existed has no "noise" entry: it was Gaussian.
    old = gauss.state_dict()
    del old["options"]["noise"]
    gauss.load_state_dict(old)
    with pytest.raises(ValueError, match="saved with noise='gaussian'"):
        sign.load_state_dict(old)


def test_replay_uses_the_recorded_noise():
    net = make_net()
    base = snapshot(net)
    es = fastes.ES(fastes.linear_weights(net), sigma=0.05, lr=0.05, population=4, seed=1, noise="rademacher")
    for _ in range(2):
        es.step(lambda: reward(net))
    state = es.state_dict()
    as_gaussian = {**state, "options": {**state["options"], "noise": "gaussian"}}
    other = make_net()
    other.load_state_dict(base)
    fastes.replay(fastes.linear_weights(other), as_gaussian)
    assert not torch.equal(other[0].weight, net[0].weight)  # the noise really decides the weights


def test_config_and_cli_take_the_noise(capsys):
    assert load_config(None, {}).es.noise == "gaussian"
    assert load_config(None, {"es.noise": "rademacher"}).es.noise == "rademacher"
    with pytest.raises(ConfigError, match="es.noise: 'sign' is not one of"):
        load_config(None, {"es.noise": "sign"})
    assert main(["train", "--es.noise", "sign"]) == 2
    assert "es.noise" in capsys.readouterr().err


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compiled_cpu_backend_equals_reference_bit_for_bit(dtype):
    # The compiled CPU backend (fastes/compiled.py) packs tensors into chunks on 128-aligned lanes for signs;
    # its results must be the reference's exactly, in every update mode.
    key, scale = noise.member_key(8, 1, 2), 0.05
    src = make_tensors(dtype, 3)
    results = {}
    for backend in ("torch", "cpu"):
        out = [torch.full_like(t, float("nan")) for t in src]
        ops.perturb(src, out, IDS, key, scale, noise_kind="rademacher", backend=backend)
        results[backend, "perturb"] = out
        keys = [noise.member_key(8, 1, j) for j in range(3)]
        for mode, options in {
            "nearest": {"decay": 0.99},
            "stochastic": {"rounding_key": noise.rounding_key(8, 1)},
            "gradient": {"grads": [torch.empty_like(t) for t in src]},
        }.items():
            params = [t.clone() for t in src]
            ops.es_update(
                params,
                IDS,
                keys,
                [0.75, -1.25, 0.5],
                coef=2e-3,
                noise_kind="rademacher",
                backend=backend,
                **options,
            )
            results[backend, mode] = options.get("grads", params)
    for what in ("perturb", "nearest", "stochastic", "gradient"):
        assert all(
            torch.equal(a, b) for a, b in zip(bits(results["torch", what]), bits(results["cpu", what]))
        )


def test_comparison_benchmark_quick_mode_writes_its_report(tmp_path):
    from benchmarks import sign_noise

    results = sign_noise.main(["--quick", "--out", str(tmp_path), "--runs", str(tmp_path / "none")])
    stem = tmp_path / f"sign-noise-cpu-{results['date']}"
    assert {r["op"] for r in results["throughput"]} == {"perturb", "update N=2"}
    assert all(r["gaussian_s"] > 0 and r["rademacher_s"] > 0 for r in results["throughput"])
    for problem in ("toy", "regression"):
        assert set(results[problem]["final"]) == {"gaussian", "rademacher"}
        assert all(len(c) == 4 for curves in results[problem]["curves"].values() for c in curves)  # 3 steps
    report = stem.with_suffix(".md").read_text()
    assert "| README toy" in report and "Countdown: not run" in report
    assert stem.with_suffix(".png").stat().st_size > 0 and stem.with_suffix(".json").exists()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_virtual_linear_with_signs_on_a_transposed_conv1d_weight(dtype):
    # A Conv1D weight is [K, N] (y = x W): its signs follow its own row-major layout, index k N + n.
    members, rows, n_in, n_out = 2, 3, 40, 33
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(members * rows, n_in, generator=gen).to(dtype)
    weight = (torch.randn(n_in, n_out, generator=gen) * 0.1).to(dtype)
    keys = [noise.member_key(9, 0, m) for m in range(members)]
    scales = [0.05, -0.05]
    tid = noise.tensor_id("h.0.mlp.c_fc.weight")
    y = torch.empty(members * rows, n_out, dtype=dtype)
    launch_virtual_linear(
        x, weight, y, torch.tensor(keys), torch.tensor(scales), tid, rows, ops.triton_dtype(dtype),
        None, 32, 32, True, "rademacher",
    )  # fmt: skip
    expected = []
    for m, (key, scale) in enumerate(zip(keys, scales)):
        w = torch.empty_like(weight)
        ops.perturb_reference([weight], [w], [tid], key, scale, "rademacher")
        expected.append(x[m * rows : (m + 1) * rows].float() @ w.float())
    tolerance = {torch.float32: 1e-5, torch.bfloat16: 2e-2}[dtype]
    torch.testing.assert_close(y.float(), torch.cat(expected), rtol=tolerance, atol=tolerance)
