"""Population-batched evaluation: every member of a generation in one forward / generate call.

Inside `population_batched(es, model)`, each nn.Linear whose weight ES evolves is swapped for a
`PopulationLinear` holding all members' perturbed weights in one [members, out, in] buffer (built by the
perturb kernel, one launch per member), and the batch is read as `members` equal groups of rows: row r
belongs to member r // (batch / members). A batched matmul then applies every member's weights to its
own rows, so `generate` with its KV cache works unchanged. On exit the original modules are put back;
the base weights are never written, so nothing needs restoring.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

from . import ops
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


def _linear_owners(model: torch.nn.Module) -> dict[int, tuple[str, torch.nn.Linear]]:
    """id(weight) -> (module path, module) for every nn.Linear of the model."""
    return {id(m.weight): (name, m) for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)}


@contextmanager
def population_batched(es: ES, model: torch.nn.Module) -> Iterator[list[Member]]:
    """Swap the evolved linear layers of `model` for population-batched ones; yields the members.

    Feed the model `len(members) * b` rows, member i's rows being i * b ... (i + 1) * b - 1.
    """
    members = list(es.members())
    owners = _linear_owners(model)
    swapped: list[tuple[torch.nn.Module, str, torch.nn.Linear]] = []
    try:
        for group in es.param_groups:
            buffers = []
            for name, p in zip(group["names"], group["params"]):
                if id(p) not in owners:
                    raise ValueError(
                        f"batched evaluation evolves nn.Linear weights only; {name!r} is not one "
                        "(use eval_mode 'member' to evolve embeddings or norms)"
                    )
                buffers.append(torch.empty((len(members), *p.shape), dtype=p.dtype, device=p.device))
            for index, member in enumerate(members):
                ops.perturb(
                    group["params"],
                    [b[index] for b in buffers],
                    group["ids"],
                    member.key,
                    member.sign * group["sigma"],
                    backend=es.backend,
                )
            for p, buffer in zip(group["params"], buffers):
                path, linear = owners[id(p)]
                parent_path, _, attribute = path.rpartition(".")
                parent = model.get_submodule(parent_path)
                setattr(parent, attribute, PopulationLinear(linear, buffer))
                swapped.append((parent, attribute, linear))
        yield members
    finally:
        for parent, attribute, linear in swapped:
            setattr(parent, attribute, linear)
