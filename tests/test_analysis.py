"""Tests of fastes.analysis: each measurement against an independent computation or a known answer."""

from __future__ import annotations

import math
import warnings
from fractions import Fraction

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fastes.analysis import (
    KEEP_FRACTIONS,
    binary_entropy,
    delta_log10_histogram,
    gain_retained,
    generalized_js,
    js_diversity,
    k_values,
    keep_masks,
    kept_count,
    masked_nll,
    pass_at_k,
    pass_at_k_curve,
    per_tensor_delta_norms,
    perplexity,
    plots,
    shannon_entropy,
    token_entropies,
    token_entropy,
    token_kl,
    topk_mask_state,
    update_sparsity,
)
from fastes.analysis import drift as drift_module
from fastes.analysis import entropy as entropy_module

LN2 = math.log(2.0)


# ---------------------------------------------------------------- pass@k


def exact_pass_at_k(n: int, c: int, k: int) -> Fraction:
    """1 - C(n-c, k) / C(n, k) in exact arithmetic (math.comb is 0 when k > n - c)."""
    return 1 - Fraction(math.comb(n - c, k), math.comb(n, k))


def test_pass_at_k_matches_exact_arithmetic_on_all_small_cases():
    for n in range(1, 21):
        for c in range(0, n + 1):
            for k in range(1, n + 1):
                got = pass_at_k(n, c, k)
                assert isinstance(got, float)
                assert got == pytest.approx(float(exact_pass_at_k(n, c, k)), abs=1e-12), (n, c, k)


@settings(max_examples=100, deadline=None)
@given(st.data())
def test_pass_at_k_matches_exact_arithmetic_on_large_n(data):
    n = data.draw(st.integers(1, 600))
    c = data.draw(st.integers(0, n))
    k = data.draw(st.integers(1, n))
    assert pass_at_k(n, c, k) == pytest.approx(float(exact_pass_at_k(n, c, k)), abs=1e-10)


def test_pass_at_k_edge_cases():
    assert pass_at_k(10, 0, 1) == 0.0  # nothing correct
    assert pass_at_k(10, 0, 10) == 0.0
    assert pass_at_k(10, 10, 1) == 1.0  # everything correct
    assert pass_at_k(10, 3, 10) == 1.0  # k = n with any correct sample
    assert pass_at_k(10, 7, 4) == 1.0  # n - c = 3 < k = 4
    assert pass_at_k(10, 3, 1) == pytest.approx(0.3)  # pass@1 = c / n
    assert pass_at_k(1, 1, 1) == 1.0


def test_pass_at_k_vectorised_equals_scalar():
    rng = np.random.default_rng(0)
    n = rng.integers(8, 40, size=50)
    c = rng.integers(0, 41, size=50) % (n + 1)
    for k in (1, 3, 8):
        vector = pass_at_k(n, c, k)
        assert isinstance(vector, np.ndarray) and vector.shape == (50,)
        scalars = np.array([pass_at_k(int(ni), int(ci), k) for ni, ci in zip(n, c, strict=True)])
        np.testing.assert_array_equal(vector, scalars)
    # a scalar n broadcasts against an array of counts
    np.testing.assert_array_equal(pass_at_k(16, [0, 4, 16], 2), [pass_at_k(16, x, 2) for x in (0, 4, 16)])


@pytest.mark.parametrize(
    ("n", "c", "k"),
    [(4, 1, 5), (4, -1, 1), (-4, 0, 1), (4, 5, 1), (4, 1, 0), (4.5, 1, 1), ([4, 8], [1, 9], 2), (8, 1, 2.0)],
)
def test_pass_at_k_rejects_bad_arguments(n, c, k):
    with pytest.raises(ValueError):
        pass_at_k(n, c, k)


def test_k_values_are_powers_of_two_then_n():
    assert k_values(1) == [1]
    assert k_values(8) == [1, 2, 4, 8]
    assert k_values(10) == [1, 2, 4, 8, 10]
    with pytest.raises(ValueError):
        k_values(0)


