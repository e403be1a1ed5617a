"""Population-batched evaluation: every member of a generation in one forward / generate call.

Inside `population_batched(es, model, mode)`, each nn.Linear whose weight ES evolves is swapped for a
population layer, and the batch is read as `members` equal groups of rows: row r belongs to member
r // (batch / members). `generate` with its KV cache works unchanged. Two modes:
- "materialised": `PopulationLinear` holds all members' perturbed weights in one [members, out, in]
  buffer (built by the perturb kernel) and applies them with a batched matmul. Any device.
- "virtual": `VirtualLinear` runs the Triton kernel that regenerates each member's noise tile in
  registers inside the matmul: no per-member weights exist, memory stays that of plain inference.
- "lowrank" (for ES(noise_type="lowrank")): `LowRankLinear` adds sigma (x B_m) A_m^T / sqrt(r) to
  x W^T; only the members' factors exist, (out + in) r numbers each.
On exit the original modules are put back; the base weights are never written, so nothing needs restoring.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

from . import lowrank, ops
from .es import ES, Member


class PopulationLinear(torch.nn.Module):
    """A linear layer with one weight per member; input rows are grouped by member."""

    def __init__(self, base: torch.nn.Linear, weights: torch.Tensor) -> None:
        super().__init__()
        self.base = base
        self.weights = weights  # [members, out, in]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        members = self.weights.shape[0]
        batch = x.shape[0]
        if batch % members:
            raise ValueError(
                f"population-batched input must have a multiple of {members} rows (rows grouped "
                f"by member), got {batch}"
            )
        grouped = x.reshape(members, -1, x.shape[-1])  # [members, rows * positions, in]
        y = torch.bmm(grouped, self.weights.transpose(1, 2))
        if self.base.bias is not None:
            y = y + self.base.bias
        return y.reshape(*x.shape[:-1], self.weights.shape[1])


class PopulationEmbedding(torch.nn.Module):
    """An embedding with one table per member; rows of input ids are grouped by member."""

    def __init__(self, base: torch.nn.Embedding, weights: torch.Tensor) -> None:
        super().__init__()
        self.base = base
        self.weights = weights  # [members, vocab, dim]

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        members = self.weights.shape[0]
        if ids.shape[0] % members:
            raise ValueError(
                f"population-batched input must have a multiple of {members} rows (rows grouped "
                f"by member), got {ids.shape[0]}"
            )
        grouped = ids.reshape(members, -1, *ids.shape[1:])
        index = torch.arange(members, device=ids.device).view(members, *[1] * (grouped.dim() - 1))
        return self.weights[index, grouped].reshape(*ids.shape, self.weights.shape[-1])


class PopulationNorm(torch.nn.Module):
    """A norm layer (any module scaling by a `weight`) with one weight per member, rows grouped by member.

    Each member's rows go through the original module with that member's weight (torch.func), so any
    norm implementation works unchanged.
    """

    def __init__(self, base: torch.nn.Module, weights: torch.Tensor) -> None:
        super().__init__()
        self.base = base
        self.weights = weights  # [members, *weight shape]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        members = self.weights.shape[0]
        if x.shape[0] % members:
            raise ValueError(
                f"population-batched input must have a multiple of {members} rows (rows grouped "
                f"by member), got {x.shape[0]}"
            )
        grouped = x.reshape(members, -1, *x.shape[1:])
        outputs = [
            torch.func.functional_call(self.base, {"weight": self.weights[m]}, (grouped[m],))
            for m in range(members)
        ]
        return torch.cat(outputs)


class VirtualLinear(torch.nn.Module):
    """A linear layer whose members' weights W + scale_m * eps_m exist only inside the kernel."""

    def __init__(
        self, base: torch.nn.Linear, tensor_id: int, keys: torch.Tensor, scales: torch.Tensor
    ) -> None:
        super().__init__()
        self.base = base
        self.tensor_id = tensor_id
        self.keys = keys  # int64 [members, 2]
        self.scales = scales  # fp32 [members]: sign * sigma

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from .kernels import launch_virtual_linear

        members = self.keys.shape[0]
        weight = self.base.weight
        flat = x.reshape(-1, x.shape[-1]).contiguous()
        if flat.shape[0] % members:
            raise ValueError(
                f"population-batched input must have a multiple of {members} rows (rows grouped "
                f"by member), got {x.shape[0]}"
            )
        y = torch.empty(flat.shape[0], weight.shape[0], dtype=weight.dtype, device=weight.device)
        launch_virtual_linear(
            flat.to(weight.dtype),
            weight,
            y,
            self.keys,
            self.scales,
            self.tensor_id,
            flat.shape[0] // members,
            ops.triton_dtype(weight.dtype),
        )
        if self.base.bias is not None:
            y = y + self.base.bias
        return y.reshape(*x.shape[:-1], weight.shape[0])


