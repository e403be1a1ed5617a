"""Virtual-noise population linear (Triton, interpreted): equals the materialised per-member weights."""

import pytest
import torch
from conftest import NOISE_KINDS, kernel_llama

import fastes
from fastes.engine import noise, ops
from fastes.engine.kernels import launch_virtual_linear
from fastes.es.population import PopulationLinear, VirtualLinear, population_batched

TOLERANCE = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (2e-2, 2e-2), torch.float16: (2e-3, 2e-3)}


def reference(x, weight, keys, scales, tensor_id, rows, noise_kind="gaussian", transposed=False):
    """Member m's rows times its materialised perturbed weight (the perturb reference), fp32 accumulate.
    A transposed (Conv1D) weight is [in, out] and y = x W."""
    out = []
    for m, (key, scale) in enumerate(zip(keys, scales)):
        w = torch.empty_like(weight)
        ops.perturb_reference([weight], [w], [tensor_id], key, scale, noise_kind)
        out.append(x[m * rows : (m + 1) * rows].float() @ (w.float() if transposed else w.float().T))
    return torch.cat(out)


def check_kernel(noise_kind, dtype, members, rows, n_in, n_out, transposed=False):
    """The interpreted kernel against the materialised reference. The matmul accumulates in another order
    than the reference, so sign noise too is compared to a tolerance here."""
    gen = torch.Generator().manual_seed(members * 100 + n_in)
    x = torch.randn(members * rows, n_in, generator=gen).to(dtype)
    shape = (n_in, n_out) if transposed else (n_out, n_in)
    weight = (torch.randn(shape, generator=gen) * 0.1).to(dtype)
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
        transposed=transposed,
        noise=noise_kind,
    )
    expected = reference(x, weight, keys, scales, tid, rows, noise_kind, transposed)
    rtol, atol = TOLERANCE[dtype]
    torch.testing.assert_close(y.float(), expected, rtol=rtol, atol=atol)
    # The noise really is there: without it the outputs would be visibly different.
    if n_in > 1:
        plain = x.float() @ (weight.float() if transposed else weight.float().T)
        assert (plain - expected).abs().max() > 10 * atol


@pytest.mark.parametrize("noise_kind", NOISE_KINDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    "members,rows,n_in,n_out",
    # n_in = 64: each row's signs are whole Philox words (the word path); 40 and 1: per element.
    [(3, 5, 64, 33), (2, 17, 40, 16), (1, 1, 1, 1)],
)
def test_kernel_matches_materialised_weights(noise_kind, dtype, members, rows, n_in, n_out):
    check_kernel(noise_kind, dtype, members, rows, n_in, n_out)


@pytest.mark.parametrize("noise_kind", NOISE_KINDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("members,rows,n_in,n_out", [(3, 5, 7, 33), (2, 4, 40, 16)])
def test_kernel_with_a_transposed_conv1d_weight(noise_kind, dtype, members, rows, n_in, n_out):
    """A Conv1D weight [in, out]: its noise follows its own row-major layout (index k N + n) and y = x W."""
    check_kernel(noise_kind, dtype, members, rows, n_in, n_out, transposed=True)


@pytest.fixture(scope="module")
def tiny():
    """A smaller Llama than the built-in one: interpreted kernels run every linear layer as Python."""
    return kernel_llama()


@torch.no_grad()
def test_virtual_mode_logits_equal_materialised_on_the_tiny_model(tiny):
    model, tokenizer = tiny
    es = fastes.ES(fastes.linear_weights(model), sigma=0.05, lr=0.01, population=2, seed=1, backend="triton")
    batch = tokenizer(["cd 2 4 8 > 24:", "rev 123:"], return_tensors="pt", padding=True)
    grouped = {k: v.repeat(es.population, 1) for k, v in batch.items()}
    with population_batched(es, model, mode="materialised"):
        expected = model(**grouped).logits
    with population_batched(es, model, mode="virtual"):
        layers = [m for m in model.modules() if isinstance(m, VirtualLinear)]
        assert len(layers) == len(fastes.linear_weights(model))
        got = model(**grouped).logits
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)


def test_virtual_mode_holds_no_per_member_weights(tiny):
    model, _ = tiny
    params = fastes.linear_weights(model)
    es = fastes.ES(params, sigma=0.05, lr=0.01, population=8, backend="triton")
    weight_bytes = sum(p.numel() * p.element_size() for _, p in fastes.linear_weights(model))

    def held_bytes(kind) -> int:
        total = 0
        for module in model.modules():
            if isinstance(module, kind):
                own = [module.weights] if kind is PopulationLinear else [module.keys, module.scales]
                total += sum(t.numel() * t.element_size() for t in own)
        return total

    same_members_on_cpu = fastes.ES(params, sigma=0.05, lr=0.01, population=8, backend="torch")
    with population_batched(same_members_on_cpu, model, mode="materialised"):
        materialised = held_bytes(PopulationLinear)
    with population_batched(es, model, mode="virtual"):
        virtual = held_bytes(VirtualLinear)
    assert materialised == 8 * weight_bytes
    # Keys and scales only: 2 int64 words + one fp32 per member per layer, whatever the layer's size.
    assert virtual == len(params) * 8 * (2 * 8 + 4)
    assert virtual < weight_bytes / 30


def test_virtual_mode_needs_the_triton_backend(tiny):
    model, _ = tiny
    es = fastes.ES(fastes.linear_weights(model), sigma=0.05, lr=0.01, population=2, backend="torch")
    with pytest.raises(ValueError, match="needs CUDA tensors"), population_batched(es, model, mode="virtual"):
        pass
    with (
        pytest.raises(ValueError, match="unknown batched mode"),
        population_batched(es, model, mode="sparse"),
    ):
        pass