def test_pass_at_k_curve_is_the_mean_over_problems():
    counts = [0, 1, 5, 10]
    curve = pass_at_k_curve(counts, 10)
    assert list(curve) == [1, 2, 4, 8, 10]
    for k, value in curve.items():
        expected = sum(float(exact_pass_at_k(10, c, k)) for c in counts) / len(counts)
        assert value == pytest.approx(expected, abs=1e-12)
    assert curve[1] == pytest.approx(16 / 40)
    assert curve[10] == pytest.approx(0.75)  # every problem with a correct sample counts at k = n
    with pytest.raises(ValueError):
        pass_at_k_curve([], 10)


# ---------------------------------------------------------------- token entropy


def test_entropy_of_uniform_logits_is_log_vocabulary_size():
    vocab = 37
    logits = torch.zeros(2, 5, vocab)
    mask = torch.ones(2, 5, dtype=torch.bool)
    assert token_entropy(logits, mask).item() == pytest.approx(math.log(vocab), rel=1e-6)


def test_entropy_of_a_near_one_hot_distribution_is_near_zero():
    logits = torch.zeros(3, 50)
    logits[:, 7] = 100.0
    mask = torch.ones(3, dtype=torch.bool)
    assert 0.0 <= token_entropy(logits, mask).item() < 1e-6


def test_entropy_with_minus_infinity_logits_is_finite():
    logits = torch.tensor([[0.0, 0.0, -math.inf, -math.inf]])
    value = token_entropy(logits, torch.tensor([True]))
    assert value.item() == pytest.approx(LN2, rel=1e-6)


def test_entropy_averages_only_masked_positions():
    torch.manual_seed(0)
    logits = torch.randn(2, 6, 11) * 3
    mask = torch.tensor([[1, 1, 0, 0, 1, 0], [0, 1, 1, 0, 0, 0]], dtype=torch.bool)
    reference = torch.distributions.Categorical(logits=logits).entropy()[mask].mean()
    assert token_entropy(logits, mask).item() == pytest.approx(reference.item(), rel=1e-5)
    # changing an unmasked position's logits must not change the value
    changed = logits.clone()
    changed[0, 2] = 0.0
    assert token_entropy(changed, mask).item() == pytest.approx(reference.item(), rel=1e-5)
    # a 0/1 float mask means the same as a bool one
    assert token_entropy(logits, mask.float()).item() == pytest.approx(reference.item(), rel=1e-5)


def test_entropy_temperature_divides_the_logits():
    torch.manual_seed(1)
    logits = torch.randn(4, 9) * 2
    mask = torch.ones(4, dtype=torch.bool)
    for temperature in (0.5, 2.0):
        reference = torch.distributions.Categorical(logits=logits / temperature).entropy().mean()
        got = token_entropy(logits, mask, temperature=temperature)
        assert got.item() == pytest.approx(reference.item(), rel=1e-5)
    cold = token_entropy(logits, mask, temperature=0.5).item()
    warm = token_entropy(logits, mask, temperature=2.0).item()
    assert cold < token_entropy(logits, mask).item() < warm
    with pytest.raises(ValueError):
        token_entropy(logits, mask, temperature=0.0)


def test_entropy_chunking_and_dtypes_do_not_change_the_result(monkeypatch):
    torch.manual_seed(2)
    logits = torch.randn(3, 7, 13)
    mask = torch.rand(3, 7) > 0.3
    whole = token_entropy(logits, mask).item()
    monkeypatch.setattr(entropy_module, "ROWS_PER_CHUNK", 2)
    assert token_entropy(logits, mask).item() == pytest.approx(whole, rel=1e-6)
    per_position = token_entropies(logits)
    assert per_position.shape == (3, 7)
    assert per_position[mask].mean().item() == pytest.approx(whole, rel=1e-6)
    bf16 = token_entropy(logits.bfloat16(), mask)
    assert bf16.dtype == torch.float32
    assert bf16.item() == pytest.approx(whole, rel=2e-2)


def test_entropy_of_empty_mask_is_nan_and_bad_mask_shape_raises():
    logits = torch.zeros(2, 3, 4)
    assert math.isnan(token_entropy(logits, torch.zeros(2, 3, dtype=torch.bool)).item())
    with pytest.raises(ValueError):
        token_entropy(logits, torch.ones(2, 4, dtype=torch.bool))


