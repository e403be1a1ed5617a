"""Low-rank noise: factors from the noise contract, factored forward, GEMM update, ES with it."""

import math

import pytest
import torch
from conftest import NOISE_KINDS

import fastes
from fastes.engine import cpu_library, lowrank, noise
from fastes.es.population import LowRankLinear, population_batched


def test_noise_matrix_is_the_scaled_product_of_contract_factors():
    key, tid = noise.member_key(1, 2, 3), noise.tensor_id("w")
    a, b = lowrank.factors(key, tid, torch.Size((30, 20)), 4, "cpu")
    torch.testing.assert_close(a.flatten(), noise.normal(key, tid, 120, stream=noise.STREAM_LOWRANK_A))
    torch.testing.assert_close(b.flatten(), noise.normal(key, tid, 80, stream=noise.STREAM_LOWRANK_B))
    eps = lowrank.noise_matrix(key, tid, torch.Size((30, 20)), 4, "cpu")
    torch.testing.assert_close(eps, a @ b.T / 2)
    assert torch.linalg.matrix_rank(eps) == 4
    big = lowrank.noise_matrix(key, tid, torch.Size((400, 300)), 8, "cpu")
    assert abs(float(big.var()) - 1) < 0.1  # entries have unit variance, like full-rank noise


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


@pytest.mark.parametrize("backend", ["cpu", "torch"])
@pytest.mark.parametrize("shape", [(6, 5), (1, 1), (33, 700), (900, 1200)])
def test_update_equals_the_plain_formula(backend, shape):
    """The fp32 update in place (one pass over the weight in the compiled library; a GEMM with beta =
    decay elsewhere) against the naive sum, over odd sizes, a row longer than the library's column tile,
    enough rows for two threads, and several seeds."""
    for seed in (0, 1, 2):
        torch.manual_seed(seed)
        w = torch.randn(shape)
        before = w.clone()
        keys = [noise.member_key(seed, 0, j) for j in range(3)]
        weights = [0.5, -1.0, 2.0]
        pairs = [lowrank.factors(key, 7, w.shape, 2, "cpu") for key in keys]
        lowrank.update(w, 7, pairs, weights, coef=0.1, decay=0.9, rank=2, backend=backend)
        expected = before.double() * 0.9
        for (a, b), weight in zip(pairs, weights):
            expected += 0.1 * weight * (a.double() @ b.double().T) / math.sqrt(2)
        torch.testing.assert_close(w.double(), expected, rtol=0, atol=2e-5)


@pytest.mark.parametrize("backend", ["cpu", "torch"])
@pytest.mark.parametrize("noise_kind", NOISE_KINDS)
def test_all_factors_equal_each_tensors_own(backend, noise_kind):
    """Many tensors' factors from one call per side are each tensor's factors, whatever else is drawn."""
    shapes = [torch.Size(s) for s in ((33, 70), (1, 5), (128, 3), (7, 7), (300, 1000))]
    ids = [noise.tensor_id(f"w{i}") for i in range(len(shapes))]
    for seed, rank in ((0, 1), (5, 3)):
        key = noise.member_key(seed, 4, 1)
        together = lowrank.all_factors(key, ids, shapes, rank, torch.device("cpu"), backend, noise_kind)
        for tid, shape, (a, b) in zip(ids, shapes, together):
            own_a, own_b = lowrank.factors(key, tid, shape, rank, torch.device("cpu"), "torch", noise_kind)
            assert a.shape == (shape[0], rank) and b.shape == (shape[1], rank)
            if noise_kind == "rademacher":
                assert torch.equal(a, own_a) and torch.equal(b, own_b)
            else:
                torch.testing.assert_close(a, own_a)
                torch.testing.assert_close(b, own_b)


