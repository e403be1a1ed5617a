"""The low-rank population linear layer (its products kernel, then its GEMM; interpreted) against plain
torch."""

import pytest
import torch
from conftest import kernel_llama

import fastes
from fastes.engine import ops
from fastes.engine.kernels import launch_lowrank_linear, launch_lowrank_products, lowrank_linear
from fastes.es.population import LowRankLinear, population_batched

# The kernel rounds y once; the reference rounds only at the end too, so 16-bit differences are the
# summation order and that one rounding, relative to the largest output.
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 2e-3}


def reference(x, weight, bias, inputs, outputs, transposed=False):
    """x W^T + bias + sum_i (x_m . inputs[m, i]) outputs[m, i] for member m's rows, in float64."""
    w = weight.double() if transposed else weight.double().T
    y = x.double() @ w + (0 if bias is None else bias.double())
    products = reference_products(x, inputs)  # [members, R, r]
    return y + (products @ outputs.double()).reshape(y.shape)


def reference_products(x, inputs):
    """x_m . inputs[m, i] for member m's rows, [members, R, r] in float64."""
    grouped = x.double().reshape(inputs.shape[0], -1, x.shape[-1])
    return grouped @ inputs.double().transpose(1, 2)


def check(dtype, members, rows, n_in, n_out, rank, seed, first, transposed=False, with_bias=True, **blocks):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(members * rows, n_in, generator=gen).to(dtype)
    weight = (0.1 * torch.randn((n_in, n_out) if transposed else (n_out, n_in), generator=gen)).to(dtype)
    bias = torch.randn(n_out, generator=gen).to(dtype) if with_bias else None
    inputs = torch.randn(members, rank, n_in, generator=gen).to(dtype)
    outputs = (0.05 * torch.randn(members, rank, n_out, generator=gen)).to(dtype)
    y = torch.full((members * rows, n_out), float("nan"), dtype=dtype)
    launch_lowrank_linear(
        x, weight, bias, inputs, outputs, y, ops.triton_dtype(dtype), transposed, first=first, **blocks
    )
    expected = reference(x, weight, bias, inputs, outputs, transposed)
    scale = float(expected.abs().max())
    torch.testing.assert_close(y.double(), expected, rtol=TOLERANCE[dtype], atol=TOLERANCE[dtype] * scale)
    # The rank term is really there: without it the outputs would be visibly different.
    plain = reference(x, weight, bias, inputs, torch.zeros_like(outputs), transposed)
    assert (plain - expected).abs().max() > 10 * TOLERANCE[dtype] * scale


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("rank", [1, 2, 4])
@pytest.mark.parametrize("first", [False, True], ids=["products-in-gemm", "products-first"])
def test_kernel_matches_the_reference(dtype, rank, first):
    # Odd sizes: 37 inputs (two K tiles, the second masked), 53 outputs, 3 rows per member (a 16-row
    # tile holds parts of 6 members), with and without a bias, three seeds.
    for seed in range(3):
        check(
            dtype,
            members=5,
            rows=3,
            n_in=37,
            n_out=53,
            rank=rank,
            seed=seed,
            first=first,
            with_bias=seed != 1,
        )


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("members,rows,n_in,rank", [(5, 3, 37, 3), (2, 9, 300, 1), (1, 1, 1, 2)])
def test_products_kernel_matches_the_reference(dtype, members, rows, n_in, rank):
    # 3 rows per member straddle the 4-row programs; 300 inputs take two K steps (the second masked);
    # rank 3 is stored in a block of 4.
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(members * rows, n_in, generator=gen).to(dtype)
    inputs = torch.randn(members, rank, n_in, generator=gen).to(dtype)
    products = torch.full((members * rows, rank), float("nan"))
    launch_lowrank_products(x, inputs, products)
    expected = reference_products(x, inputs).reshape(products.shape)
    # fp32 sums of exact 16-bit products: only the summation order differs.
    torch.testing.assert_close(products.double(), expected, rtol=1e-5, atol=1e-5 * n_in**0.5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("first", [False, True], ids=["products-in-gemm", "products-first"])
def test_kernel_with_a_transposed_conv1d_weight(dtype, first):
    check(dtype, members=3, rows=2, n_in=21, n_out=40, rank=2, seed=4, first=first, transposed=True)


@pytest.mark.parametrize(
    "members,rows,n_in,n_out,rank,blocks",
    [
        (1, 1, 1, 1, 1, {}),  # one element
        (2, 40, 9, 70, 3, {}),  # 64-row tiles, a member across two of them; rank 3 in a block of 4
        (3, 7, 50, 33, 2, {"block_m": 16, "block_n": 16, "block_k": 16}),  # several tiles each way
    ],
)
@pytest.mark.parametrize("first", [False, True], ids=["products-in-gemm", "products-first"])
def test_kernel_over_tile_edges(members, rows, n_in, n_out, rank, blocks, first):
    check(torch.float32, members, rows, n_in, n_out, rank, seed=members, first=first, **blocks)


def test_products_run_first_for_wide_outputs_only():
    # Rank x column tiles against the threshold: Qwen2.5-1.5B's q (1536 outputs) keeps its products in
    # the GEMM, its gate (8960) computes them first; rank 2 doubles the recomputation.
    assert not lowrank_linear.products_first(1, 1536) and lowrank_linear.products_first(1, 8960)
    assert lowrank_linear.products_first(2, 1024) and not lowrank_linear.products_first(2, 960)


@pytest.fixture(params=[False, True], ids=["products-in-gemm", "products-first"])
def products_first(request, monkeypatch):
    """Both ways of the layer's products: a threshold of 0 column tiles sends every layer first."""
    if request.param:
        monkeypatch.setattr(lowrank_linear, "PRODUCTS_FIRST_TILES", 0)
    return request.param


@torch.no_grad()
@pytest.mark.parametrize("conv1d", [False, True])
def test_layer_on_the_triton_backend_equals_its_torch_fallback(conv1d, products_first):
    """LowRankLinear with the kernel against its own torch path; a Conv1D's weight is [in, out] and its
    factors swap roles (the layer maps them, the kernel only reads the weight transposed)."""
    from transformers.pytorch_utils import Conv1D

    torch.manual_seed(5)
    members, rows, n_in, n_out, rank = 3, 4, 19, 27, 2
    base = Conv1D(n_out, n_in) if conv1d else torch.nn.Linear(n_in, n_out)
    torch.nn.init.normal_(base.bias)
    shape = (n_in, n_out) if conv1d else (n_out, n_in)  # eps = A B^T has the weight's shape
    factors = [(torch.randn(shape[0], rank), torch.randn(shape[1], rank)) for _ in range(members)]
    scales = [0.5, -0.5, 0.25]
    x = torch.randn(members * rows, 2, n_in)
    fused = LowRankLinear.from_factors(base, factors, scales, conv1d, backend="triton")
    fallback = LowRankLinear.from_factors(base, factors, scales, conv1d, backend="torch")
    assert fused.fused and not fallback.fused
    torch.testing.assert_close(fused(x), fallback(x), rtol=1e-5, atol=1e-5)


@pytest.fixture(scope="module")
def tiny():
    """A small Llama with biased attention projections: interpreted kernels run each layer as Python."""
    return kernel_llama(intermediate_size=48, attention_bias=True)


@torch.no_grad()
def test_lowrank_mode_logits_with_the_kernel_equal_the_torch_fallback(tiny, products_first):
    model, tokenizer = tiny
    batch = tokenizer(["cd 2 4 8 > 24:", "rev 123:"], return_tensors="pt", padding=True)
    logits = {}
    for backend in ("triton", "torch"):
        es = fastes.ES(
            fastes.linear_weights(model), sigma=0.05, lr=0.01, population=4, seed=3,
            noise_type="lowrank", rank=2, backend=backend,
        )  # fmt: skip
        grouped = {k: v.repeat(es.population, 1) for k, v in batch.items()}
        with population_batched(es, model, mode="lowrank"):
            layers = [m for m in model.modules() if isinstance(m, LowRankLinear)]
            assert layers and all(layer.fused == (backend == "triton") for layer in layers)
            logits[backend] = model(**grouped).logits
    torch.testing.assert_close(logits["triton"], logits["torch"], rtol=1e-4, atol=1e-4)
    # The members differ: the rank term reaches the logits.
    members = logits["triton"].reshape(4, -1, *logits["triton"].shape[1:])
    assert (members[0] - members[1]).abs().max() > 1e-2