# ---------------------------------------------------------------- Jensen-Shannon diversity


def h(p: float) -> float:
    """Binary entropy in nats written out by hand."""
    return -sum(x * math.log(x) for x in (p, 1 - p) if x > 0)


def test_binary_entropy_values():
    np.testing.assert_allclose(binary_entropy([0.0, 1.0, 0.5, 0.2]), [0.0, 0.0, LN2, h(0.2)], atol=1e-15)


def test_js_of_identical_members_is_zero():
    row = [0.0, 0.25, 0.5, 1.0, 0.9]
    result = js_diversity(np.array([row, row, row]))
    assert result.mean_nats == pytest.approx(0.0, abs=1e-15)
    assert result.normalized == pytest.approx(0.0, abs=1e-15)
    assert result.agreement == 1.0
    np.testing.assert_allclose(result.per_prompt, 0.0, atol=1e-15)


def test_js_of_disjoint_deterministic_members_is_ln2():
    result = js_diversity(np.array([[0, 0, 0, 0], [1, 1, 1, 1]]))
    assert result.mean_nats == pytest.approx(LN2, rel=1e-12)
    assert result.normalized == pytest.approx(1.0, rel=1e-12)
    assert result.agreement == 0.0


def test_js_hand_computed_case():
    acceptance = np.array([[0.2, 1.0, 0.0], [0.6, 1.0, 1.0]])
    first = h(0.4) - (h(0.2) + h(0.6)) / 2
    third = h(0.5) - 0.0
    result = js_diversity(acceptance)
    np.testing.assert_allclose(result.per_prompt, [first, 0.0, third], rtol=1e-12, atol=1e-15)
    assert result.mean_nats == pytest.approx((first + third) / 3, rel=1e-12)
    assert result.normalized == pytest.approx((first + third) / 3 / LN2, rel=1e-12)
    assert result.agreement == pytest.approx(1 / 3)  # only the all-correct prompt


def test_js_agreement_of_greedy_outcomes_counts_all_fail_and_all_pass():
    outcomes = np.array([[0, 1, 0, 1], [0, 1, 1, 0], [0, 1, 1, 1]])
    assert js_diversity(outcomes).agreement == pytest.approx(0.5)
    assert js_diversity(torch.tensor(outcomes)).agreement == pytest.approx(0.5)  # tensors accepted


def test_verifier_projection_equals_generalized_js_on_bernoulli_distributions():
    rng = np.random.default_rng(3)
    acceptance = rng.random((5, 8))
    bernoulli = np.stack([1 - acceptance, acceptance], axis=-1).transpose(1, 0, 2)  # [prompts, members, 2]
    per_prompt = generalized_js(bernoulli)
    np.testing.assert_allclose(js_diversity(acceptance).per_prompt, per_prompt, rtol=1e-10, atol=1e-15)


def test_generalized_js_known_values():
    identical = np.tile([0.1, 0.2, 0.7], (4, 1))
    assert generalized_js(identical) == pytest.approx(0.0, abs=1e-15)
    one_hots = np.eye(4)  # four members, each certain of a different outcome
    assert generalized_js(one_hots) == pytest.approx(math.log(4), rel=1e-12)
    two = np.array([[0.5, 0.5, 0.0], [0.0, 0.5, 0.5]])
    mean = np.array([0.25, 0.5, 0.25])
    expected = -(mean * np.log(mean)).sum() - LN2
    assert generalized_js(two) == pytest.approx(expected, rel=1e-12)
    assert shannon_entropy([0.5, 0.5, 0.0]) == pytest.approx(LN2)


@pytest.mark.parametrize(
    "bad", [[0.5, 0.5], [[0.5, 1.5]], [[-0.1, 0.2]], [[math.nan, 0.0]], np.zeros((0, 3))]
)
def test_js_diversity_rejects_bad_input(bad):
    with pytest.raises(ValueError):
        js_diversity(np.array(bad))