@pytest.mark.parametrize("backend", ["cpu", "torch"])
@pytest.mark.parametrize("noise_kind", NOISE_KINDS)
def test_direction_factors_are_each_directions_factors(backend, noise_kind):
    """Every direction's factors in one buffer (one library call a direction and side on the compiled
    backend) are, bit for bit, what `all_factors` gives that direction on the same backend; joined, they
    are the update's operands `_joined` makes from the pairs."""
    shapes = [torch.Size(s) for s in ((33, 70), (1, 5), (128, 3), (7, 7), (300, 1000))]
    ids = [noise.tensor_id(f"w{i}") for i in range(len(shapes))]
    for seed, rank, directions in ((0, 1, 3), (5, 3, 2), (9, 2, 5)):
        keys = [noise.member_key(seed, 4, j) for j in range(directions)]
        every = lowrank.direction_factors(keys, ids, shapes, rank, torch.device("cpu"), backend, noise_kind)
        pairs = [
            lowrank.all_factors(key, ids, shapes, rank, torch.device("cpu"), backend, noise_kind)
            for key in keys
        ]
        for d in range(directions):
            for i, (a, b) in enumerate(pairs[d]):
                mine_a, mine_b = every.pair(d, i)
                assert torch.equal(mine_a, a) and torch.equal(mine_b, b)
        scales = torch.randn(directions)
        for i, (a_all, b_all) in enumerate(every.joined(scales)):
            columns = scales.repeat_interleave(rank)  # direction d's scale on its r columns
            want_a, want_b = lowrank._joined([pairs[d][i] for d in range(directions)], columns)
            assert torch.equal(a_all, want_a) and torch.equal(b_all, want_b)
            assert b_all.T.is_contiguous()  # the compiled update reads B^T row by row


@pytest.mark.parametrize("rank", [1, 2])
def test_member_sides_are_the_members_own_factors(rank):
    """A population layer's sides gathered for members in any order of directions (antithetic twins,
    repeats) and matrices either way round (Conv1D's [in, out]) equal those stacked from each member's
    own factors and scale, bit for bit, and are row-major (the library reads them by address)."""
    shapes = [torch.Size(s) for s in ((6, 5), (1, 9), (17, 3), (4, 4))]
    transposed = [False, True, False, True]
    ids = [noise.tensor_id(f"m{i}") for i in range(len(shapes))]
    keys = [noise.member_key(3, 1, j) for j in range(4)]
    every = lowrank.direction_factors(keys, ids, shapes, rank, torch.device("cpu"))
    directions, scales = [2, 2, 0, 3, 1, 0], [0.02, -0.02, 0.5, -1e-3, 3.0, 0.02]
    sides = every.member_sides(directions, scales, transposed).per_matrix
    for i, ((inputs, outputs), swap, shape) in enumerate(zip(sides, transposed, shapes)):
        base = torch.nn.Linear(*(shape if swap else shape[::-1]))
        reference = LowRankLinear.from_factors(
            base, [every.pair(d, i) for d in directions], scales, swap, "torch"
        )
        assert torch.equal(inputs, reference.inputs) and torch.equal(outputs, reference.outputs)
        for side in (inputs, outputs):
            members, r, n = side.shape
            assert (members, r) == (len(directions), rank) and side.stride() == (r * n, n, 1)