class LowRankLinear(torch.nn.Module):
    """y_m = x_m W^T + scale_m / sqrt(r) * (x_m B_m) A_m^T: the members' rank-r noise is never formed."""

    def __init__(
        self, base: torch.nn.Linear, factors: list[tuple[torch.Tensor, torch.Tensor]], scales: list[float]
    ) -> None:
        super().__init__()
        self.base = base
        rank = factors[0][0].shape[1]
        dtype = base.weight.dtype
        self.a = torch.stack([a for a, _ in factors]).to(dtype)  # [members, out, r]
        self.b = torch.stack([b for _, b in factors]).to(dtype)  # [members, in, r]
        self.scales = (torch.tensor(scales) / rank**0.5).to(device=base.weight.device, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        members = self.a.shape[0]
        if x.shape[0] % members:
            raise ValueError(
                f"population-batched input must have a multiple of {members} rows (rows grouped "
                f"by member), got {x.shape[0]}"
            )
        grouped = x.reshape(members, -1, x.shape[-1])
        low = torch.bmm(torch.bmm(grouped, self.b), self.a.transpose(1, 2)) * self.scales[:, None, None]
        return (self.base(grouped) + low).reshape(*x.shape[:-1], self.a.shape[1])


def _owners(model: torch.nn.Module) -> dict[int, list[tuple[str, torch.nn.Module]]]:
    """id(weight) -> every (module path, module) whose `weight` it is (a tied embedding has two)."""
    owners: dict[int, list[tuple[str, torch.nn.Module]]] = {}
    for name, module in model.named_modules(remove_duplicate=False):
        weight = getattr(module, "weight", None)
        if isinstance(weight, torch.nn.Parameter):
            owners.setdefault(id(weight), []).append((name, module))
    return owners


def _population_module(module: torch.nn.Module, buffer: torch.Tensor) -> torch.nn.Module:
    """The materialised population version of `module` whose weight the members' `buffer` replaces."""
    if isinstance(module, torch.nn.Linear):
        return PopulationLinear(module, buffer)
    if isinstance(module, torch.nn.Embedding):
        return PopulationEmbedding(module, buffer)
    return PopulationNorm(module, buffer)


MODES = ("materialised", "virtual", "lowrank")


def _check_owners(name: str, owners: list[tuple[str, torch.nn.Module]], mode: str) -> None:
    """Refuse a tensor that the batched evaluation of `mode` cannot swap in."""
    kinds = [type(module).__name__ for _, module in owners]
    linear_only = mode != "materialised"
    if not owners or (linear_only and (len(owners) > 1 or not isinstance(owners[0][1], torch.nn.Linear))):
        what = "nn.Linear weights only" if linear_only else "nn.Linear, nn.Embedding and norm weights"
        raise ValueError(
            f"batched evaluation ({mode}) evolves {what}; {name!r} is the weight of "
            f"{', '.join(kinds) or 'no module'} (use eval_mode 'member', or 'materialised' for embeddings "
            "and norms)"
        )
    for _, module in owners:
        known = (
            isinstance(module, (torch.nn.Linear, torch.nn.Embedding))
            or "norm" in type(module).__name__.lower()
        )
        if not known:
            raise ValueError(
                f"batched evaluation evolves nn.Linear, nn.Embedding and norm weights; {name!r} is the "
                f"weight of a {type(module).__name__} (use eval_mode 'member')"
            )


def _population_layers(es: ES, group: dict, members: list[Member], linears: list, mode: str) -> list:
    """One population layer per evolved weight of `group` in the virtual and lowrank modes; `linears`
    are the weights' nn.Linear modules."""
    if mode == "virtual":
        if es.noise_type != "full":
            raise ValueError("eval mode 'virtual' generates full-rank noise; use 'lowrank' or 'materialised'")
        device = group["params"][0].device
        if ops.resolve_backend(group["params"], es.backend) != "triton":
            raise ValueError(
                "eval mode 'virtual' runs a Triton kernel: it needs CUDA tensors (or TRITON_INTERPRET=1 "
                "with backend='triton'); use 'materialised' on CPU"
            )
        keys = torch.tensor([m.key for m in members], dtype=torch.int64, device=device)
        scales = torch.tensor([m.sign * group["sigma"] for m in members], dtype=torch.float32, device=device)
        return [VirtualLinear(linear, tid, keys, scales) for linear, tid in zip(linears, group["ids"])]
    if mode == "lowrank":
        if es.noise_type != "lowrank":
            raise ValueError("eval mode 'lowrank' needs ES(noise_type='lowrank')")
        scales = [m.sign * group["sigma"] for m in members]
        return [
            LowRankLinear(
                linear,
                [
                    lowrank.factors(m.key, tid, linear.weight.shape, es.rank, linear.weight.device)
                    for m in members
                ],
                scales,
            )
            for linear, tid in zip(linears, group["ids"])
        ]
    raise ValueError(f"unknown batched mode {mode!r}")


def _materialised_buffers(es: ES, group: dict, members: list[Member]) -> list[torch.Tensor]:
    """Every member's perturbed copy of each tensor of `group`: [members, *shape] per tensor."""
    buffers = [torch.empty((len(members), *p.shape), dtype=p.dtype, device=p.device) for p in group["params"]]
    for index, member in enumerate(members):
        es.perturb_into(group, [b[index] for b in buffers], member)
    return buffers


def _swaps(es: ES, group: dict, members: list[Member], owners: dict, mode: str) -> list:
    """(module path, original module, population module) for every module using a tensor of `group`."""
    for name, p in zip(group["names"], group["params"]):
        _check_owners(name, owners.get(id(p), []), mode)
    if mode != "materialised":
        linears = [owners[id(p)][0] for p in group["params"]]
        layers = _population_layers(es, group, members, [linear for _, linear in linears], mode)
        return [(path, linear, layer) for (path, linear), layer in zip(linears, layers)]
    buffers = _materialised_buffers(es, group, members)
    return [
        (path, module, _population_module(module, buffer))
        for p, buffer in zip(group["params"], buffers)
        for path, module in owners[id(p)]
    ]


@contextmanager
def population_batched(es: ES, model: torch.nn.Module, mode: str = "materialised") -> Iterator[list[Member]]:
    """Swap the modules whose weights ES evolves for population-batched ones; yields the members.

    Feed the model `len(members) * b` rows, member i's rows being i * b ... (i + 1) * b - 1. The
    materialised mode swaps nn.Linear, nn.Embedding and norm layers (a tied embedding in both places),
    the virtual and lowrank modes nn.Linear layers only.
    """
    if mode not in MODES:
        raise ValueError(f"unknown batched mode {mode!r}; choose one of {MODES}")
    members = list(es.members())
    owners = _owners(model)
    swapped: list[tuple[torch.nn.Module, str, torch.nn.Module]] = []
    try:
        for group in es.param_groups:
            for path, module, layer in _swaps(es, group, members, owners, mode):
                parent_path, _, attribute = path.rpartition(".")
                parent = model.get_submodule(parent_path)
                setattr(parent, attribute, layer)
                swapped.append((parent, attribute, module))
        yield members
    finally:
        for parent, attribute, module in reversed(swapped):
            setattr(parent, attribute, module)