def test_generalized_js_rejects_rows_not_summing_to_one():
    with pytest.raises(ValueError):
        generalized_js([[0.5, 0.4], [0.5, 0.5]])


# ---------------------------------------------------------------- sparsity


def make_states(seed: int = 0) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """A small base/trained pair: three dtypes, an integer buffer, some unchanged and tied elements."""
    generator = torch.Generator().manual_seed(seed)
    base = {
        "a.weight": torch.randn(7, 5, generator=generator),
        "b.weight": torch.randn(13, generator=generator).bfloat16(),
        "c.weight": torch.randn(3, 4, generator=generator).half(),
        "position_ids": torch.arange(6),
    }
    trained = {}
    for name, tensor in base.items():
        if not tensor.is_floating_point():
            trained[name] = tensor.clone()
            continue
        step = torch.randn(tensor.shape, generator=generator) * 0.1
        step[torch.rand(tensor.shape, generator=generator) < 0.2] = 0.0  # unchanged elements (ties at 0)
        trained[name] = (tensor.float() + step).to(tensor.dtype)
    return base, trained


FLOAT_NAMES = ("a.weight", "b.weight", "c.weight")


def test_kept_count_rounds_half_up():
    assert kept_count(0.25, 10) == 3  # 2.5 -> 3
    assert kept_count(0.1, 7) == 1  # 0.7 -> 1
    assert kept_count(0.05, 7) == 0  # 0.35 -> 0
    assert kept_count(0.001, 1000) == 1
    assert kept_count(1.0, 60) == 60
    assert kept_count(0.0, 60) == 0
    with pytest.raises(ValueError):
        kept_count(1.5, 10)


@pytest.mark.parametrize("kind", ["top", "bottom", "random"])
@pytest.mark.parametrize("scope", ["global", "per_tensor"])
def test_masks_keep_exactly_the_requested_counts(scope, kind):
    base, trained = make_states()
    sizes = {name: base[name].numel() for name in FLOAT_NAMES}
    for fraction in (0.0, *KEEP_FRACTIONS, 0.3, 0.77):
        masks = keep_masks(base, trained, fraction, scope=scope, kind=kind, seed=5)
        assert set(masks) == set(FLOAT_NAMES)
        counts = {name: int(mask.sum()) for name, mask in masks.items()}
        if scope == "global":
            assert sum(counts.values()) == kept_count(fraction, sum(sizes.values())), fraction
        else:
            assert counts == {name: kept_count(fraction, n) for name, n in sizes.items()}, fraction
        for name, mask in masks.items():
            assert mask.dtype == torch.bool and mask.shape == base[name].shape


def test_masked_state_takes_kept_elements_from_trained_and_the_rest_from_base():
    base, trained = make_states()
    masks = keep_masks(base, trained, 0.3, scope="global", kind="top")
    state = topk_mask_state(base, trained, 0.3, scope="global", kind="top")
    assert set(state) == set(trained)
    for name in FLOAT_NAMES:
        assert state[name].dtype == trained[name].dtype
        mask = masks[name]
        assert torch.equal(state[name][mask], trained[name][mask])
        assert torch.equal(state[name][~mask], base[name][~mask])
    assert torch.equal(state["position_ids"], trained["position_ids"])


@pytest.mark.parametrize("kind", ["top", "bottom", "random"])
@pytest.mark.parametrize("scope", ["global", "per_tensor"])
def test_full_mask_reproduces_trained_and_empty_mask_reproduces_base(scope, kind):
    base, trained = make_states(seed=1)
    full = topk_mask_state(base, trained, 1.0, scope=scope, kind=kind)
    empty = topk_mask_state(base, trained, 0.0, scope=scope, kind=kind)
    for name in trained:
        assert full[name].dtype == trained[name].dtype
        assert torch.equal(full[name], trained[name]), name
        assert torch.equal(empty[name], base[name]), name
    assert full["a.weight"] is not trained["a.weight"]  # a new state dict, not an alias