@torch.no_grad()
@pytest.mark.parametrize("noise_kind", NOISE_KINDS)
def test_factored_forward_equals_materialised_low_rank_weights(tiny, noise_kind):
    model, tokenizer = tiny
    es = fastes.ES(
        fastes.linear_weights(model), sigma=0.05, lr=0.01, population=4, seed=2, noise=noise_kind,
        noise_type="lowrank", rank=2,
    )  # fmt: skip
    batch = tokenizer(["cd 2 4 8 > 24:", "12+34="], return_tensors="pt", padding=True)
    expected = []
    for member in es.members():
        with member:
            expected.append(model(**batch).logits)
    grouped = {k: v.repeat(es.population, 1) for k, v in batch.items()}
    with population_batched(es, model, mode="lowrank"):
        assert sum(isinstance(m, LowRankLinear) for m in model.modules()) == len(es.param_groups[0]["params"])
        factored = model(**grouped).logits
    with population_batched(es, model, mode="materialised"):
        materialised = model(**grouped).logits
    torch.testing.assert_close(factored, torch.cat(expected), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(materialised, torch.cat(expected), rtol=1e-4, atol=1e-4)


def rank_term_reference(x, weight, bias, factors, scales):
    """x W^T + b + scale_m / sqrt(r) (x B_m) A_m^T for member m's rows, in float64: the naive formula."""
    members = len(factors)
    rows = x.double().reshape(members, -1, x.shape[-1])
    out = []
    for m, ((a, b), scale) in enumerate(zip(factors, scales)):
        eps = a.double() @ b.double().T / math.sqrt(a.shape[1])
        out.append(rows[m] @ (weight.double() + scale * eps).T + (0 if bias is None else bias.double()))
    return torch.cat(out)


class CountingLinear(torch.nn.Linear):
    """An nn.Linear subclass with a forward of its own (as quantised or adapter layers have): the layer
    must run that forward, not the plain GEMM."""

    calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        CountingLinear.calls += 1
        return super().forward(x)


@torch.no_grad()
@pytest.mark.parametrize(
    ("path", "dtype"),
    [("linear", torch.float32), ("subclass", torch.float32), ("linear", torch.bfloat16)],
)
@pytest.mark.parametrize("rank", [1, 3])
@pytest.mark.parametrize(
    ("members", "rows", "in_features", "out_features"), [(1, 1, 5, 3), (3, 5, 37, 53), (4, 2, 64, 17)]
)
def test_low_rank_layer_equals_the_formula(path, dtype, rank, members, rows, in_features, out_features):
    """LowRankLinear off the Triton backend (the base projection's own forward, a subclass's included,
    then the term added into its output) against the naive per-member formula, over odd sizes, ranks,
    dtypes and seeds."""
    kind = CountingLinear if path == "subclass" else torch.nn.Linear
    for seed in (0, 1, 2):
        torch.manual_seed(seed)
        base = kind(in_features, out_features, bias=seed != 1).to(dtype)
        calls = CountingLinear.calls
        factors = [(torch.randn(out_features, rank), torch.randn(in_features, rank)) for _ in range(members)]
        scales = torch.randn(members).tolist()
        layer = LowRankLinear.from_factors(base, factors, scales)
        x = torch.randn(members * rows, 2, in_features).to(dtype)  # [batch, positions, in]
        expected = rank_term_reference(x, base.weight, base.bias, factors, scales)
        got = layer(x)
        assert CountingLinear.calls == calls + (path == "subclass")
        assert got.shape == (members * rows, 2, out_features) and got.dtype == dtype
        # bf16 rounds the base output and the sum once each: errors scale with the largest output
        atol = 1e-5 if dtype == torch.float32 else 1e-2 * float(expected.abs().max())
        rtol = 1e-5 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(got.double().reshape(-1, out_features), expected, rtol=rtol, atol=atol)


needs_library = pytest.mark.skipif(
    not cpu_library.available(), reason="no C compiler here: the compiled CPU library cannot be built"
)


def member_rows_reference(x, weight, bias, factors, scales, counts):
    """rank_term_reference for member groups of counts[m] rows each (of any size, in member order)."""
    starts = [sum(counts[:m]) for m in range(len(counts) + 1)]
    return torch.cat(
        [
            rank_term_reference(x[starts[m] : starts[m + 1]], weight, bias, [factors[m]], [scales[m]])
            for m in range(len(counts))
        ]
    )


@needs_library
@torch.no_grad()
@pytest.mark.parametrize("rank", [1, 3])
@pytest.mark.parametrize("with_bias", [True, False])
def test_a_small_low_rank_layer_forms_its_members_weights_in_the_member_matmul(monkeypatch, rank, with_bias):
    """A layer too small for the library's products runs the member matmul with its members' factors
    (each member's weight formed as the shared weight is loaded; no term pass) where that is this
    machine's product: each member's rows get its own perturbed weight, in equal groups, in groups of
    any size (decoding's finished rows leaving) and after members leave. Where the member matmul with
    factors measured slower (whatever the materialised layers' choice), or with a base of another kind,
    it adds the term after the base's product, with the same result."""
    from conftest import library_calls

    from fastes.engine import cpu_linear

    taken = library_calls(monkeypatch)
    members, in_features, out_features = 4, 37, 53  # odd widths: the last columns one by one
    tolerance = {"rtol": 1e-5, "atol": 1e-5}
    for seed in (0, 1, 2):
        torch.manual_seed(seed)
        base = torch.nn.Linear(in_features, out_features, bias=with_bias)
        factors = [(torch.randn(out_features, rank), torch.randn(in_features, rank)) for _ in range(members)]
        scales = (torch.randn(members) * 0.1).tolist()
        layer = LowRankLinear.from_factors(base, factors, scales, backend="cpu")
        x = torch.randn(members * 5, 2, in_features)  # [batch, positions, in]
        taken.clear()
        expected = rank_term_reference(x, base.weight, base.bias, factors, scales)
        torch.testing.assert_close(layer(x).double().reshape(-1, out_features), expected, **tolerance)
        assert taken == ["member_matmul"]
        counts = [2, 0, 5, 1]  # rows leaving one by one while decoding
        layer.set_member_rows(counts)
        flat = x[:8, 0]
        expected = member_rows_reference(flat, base.weight, base.bias, factors, scales, counts)
        torch.testing.assert_close(layer(flat).double(), expected, **tolerance)
        layer.set_member_rows(None)
        layer.keep_members([1, 3])
        kept = [factors[1], factors[3]], [scales[1], scales[3]]
        expected = rank_term_reference(x[:6], base.weight, base.bias, *kept)
        torch.testing.assert_close(layer(x[:6]).double().reshape(-1, out_features), expected, **tolerance)
        for setting in ("term measured faster", "another base"):
            with monkeypatch.context() as m:
                if setting == "term measured faster":  # the materialised layers' member matmul kept; the
                    # small plain layers' packed linear too, which a small low-rank layer does not take
                    m.setattr(
                        cpu_linear,
                        "products",
                        lambda threads: cpu_linear.Products(True, True, True, True, False, True, True),
                    )
                    layer = LowRankLinear.from_factors(base, factors, scales, backend="cpu")
                else:
                    other = CountingLinear(in_features, out_features, bias=with_bias)
                    other.load_state_dict(base.state_dict())
                    layer = LowRankLinear.from_factors(other, factors, scales, backend="cpu")
                taken.clear()
                expected = rank_term_reference(x, base.weight, base.bias, factors, scales)
                torch.testing.assert_close(layer(x).double().reshape(-1, out_features), expected, **tolerance)
                assert taken == ["lowrank_term"]


@needs_library
@torch.no_grad()
@pytest.mark.parametrize("member_matmul", [True, False])
def test_a_populations_low_rank_layers_are_the_last_ones_rearmed(tiny, monkeypatch, member_matmul):
    """The next generation's low-rank layers are the last population's, re-armed: the same objects, the
    new factors written into the sides they view, the member matmul's copy of each weight made again
    after the update, and the rows' grouping a decoding left forgotten; they compute what layers built
    afresh compute, bit for bit. Layers that dropped members, or weights that moved, are built afresh."""
    from fastes.engine import cpu_linear
    from fastes.es import population

    monkeypatch.setattr(
        cpu_linear,
        "products",
        lambda threads: cpu_linear.Products(True, True, True, True, member_matmul, True, True),
    )
    model, _ = tiny
    es = fastes.ES(
        fastes.linear_weights(model), sigma=0.05, lr=0.05, population=4, noise_type="lowrank", seed=1
    )
    x = torch.randint(0, 10, (8, 5))

    def layers() -> list[LowRankLinear]:
        return [m for m in model.modules() if isinstance(m, LowRankLinear)]

    with population_batched(es, model, mode="lowrank"):
        last = layers()
        for layer in last:
            layer.set_member_rows([2, 1, 0, 3])  # as a decoding leaves them
    assert any(layer._weight_t is not None for layer in last) == member_matmul
    for _ in range(3):
        es.step(torch.randn(4, 2))
        with population_batched(es, model, mode="lowrank"):
            again = layers()
            got = model(x).logits
        assert all(a is b for a, b in zip(again, last, strict=True))
        population._kept_layers.clear()
        with population_batched(es, model, mode="lowrank"):
            last = layers()
            assert not any(a is b for a, b in zip(last, again))
            assert torch.equal(model(x).logits, got)
    with population_batched(es, model, mode="lowrank"):
        last[0].keep_members([0, 1, 3])  # a decoding drops a member from one layer: the next ones are new
    with population_batched(es, model, mode="lowrank"):
        assert not any(a is b for a, b in zip(layers(), last))
        last = layers()
    weight = es.param_groups[0]["params"][3]
    weight.data = weight.data.clone()  # the same values elsewhere: a layer must not read the old storage
    with population_batched(es, model, mode="lowrank"):
        assert not any(a is b for a, b in zip(layers(), last))


@needs_library
@pytest.mark.parametrize(("rows", "cols", "k_total"), [(3, 5, 1), (7, 64, 8), (5, 130, 3), (2, 1200, 16)])
def test_compiled_update_is_the_ordered_formula_bit_for_bit(rows, cols, k_total):
    """The library's update (runs of 64 columns summed in vectors, the rest one by one) against
    w * decay + sum_k a[:, k] bt[k] summed in order in plain fp32 torch: every bit equal."""
    for seed in (0, 1):
        torch.manual_seed(seed)
        w, a, b = torch.randn(rows, cols), torch.randn(rows, k_total), torch.randn(cols, k_total)
        total = torch.zeros(rows, cols)
        for k in range(k_total):
            total = total + a[:, k : k + 1] * b[:, k]
        expected = w * 0.9 + total
        largest = cpu_library.lowrank_update(w, a, b, 0.9)
        assert torch.equal(w, expected)
        assert largest == float(expected.abs().max())  # measured as it writes, for ES's next check


@needs_library
@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_compiled_update_reports_a_non_finite_result(bad):
    for column in (0, 70):  # in a run of 64 columns, and in the columns after the last run
        w, a, b = torch.randn(4, 75), torch.randn(4, 2), torch.randn(75, 2)
        w[2, column] = bad
        assert math.isnan(cpu_library.lowrank_update(w, a, b, 0.5))


@needs_library
def test_compiled_update_of_many_tensors_is_each_tensors_own_update(monkeypatch):
    """All tensors' rows split over the threads at once (ranges crossing from one tensor into the next)
    give every tensor exactly its own update and its own max |w|, and a NaN in one tensor shows in that
    tensor's result only."""
    monkeypatch.setattr(cpu_library, "_LOWRANK_MIN_FLOPS_PER_THREAD", 1)  # split even these small ones
    shapes = [(3, 5), (40, 130), (1, 64), (17, 700), (9, 1)]
    for seed, threads in ((0, 2), (1, 3)):
        monkeypatch.setattr(torch, "get_num_threads", lambda n=threads: n)
        torch.manual_seed(seed)
        updates = [(torch.randn(s), torch.randn(s[0], 4), torch.randn(s[1], 4)) for s in shapes]
        alone = [(w.clone(), a, b) for w, a, b in updates]
        expected = [cpu_library.lowrank_update(w, a, b, 0.75) for w, a, b in alone]
        updates[3][0][16, 650] = math.nan  # the last row of a tensor that spans both threads' ranges
        got = cpu_library.lowrank_update_all(updates, 0.75)
        for index, ((w, _, _), (w_alone, _, _)) in enumerate(zip(updates, alone)):
            if index == 3:
                assert math.isnan(got[index])
                w[16, 650] = w_alone[16, 650]
            else:
                assert got[index] == expected[index]
            assert torch.equal(w, w_alone)
    assert cpu_library.lowrank_update_all([], 0.5) == []


@pytest.mark.parametrize("backend", ["cpu", "torch"])
def test_updating_many_tensors_is_updating_each(backend):
    """lowrank.update_all against lowrank.update tensor by tensor, bit for bit: fp32 weights (one
    compiled call on the CPU backend), a bf16 weight rounded stochastically, and a gradient buffer."""
    torch.manual_seed(3)
    shapes = [(33, 70), (5, 3), (64, 130)]
    params = [torch.randn(shapes[0]), torch.randn(shapes[1]).bfloat16(), torch.randn(shapes[2])]
    grads = [None, None, torch.zeros(shapes[2])]
    ids = [11, 12, 13]
    keys = [noise.member_key(7, 2, j) for j in range(3)]
    pairs = [[lowrank.factors(key, tid, p.shape, 2, "cpu") for key in keys] for tid, p in zip(ids, params)]
    every = lowrank.direction_factors(keys, ids, [p.shape for p in params], 2, "cpu")  # as `pairs`
    weights, options = [0.5, -1.0, 2.0], {"coef": 0.1, "decay": 0.9, "backend": backend}
    rounding = noise.rounding_key(7, 2)
    alone = [p.clone() for p in params]
    alone_grads = [None if g is None else g.clone() for g in grads]
    expected = [
        lowrank.update(p, tid, pair, weights, rounding_key=rounding, grad=g, rank=2, **options)
        for p, tid, pair, g in zip(alone, ids, pairs, alone_grads)
    ]
    got = lowrank.update_all(params, ids, every, weights, rounding_key=rounding, grads=grads, **options)
    assert got == expected
    assert got[0] is not None if backend == "cpu" else got[0] is None  # measured by the compiled pass
    for mine, theirs in zip([*params, grads[2]], [*alone, alone_grads[2]]):
        assert torch.equal(mine, theirs)


def test_a_generation_makes_its_low_rank_factors_once(tiny, monkeypatch):
    """Evaluation and the update of one generation share the directions' factors (made once, equal to
    the noise contract's, direction by direction), and the next generation makes its own."""
    model, _ = tiny
    es = fastes.ES(
        fastes.linear_weights(model), sigma=0.05, lr=0.01, population=4, noise_type="lowrank", seed=2
    )
    made = []
    direction_factors = lowrank.direction_factors
    monkeypatch.setattr(
        lowrank, "direction_factors", lambda keys, *rest: made.append(keys) or direction_factors(keys, *rest)
    )
    x = torch.randint(0, 10, (8, 5))
    for generation in range(2):
        with population_batched(es, model, mode="lowrank"):
            model(x)
        es.step(torch.randn(4, 2))
        assert made == [[noise.member_key(2, generation, j) for j in range(es.directions)]]
        made.clear()
    group = es.param_groups[0]
    every = list(range(len(group["params"])))
    kept = es.lowrank_directions(group, every)
    assert es.lowrank_directions(group, every) is kept and len(made) == 1
    shapes = [p.shape for p in group["params"]]
    for direction in range(es.directions):
        fresh = lowrank.all_factors(noise.member_key(2, 2, direction), group["ids"], shapes, es.rank, "cpu")
        for i, (a, b) in enumerate(fresh):
            mine_a, mine_b = kept.pair(direction, i)
            assert torch.equal(mine_a, a) and torch.equal(mine_b, b)


def test_modes_refuse_the_other_noise_type(tiny):
    model, _ = tiny
    full = fastes.ES(fastes.linear_weights(model), sigma=0.05, lr=0.01, population=2)
    with (
        pytest.raises(ValueError, match="needs ES\\(noise_type='lowrank'\\)"),
        population_batched(full, model, mode="lowrank"),
    ):
        pass
    low = fastes.ES(
        fastes.linear_weights(model),
        sigma=0.05,
        lr=0.01,
        population=2,
        noise_type="lowrank",
        backend="triton",
    )
    with pytest.raises(ValueError, match="full-rank noise"), population_batched(low, model, mode="virtual"):
        pass
    with pytest.raises(ValueError, match="noise_type: 'sparse' is not one of"):
        fastes.ES(fastes.linear_weights(model), sigma=0.05, lr=0.01, population=2, noise_type="sparse")


def test_low_rank_es_improves_a_toy_objective_and_replays_exactly():
    torch.manual_seed(0)
    layer = torch.nn.Linear(12, 10, bias=True)
    target = torch.randn(10, 12) * 0.3
    base = {k: v.clone() for k, v in layer.state_dict().items()}

    def reward() -> float:
        return -((layer.weight - target) ** 2).sum().item() - (layer.bias**2).sum().item()

    params = fastes.linear_weights(layer, include_biases=True)  # the bias keeps full-rank noise
    es = fastes.ES(params, sigma=0.05, lr=0.02, population=16, seed=5, noise_type="lowrank", rank=1)
    start = reward()
    for _ in range(40):
        es.step(reward)
    assert reward() > start + 0.2 * abs(start)
    trained = {k: v.clone() for k, v in layer.state_dict().items()}
    layer.load_state_dict(base)
    fastes.replay(fastes.linear_weights(layer, include_biases=True), es.state_dict())
    assert all(torch.equal(v, trained[k]) for k, v in layer.state_dict().items())


@pytest.mark.parametrize("rank", [1, 3])
def test_low_rank_layer_hands_its_input_factors_to_bmm_as_a_transposed_operand(rank):
    """The batched matmul's operand [members, in, r] is the transposed view of row-major [members, r, in]
    factors, before and after members leave: at rank 1 the strides of the size-1 dimension are free, and
    MKL's batched GEMM ran the other choice several times slower."""
    members, in_features = 5, 37
    factors = [(torch.randn(11, rank), torch.randn(in_features, rank)) for _ in range(members)]
    layer = LowRankLinear.from_factors(torch.nn.Linear(in_features, 11), factors, [1.0] * members)
    expected = torch.stack([b for _, b in factors])  # [members, in, r]

    def check(kept: list[int]) -> None:
        assert layer._inputs_t.stride() == (rank * in_features, 1, in_features)
        torch.testing.assert_close(layer._inputs_t, expected[kept], rtol=0, atol=0)

    check(list(range(members)))
    layer.keep_members([0, 2, 4])
    check([0, 2, 4])