def test_masked_state_is_exact_where_fp32_arithmetic_would_round():
    base = {"w": torch.tensor([1.0, 3.0, 5.0])}
    trained = {"w": torch.tensor([1e-30, 3.0 + 2**-22, 5.0])}  # 1 + (1e-30 - 1) would give 0 in fp32
    assert torch.equal(topk_mask_state(base, trained, 1.0)["w"], trained["w"])
    expected = torch.tensor([1e-30, 3.0, 5.0])  # only the largest update (element 0) is kept
    assert torch.equal(topk_mask_state(base, trained, 1 / 3)["w"], expected)


def kept_and_dropped(base, trained, masks):
    magnitudes = {name: (trained[name].float() - base[name].float()).abs() for name in masks}
    kept = torch.cat([magnitudes[name][masks[name]] for name in masks])
    dropped = torch.cat([magnitudes[name][~masks[name]] for name in masks])
    return kept, dropped


def test_top_mask_keeps_the_largest_updates_and_bottom_the_smallest():
    base, trained = make_states(seed=2)
    top_kept, top_dropped = kept_and_dropped(base, trained, keep_masks(base, trained, 0.25, kind="top"))
    assert top_kept.min() >= top_dropped.max()
    bottom_masks = keep_masks(base, trained, 0.25, kind="bottom")
    bottom_kept, bottom_dropped = kept_and_dropped(base, trained, bottom_masks)
    assert bottom_kept.max() <= bottom_dropped.min()
    per_tensor = keep_masks(base, trained, 0.25, scope="per_tensor", kind="top")
    for name, mask in per_tensor.items():
        magnitude = (trained[name].float() - base[name].float()).abs()
        assert magnitude[mask].min() >= magnitude[~mask].max()


def test_random_mask_depends_on_the_seed_only():
    base, trained = make_states(seed=3)
    first = keep_masks(base, trained, 0.5, kind="random", seed=11)
    again = keep_masks(base, trained, 0.5, kind="random", seed=11)
    other = keep_masks(base, trained, 0.5, kind="random", seed=12)
    top = keep_masks(base, trained, 0.5, kind="top")
    assert all(torch.equal(first[name], again[name]) for name in first)
    assert not all(torch.equal(first[name], other[name]) for name in first)
    assert not all(torch.equal(first[name], top[name]) for name in first)


def test_ties_are_broken_by_position():
    base = {"x": torch.zeros(3, 2), "y": torch.zeros(4)}
    trained = {"x": torch.ones(3, 2), "y": torch.ones(4)}  # every |delta| is 1: all tied
    masks = keep_masks(base, trained, 0.5, scope="global", kind="top")  # 5 of 10, the earliest ones
    assert masks["x"].reshape(-1).tolist() == [True] * 5 + [False]
    assert masks["y"].tolist() == [False, False, False, False]
    masks = keep_masks(base, trained, 0.7, scope="global", kind="bottom")  # 7 of 10
    assert masks["x"].all()
    assert masks["y"].tolist() == [True, False, False, False]


def test_mask_arguments_are_checked():
    base, trained = make_states()
    with pytest.raises(ValueError):
        keep_masks(base, trained, 0.1, scope="layer")
    with pytest.raises(ValueError):
        keep_masks(base, trained, 0.1, kind="middle")
    with pytest.raises(ValueError):
        keep_masks(base, trained, -0.1)
    with pytest.raises(ValueError):
        keep_masks(base, {k: v for k, v in trained.items() if k != "a.weight"}, 0.1)
    with pytest.raises(ValueError):
        keep_masks(base, {**trained, "a.weight": torch.zeros(5, 7)}, 0.1)
    with pytest.raises(ValueError):
        keep_masks({"x": torch.zeros(2)}, {"x": torch.tensor([1.0, math.nan])}, 0.5)


def test_update_sparsity_at_each_tolerance():
    base = {"p": torch.zeros(5), "q": torch.zeros(3), "steps": torch.tensor([4])}
    trained = {
        "p": torch.tensor([0.0, 1e-9, 1e-7, 1e-5, 1e-3]),
        "q": torch.tensor([0.0, 0.0, 1.0]),
        "steps": torch.tensor([9]),  # integer buffers are not counted
    }
    result = update_sparsity(base, trained)
    assert result.n_elements == 8
    assert result.per_tensor["p"] == pytest.approx({0.0: 0.2, 1e-8: 0.4, 1e-6: 0.6, 1e-4: 0.8})
    assert result.per_tensor["q"] == pytest.approx({0.0: 2 / 3, 1e-8: 2 / 3, 1e-6: 2 / 3, 1e-4: 2 / 3})
    assert result.overall == pytest.approx({0.0: 3 / 8, 1e-8: 4 / 8, 1e-6: 5 / 8, 1e-4: 6 / 8})
    assert set(result.per_tensor) == {"p", "q"}
    assert update_sparsity(base, trained, tolerances=(0.5,)).overall == {0.5: 7 / 8}
    with pytest.raises(ValueError):
        update_sparsity(base, trained, tolerances=(-1.0,))


def test_bf16_updates_below_half_a_step_are_counted_as_unchanged():
    base = {"w": torch.ones(4, dtype=torch.bfloat16)}
    trained = {"w": (torch.ones(4) + torch.tensor([1e-4, 1e-4, 1e-2, 0.0])).bfloat16()}
    assert update_sparsity(base, trained).overall[0.0] == 0.75  # only the 1e-2 step survives rounding


def test_per_tensor_delta_norms():
    base = {"a": torch.tensor([3.0, 0.0]), "b": torch.zeros(2)}
    trained = {"a": torch.tensor([6.0, 4.0]), "b": torch.zeros(2)}
    assert per_tensor_delta_norms(base, trained) == pytest.approx({"a": 5.0, "b": 0.0})
    relative = per_tensor_delta_norms(base, trained, relative=True)
    assert relative["a"] == pytest.approx(5.0 / 3.0)
    assert math.isnan(relative["b"])


def test_gain_retained_and_its_undefined_case():
    assert gain_retained(0.5, 0.2, 0.8) == pytest.approx(0.5)
    assert gain_retained(0.2, 0.2, 0.8) == pytest.approx(0.0)
    np.testing.assert_allclose(gain_retained([0.2, 0.5, 0.8, 0.9], 0.2, 0.8), [0.0, 0.5, 1.0, 7 / 6])
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no division warning either
        assert math.isnan(gain_retained(0.5, 0.4, 0.4))
        assert np.isnan(gain_retained([0.3, 0.5], 0.4, 0.4)).all()


def test_delta_log10_histogram_bins_and_zeros():
    base = {"w": torch.zeros(6), "n": torch.arange(3)}
    trained = {"w": torch.tensor([0.0, 0.0, 3e-3, 5e-3, 3e-6, 1e-20]), "n": torch.arange(3)}
    histogram = delta_log10_histogram(base, trained, bins=12, low=-12.0, high=0.0)  # one bin per decade
    assert histogram.n_zero == 2
    assert histogram.n_elements == 6
    assert histogram.counts.sum() + histogram.n_zero == histogram.n_elements
    assert len(histogram.edges) == 13
    assert histogram.counts[9] == 2  # log10 in [-3, -2)
    assert histogram.counts[6] == 1  # log10 in [-6, -5)
    assert histogram.counts[0] == 1  # 1e-20 is below the range: clamped into the first bin


# ---------------------------------------------------------------- drift


def test_kl_of_identical_logits_is_zero_and_positive_otherwise():
    torch.manual_seed(4)
    logits = torch.randn(2, 5, 17)
    mask = torch.ones(2, 5, dtype=torch.bool)
    assert token_kl(logits, logits.clone(), mask).item() == 0.0
    other = logits + 0.5 * torch.randn(2, 5, 17)
    assert token_kl(logits, other, mask).item() > 0.0


def test_kl_matches_torch_distributions_on_masked_positions(monkeypatch):
    torch.manual_seed(5)
    logits_p = torch.randn(3, 4, 9)
    logits_q = torch.randn(3, 4, 9)
    mask = torch.rand(3, 4) > 0.4
    reference = torch.distributions.kl_divergence(
        torch.distributions.Categorical(logits=logits_p), torch.distributions.Categorical(logits=logits_q)
    )[mask].mean()
    assert token_kl(logits_p, logits_q, mask).item() == pytest.approx(reference.item(), rel=1e-5)
    monkeypatch.setattr(drift_module, "ROWS_PER_CHUNK", 2)
    assert token_kl(logits_p, logits_q, mask).item() == pytest.approx(reference.item(), rel=1e-5)
    assert math.isnan(token_kl(logits_p, logits_q, torch.zeros(3, 4, dtype=torch.bool)).item())
    with pytest.raises(ValueError):
        token_kl(logits_p, logits_q[:, :3], mask)


def test_perplexity_and_masked_nll():
    assert perplexity(0.0, 10) == 1.0
    assert perplexity(10 * math.log(5.0), 10) == pytest.approx(5.0)
    assert perplexity(torch.tensor(2.0), 1) == pytest.approx(math.e**2)
    assert perplexity(1e6, 1) == math.inf
    with pytest.raises(ValueError):
        perplexity(1.0, 0)
    vocab = 23
    logits = torch.zeros(2, 4, vocab)  # uniform: every token has probability 1 / vocab
    targets = torch.randint(0, vocab, (2, 4))
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0]], dtype=torch.bool)
    nll, n_tokens = masked_nll(logits, targets, mask)
    assert n_tokens == 4
    assert nll == pytest.approx(4 * math.log(vocab), rel=1e-6)
    assert perplexity(nll, n_tokens) == pytest.approx(vocab, rel=1e-5)
    peaked = torch.full((1, 1, 3), -30.0)
    peaked[0, 0, 2] = 30.0
    assert masked_nll(peaked, torch.tensor([[2]]), torch.tensor([[True]]))[0] == pytest.approx(0.0, abs=1e-6)


# ---------------------------------------------------------------- plots


def assert_png(path):
    data = path.read_bytes()
    assert len(data) > 1000
    assert data[:8] == b"\x89PNG\r\n\x1a\n"


def test_every_plot_writes_a_png(tmp_path):
    written = [
        plots.plot_pass_at_k(
            {"base": {1: 0.2, 2: 0.3, 4: 0.4, 8: 0.5}, "ES": {1: 0.3, 2: 0.45, 4: 0.55, 8: 0.62}},
            tmp_path / "passk.png",
        ),
        plots.plot_metric_over_steps(
            {"ES": ([0, 10, 20], [1.2, 1.1, 1.15]), "GRPO": {0: 1.2, 10: 0.6, 20: 0.2}},
            tmp_path / "entropy.png",
        ),
        plots.plot_js_diversity({"N=30": ([0, 1, 2, 3], [0.1, 0.2, 0.15, math.nan])}, tmp_path / "js.png"),
        plots.plot_gain_retained(
            {
                "top-k global": {0.01: 0.5, 0.1: 0.9, 1.0: 1.0},
                "random (control)": {0.01: 0.0, 0.1: 0.1, 1.0: 1.0},
                "bottom-k (control)": {0.01: -0.1, 0.1: 0.0, 1.0: 1.0},
            },
            tmp_path / "gain.png",
        ),
        plots.plot_model_bars(
            {"base": {"countdown": 0.1, "arith": 0.5}, "ES": {"countdown": 0.4, "arith": 0.48}, "GRPO": {}},
            tmp_path / "heldout.png",
        ),
        plots.plot_population_sweep(
            {"small": {8: 0.3, 16: 0.35, 32: 0.4}, "large": {8: 0.5, 16: 0.52, 32: 0.5}},
            tmp_path / "sweep.png",
        ),
        plots.plot_delta_histogram(
            {"ES": delta_log10_histogram(*make_states())}, tmp_path / "sub" / "hist.png"
        ),
    ]
    for path in written:
        assert path.exists()
        assert_png(path)


def test_plots_refuse_empty_or_mismatched_input(tmp_path):
    with pytest.raises(ValueError):
        plots.plot_pass_at_k({}, tmp_path / "x.png")
    with pytest.raises(ValueError):
        plots.plot_metric_over_steps({"run": ([0, 1], [1.0])}, tmp_path / "x.png")
    assert not (tmp_path / "x.png").exists()
