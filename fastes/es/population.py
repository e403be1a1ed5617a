"""Population-batched evaluation: every member of a generation in one forward / generate call.

Inside `population_batched(es, model, mode)`, each projection (nn.Linear, or transformers' Conv1D with
its [in, out] weight) whose weight ES evolves is swapped for a population layer, and the batch is read
as `members` equal groups of rows: row r belongs to member r // (batch / members). `generate` with its
KV cache works unchanged. Three modes:
- "materialised": `PopulationLinear` holds all members' perturbed weights in one [members, in, out]
  buffer (built by the perturb kernel) and applies them with a batched matmul (on the CPU in fp32, the
  compiled backend's, which also takes the members' rows in groups of any size). Any device.
- "virtual": `VirtualLinear` runs the Triton kernel that regenerates each member's noise tile in
  registers inside the matmul: no per-member weights exist, memory stays that of plain inference.
- "lowrank" (for ES(noise_type="lowrank")): `LowRankLinear` adds sigma (x B_m) A_m^T / sqrt(r) to
  x W^T; only the members' factors exist, (out + in) r numbers each.
On exit the original modules are put back; the base weights are never written, so nothing needs restoring.
"""

from __future__ import annotations

import functools
import itertools
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from typing import NamedTuple

import torch

from fastes.engine import cpu_library, cpu_linear, lowrank, ops

from .optimizer import ES, Member
from .params import Projection, projections


class _PopulationLayer(torch.nn.Module):
    """What the population layers share: the projection they stand in for, `base`, and how they read the
    batch's rows as the members' groups."""

    base: torch.nn.Module
    compiled = False  # whether the layer's product is the compiled CPU backend's (it takes unequal groups)

    def __init__(self) -> None:
        super().__init__()
        self._member_rows: list[int] | None = None  # set_member_rows (where taken); None: equal groups
        self._offsets, self._offsets_for = None, -1  # _row_offsets' last answer, and its row count

    def __setattr__(self, name: str, value: object) -> None:
        # A population's layers are built at every ES iteration, each setting some twenty plain attributes
        # (tensors, flags): nn.Module's __setattr__ checks each against the parameters, buffers and
        # submodules, ~2 us a call, a fifth of building a tiny model's low-rank layer. Only modules and
        # parameters (the base projection) need it; the layers register no buffers. A plain tensor is
        # told by its exact type: isinstance against Parameter runs its metaclass check (0.29 vs 0.09 us).
        if isinstance(value, torch.nn.Module) or (
            isinstance(value, torch.Tensor) and type(value) is not torch.Tensor
        ):
            super().__setattr__(name, value)
        else:
            object.__setattr__(self, name, value)

    @property
    def weight(self) -> torch.Tensor:
        """The base projection's weight, for code around the layer that reads it (a PEFT LoRA layer casts
        its input to lora_A.weight's dtype)."""
        return self.base.weight

    @property
    def population_members(self) -> int:
        """How many members' row groups the layer reads its input as."""
        raise NotImplementedError

    def keep_members(self, positions: list[int]) -> None:
        """Go on with the members at `positions` (ascending, among the current ones) only: the others'
        rows have left the batch (fastes.models.decoding, which finds the layers by these two names)."""
        raise NotImplementedError

    @property
    def takes_unequal_groups(self) -> bool:
        """Whether the members' row groups may differ in size (`set_member_rows`): then decoding lets every
        finished row leave, as plain generation does, not only whole groups and columns. The compiled
        CPU products take each member's rows where they start (`_row_offsets`)."""
        return self.compiled

    def set_member_rows(self, counts: list[int] | None) -> None:
        """Read the batch as counts[m] rows of member m, in member order (members with none included), or
        as equal groups again (None). Decoding sets it as finished rows leave (fastes.models.decoding)."""
        if counts is not None and (not self.compiled or len(counts) != self.population_members):
            raise ValueError(
                "set_member_rows needs the compiled CPU products and one count per member "
                f"({self.population_members}), got {None if counts is None else len(counts)}"
            )
        self._member_rows, self._offsets_for = counts, -1

    def _check_rows(self, rows: int) -> None:
        """Refuse a batch that is not the members' groups: equal ones, or those set_member_rows gave."""
        members = self.population_members
        if self._member_rows is None and rows % members:
            raise ValueError(
                f"population-batched input must have a multiple of {members} rows (rows grouped "
                f"by member), got {rows}"
            )
        if self._member_rows is not None and rows != sum(self._member_rows):
            raise ValueError(f"the batch has {rows} rows, but set_member_rows gave {sum(self._member_rows)}")

    def _row_offsets(self, rows: int) -> torch.Tensor:
        """Where each member's rows of the flattened input [rows, in] start, and the end, for the compiled
        CPU products. Every layer asks at every decode step, so the answer is kept while the rows stay the
        same (keep_members and set_member_rows forget it), and the layers share one tensor per grouping
        (`_offsets_of`)."""
        if self._offsets_for != rows:
            counts = tuple(self._member_rows or [1] * self.population_members)
            per_count = rows // sum(counts)  # an equal group's rows, or a batch row's positions
            self._offsets, self._offsets_for = _offsets_of(counts, per_count), rows
        return self._offsets


@functools.lru_cache(maxsize=256)
def _offsets_of(counts: tuple[int, ...], per_count: int) -> torch.Tensor:
    """[0, per_count * counts[0], ...]: where each member's rows start, made once for all the layers
    (each asks whenever rows leave the batch; a tensor made in every layer cost a tiny model's population
    generation ~2%: docs/results/population-overheads-2026-12-06.md). The C products only read it."""
    return torch.tensor([0, *itertools.accumulate(c * per_count for c in counts)])


class PopulationLinear(_PopulationLayer):
    """A projection with one weight per member; input rows are grouped by member.

    The members' weights are held [members, in, out] whatever the projection's own layout: torch's CPU
    batched matmul takes a contiguous right-hand side 1.3-1.55x faster than a transposed view at decode
    sizes (32 rows a member), with the same result bit for bit (docs/benchmarks.md), and the compiled
    CPU backend's matmul reads that layout as it lies. `_materialised` writes them so; weights given in
    another layout are copied into it.

    With the compiled CPU backend (fp32 on the CPU), where it measures faster than torch's batched matmul
    on this machine (`cpu_linear.products`: on an AMD EPYC, not on an Intel Xeon), the product is
    `cpu_library.member_matmul`: it skips the packing of each member's weights that made torch's batched
    matmul slower than the plain model's GEMM while decoding there (fastes/engine/csrc/member_matmul_cpu.c),
    and it takes the members' rows in groups of any size (`set_member_rows`). Otherwise torch.bmm, on
    equal groups.
    """

    def __init__(
        self, base: torch.nn.Module, weights: torch.Tensor, transposed: bool = False, backend: str = "auto"
    ) -> None:
        super().__init__()
        self.base = base
        # `weights` has the projection's own shape: [members, out, in] for nn.Linear (a transposed view
        # of contiguous [members, in, out] memory costs no copy here), [members, in, out] for a Conv1D
        self.weights = (weights if transposed else weights.transpose(1, 2)).contiguous()
        self.transposed = transposed
        compiled = ops.resolve_backend([self.weights], backend) == "cpu"
        self.compiled = (
            compiled
            and self.weights.dtype == torch.float32  # the library's matmul is fp32
            and cpu_linear.products(torch.get_num_threads()).member_matmul
        )
        self._product = cpu_library.MemberMatmul(self.weights, base.bias) if self.compiled else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        members = self.weights.shape[0]
        self._check_rows(x.shape[0])
        if self._product is not None:
            return self._product(x, self._row_offsets(x.numel() // x.shape[-1]))
        grouped = x.reshape(members, -1, x.shape[-1])  # [members, rows * positions, in]
        y = torch.bmm(grouped, self.weights)
        if self.base.bias is not None:
            y = y + self.base.bias
        return y.reshape(*x.shape[:-1], y.shape[-1])

    @property
    def population_members(self) -> int:
        return self.weights.shape[0]

    def keep_members(self, positions: list[int]) -> None:
        # moved down within the buffer: a copy of the kept members' weights would raise the peak memory
        for new, old in enumerate(positions):
            if new != old:
                self.weights[new].copy_(self.weights[old])
        self.weights = self.weights[: len(positions)]
        if self._product is not None:
            self._product = cpu_library.MemberMatmul(self.weights, self.base.bias)
        self._offsets_for = -1


class VirtualLinear(_PopulationLayer):
    """A linear layer whose members' weights W + scale_m * eps_m exist only inside the kernel."""

    def __init__(
        self,
        base: torch.nn.Module,
        tensor_id: int,
        keys: torch.Tensor,
        scales: torch.Tensor,
        transposed: bool = False,
        noise: str = "gaussian",
    ) -> None:
        super().__init__()
        self.base = base
        self.tensor_id = tensor_id
        self.keys = keys  # int64 [members, 2]
        self.scales = scales  # fp32 [members]: sign * sigma
        self.noise = noise  # the distribution of eps: "gaussian" or "rademacher"
        self.transposed = transposed  # Conv1D: the weight (and its noise) is laid out [in, out]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from fastes.engine.kernels import launch_virtual_linear

        members = self.keys.shape[0]
        weight = self.base.weight
        flat = x.reshape(-1, x.shape[-1]).contiguous()
        if flat.shape[0] % members:
            raise ValueError(
                f"population-batched input must have a multiple of {members} rows (rows grouped "
                f"by member), got {x.shape[0]}"
            )
        out_features = weight.shape[1 if self.transposed else 0]
        y = torch.empty(flat.shape[0], out_features, dtype=weight.dtype, device=weight.device)
        launch_virtual_linear(
            flat.to(weight.dtype),
            weight,
            y,
            self.keys,
            self.scales,
            self.tensor_id,
            flat.shape[0] // members,
            ops.triton_dtype(weight.dtype),
            transposed=self.transposed,
            noise=self.noise,
        )
        if self.base.bias is not None:
            y = y + self.base.bias
        return y.reshape(*x.shape[:-1], out_features)

    @property
    def population_members(self) -> int:
        return self.keys.shape[0]

    def keep_members(self, positions: list[int]) -> None:
        index = torch.tensor(positions, device=self.keys.device)
        self.keys, self.scales = self.keys[index], self.scales[index]


class LowRankLinear(_PopulationLayer):
    """y_m = x_m W^T + scale_m / sqrt(r) * (x_m B_m) A_m^T: the members' rank-r noise is never stored.

    With the Triton backend (CUDA tensors) one GEMM (fastes/engine/kernels/lowrank_linear.py) adds each
    row's r products with its member's input factors times the output factors in its epilogue and writes
    y once; the products are summed in its K loop, or, for wide outputs, first by a launch that reads x
    once (`products_first`). On the CPU with the compiled backend (fp32) and a plain nn.Linear base,
    `cpu_linear.linear` computes the layer as it computes a plain one while decoding (the product this
    machine runs fastest for the rows: the few-rows linear, the packed linear at a prefill's many rows, or
    torch's `linear`), with the term: the library's products add it to each output before it is stored
    (added after the GEMM, it was one more pass over an output that lies in memory, ~3% of a SmolLM2
    generation: docs/results/packed-linear-2026-12-06.md), `cpu_library.lowrank_term` after torch's
    product in one pass per row. Another base runs its own forward, then lowrank_term. All of these take
    the members' rows in groups of any size (`set_member_rows`), so decoding lets every finished row
    leave as in plain generation. Otherwise (other dtypes, backend "torch") the base projection runs once
    on all rows, a batched matmul gives each row's r products with its member's input factors, and one
    broadcast multiply-add per rank adds products x output factors into the output in place. Layers that
    read the same input (q, k and v) could share one product: tried on 2026-12-05, one batched matmul
    for them was 3x faster alone and no faster in the model. The output side is stored pre-scaled.

    A layer too small for the library's products (whose weight stays in the caches; else torch's `linear`,
    then the term's pass) runs the library's member matmul where that measured faster on this machine
    (`cpu_linear.products().lowrank_member_matmul`), with the members' factors: member m's weight is W +
    scale_m / sqrt(r) A_m B_m^T, its term added to its rows' sums before they are stored (or, for a member
    with many rows, its weight formed once: csrc/member_matmul_cpu.c). At a tiny model's sizes the term's
    pass over every output after torch's product cost more than the product saved
    (docs/results/tiny-lowrank-2026-12-07.md).

    The factors follow the weight's own layout (eps = A B^T has the weight's shape): for a Conv1D weight
    [in, out], A is the input side and B the output side, so the roles swap.
    """

    def __init__(
        self,
        base: torch.nn.Module,
        sides: tuple[torch.Tensor, torch.Tensor],
        transposed: bool = False,
        backend: str = "auto",
    ) -> None:
        """`sides`: the members' (inputs [members, r, in], outputs [members, r, out]) fp32 factors, each
        member's scale / sqrt(r) folded into its outputs (`lowrank.DirectionFactors.member_sides`); held,
        not copied, where they are row-major and of the weight's dtype."""
        super().__init__()
        self.base = base
        weight = base.weight
        inputs, outputs = sides
        self._set_inputs(inputs.to(weight.dtype))
        self.outputs = outputs.to(weight.dtype).contiguous()
        self._set_output_columns()
        resolved = ops.resolve_backend([weight], backend)
        self.transposed = transposed
        self.fused = resolved == "triton"  # one Triton GEMM with the term in its epilogue
        self.compiled = resolved == "cpu" and weight.dtype == torch.float32  # the library's term is fp32
        # the library computes the base as it computes a plain layer while decoding, term included, only
        # where the base is x W^T + b and nothing more (the same rule: fastes.models.decoding_linears),
        # and not too small for its products (a small layer's choice is `_perturbs_in_product`'s)
        self.library_base = (
            self.compiled and cpu_linear.linear_applies(base) and not cpu_linear.is_small(weight)
        )
        # the base's weight and bias as plain tensors (sharing their memory), read at every call without
        # nn.Module's attribute lookups; the layer lives for one population's generation
        self._weight = weight.detach()
        self._bias = None if base.bias is None else base.bias.detach()
        self._term: cpu_library.LowRankTerm | None = None  # _term_for's last answer
        # the member matmul's shared weight [in, out] where the members' weights are formed in it
        self._weight_t = self._weight.t().contiguous() if self._perturbs_in_product() else None
        self._product = self._member_product()

    @classmethod
    def from_factors(
        cls,
        base: torch.nn.Module,
        factors: list[tuple[torch.Tensor, torch.Tensor]],
        scales: list[float],
        transposed: bool = False,
        backend: str = "auto",
    ) -> LowRankLinear:
        """The layer of members whose factors (A [rows of the weight, r], B [columns, r]) and scales are
        given, one pair and one scale a member (`lowrank.factors`)."""
        rank = factors[0][0].shape[1]
        a = torch.stack([a for a, _ in factors])  # [members, rows of the weight, r]
        b = torch.stack([b for _, b in factors])  # [members, columns of the weight, r]
        out_side, in_side = (b, a) if transposed else (a, b)
        outputs = out_side.transpose(1, 2) * _scales_over_root_rank(tuple(scales), rank, a.device)
        return cls(base, (in_side.transpose(1, 2), outputs), transposed, backend)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        members, _, out_features = self.outputs.shape
        self._check_rows(x.shape[0])
        if self._product is not None:  # each member's weight formed in the member matmul
            x = x if x.dtype == torch.float32 else x.float()
            return self._product(x, self._row_offsets(x.numel() // x.shape[-1]))
        flat = x.reshape(-1, x.shape[-1])  # member m's rows, from _row_offsets (equal blocks by default)
        if self.fused:
            return self._fused(flat).view(*x.shape[:-1], out_features)
        if self.compiled:
            return self._compiled(flat).view(*x.shape[:-1], out_features)
        y = self.base(flat)
        grouped = flat.reshape(members, -1, flat.shape[-1])
        if grouped.dtype != y.dtype:
            grouped = grouped.to(y.dtype)
        products = torch.bmm(grouped, self._inputs_t)  # [members, rows, r]
        grouped_y = y.view(members, -1, out_features)
        if len(self._output_columns) == 1:  # rank 1, the default: the products are the one column
            grouped_y.addcmul_(products, self.outputs)
        else:
            for column, output in zip(products.split(1, dim=-1), self._output_columns):
                grouped_y.addcmul_(column, output)
        return y.view(*x.shape[:-1], out_features)

    @property
    def population_members(self) -> int:
        return self.outputs.shape[0]

    def views(self, sides: tuple[torch.Tensor, torch.Tensor]) -> bool:
        """Whether the layer reads its members' factors from `sides` itself (not from copies: another dtype,
        or members dropped), so that writing new factors there re-arms it."""
        inputs, outputs = sides
        return self.inputs.data_ptr() == inputs.data_ptr() and self.outputs.data_ptr() == outputs.data_ptr()

    @staticmethod
    def rearm_all(layers: list[LowRankLinear]) -> None:
        """Ready `layers` for the next population of the same members, whose factors were written into
        the sides they view (`views`) and whose base weights the update wrote in place: the member
        matmul's transposed copies of the weights are made again, and what was kept for the last
        population's rows (their grouping, the library's term) is forgotten."""
        for layer in layers:
            if layer._weight_t is not None:
                layer._weight_t.copy_(layer._weight.t())
            # plain attributes, set at once without the layer's __setattr__
            vars(layer).update(_member_rows=None, _offsets=None, _offsets_for=-1, _term=None)

    def keep_members(self, positions: list[int]) -> None:
        index = torch.tensor(positions, device=self.inputs.device)
        self._set_inputs(self.inputs[index])
        self.outputs = self.outputs[index]
        self._set_output_columns()
        self._product = self._member_product()
        self._offsets_for, self._term = -1, None

    def _set_output_columns(self) -> None:
        """The output factors' rank columns, sliced once for the torch path's multiply-add per rank (a
        layer runs for every token of every row); at rank 1, the default, the one column is `outputs`."""
        rank = self.outputs.shape[1]
        self._output_columns = self.outputs.split(1, dim=1) if rank > 1 else (self.outputs,)

    def _set_inputs(self, inputs: torch.Tensor) -> None:
        """Hold the input factors [members, r, in] in row-major strides, and `_inputs_t`, the batched
        matmul's [members, in, r] operand, as their transposed view.

        The strides of a size-1 dimension are free (`contiguous()` keeps whatever they are), and at rank
        1 they decide the speed: MKL's batched GEMM read a [members, in, 1] operand with strides
        (in, 1, 1) 6-11x slower than the same values as this transposed view, (in, 1, in), on an AMD EPYC
        (docs/results/lowrank-layout-2026-12-06.md).
        """
        members, rank, in_features = inputs.shape
        row_major = inputs.stride() == (rank * in_features, in_features, 1)
        self.inputs = inputs if row_major else inputs.clone(memory_format=torch.contiguous_format)
        self._inputs_t = self.inputs.transpose(1, 2)

    def _perturbs_in_product(self) -> bool:
        """Whether the member matmul forms each member's weight (see the class docstring): fp32 on the CPU,
        a plain nn.Linear base (x W^T + b, nothing more) too small for the library's own products (which
        add the term as they store each output), and the member matmul measured faster here than the base's
        product followed by the term's pass."""
        return (
            self.compiled
            and not self.library_base
            and cpu_linear.is_plain_linear(self.base)
            and cpu_linear.products(torch.get_num_threads()).lowrank_member_matmul
        )

    def _member_product(self) -> cpu_library.MemberMatmul | None:
        """The member matmul of the current members' factors, where the layer takes it."""
        if self._weight_t is None:
            return None
        return cpu_library.MemberMatmul(self._weight_t, self._bias, (self.inputs, self.outputs))

    def _compiled(self, flat: torch.Tensor) -> torch.Tensor:
        flat = flat.to(torch.float32).contiguous()
        term = self._term_for(flat.shape[0])
        if self.library_base:
            return cpu_linear.linear(flat, self._weight, self._bias, term)
        return cpu_library.lowrank_term(flat, self.base(flat).contiguous(), term)

    def _term_for(self, rows: int) -> cpu_library.LowRankTerm:
        """The library's term for `rows` rows, made (and checked, on its first use) once per grouping of
        the rows, as `_row_offsets`: the layer runs for every token (`cpu_library.LowRankTerm`)."""
        offsets = self._row_offsets(rows)
        if self._term is None or self._term.offsets is not offsets:
            self._term = cpu_library.LowRankTerm(self.inputs, self.outputs, offsets)
        return self._term

    def _fused(self, flat: torch.Tensor) -> torch.Tensor:
        from fastes.engine.kernels import launch_lowrank_linear

        weight = self.base.weight
        y = torch.empty(flat.shape[0], self.outputs.shape[2], dtype=weight.dtype, device=weight.device)
        launch_lowrank_linear(
            flat.to(weight.dtype).contiguous(),
            weight.contiguous(),
            self.base.bias,
            self.inputs,
            self.outputs,
            y,
            ops.triton_dtype(weight.dtype),
            self.transposed,
        )
        return y


MODES = ("materialised", "virtual", "lowrank")


@functools.lru_cache(maxsize=64)
def _scales_over_root_rank(scales: tuple[float, ...], rank: int, device: torch.device) -> torch.Tensor:
    """[members, 1, 1]: each member's scale / sqrt(rank), made once for all of a population's layers (each
    layer made its own: ~13 us of the ~110 it took to build one, every iteration). Read, never written."""
    return (torch.tensor(scales, dtype=torch.float32, device=device) / rank**0.5)[:, None, None]


def _population_layers(
    es: ES, group: dict, members: list[Member], linears: list[Projection], mode: str
) -> list[torch.nn.Module]:
    """One population layer per evolved weight of `group`; `linears` are the weights' projections."""
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
        return [
            VirtualLinear(linear.module, tid, keys, scales, linear.transposed, es.noise)
            for linear, tid in zip(linears, group["ids"])
        ]
    if mode == "lowrank":
        if es.noise_type != "lowrank":
            raise ValueError("eval mode 'lowrank' needs ES(noise_type='lowrank')")
        return _lowrank_layers(es, group, members, linears)
    return [
        PopulationLinear(linear.module, weights, linear.transposed, es.backend)
        for linear, weights in zip(linears, _materialised(es, group, members, linears))
    ]


class _KeptLayers(NamedTuple):
    """A population's low-rank layers, kept for the next one of the same members (`_lowrank_layers`)."""

    stamp: tuple  # what they were built for: members, projections, weights, backend, threads
    layers: list[LowRankLinear]
    sides: lowrank.MemberSides  # what the layers view


# each ES's last low-rank layers, by param group (id): dropped with the ES
_kept_layers: weakref.WeakKeyDictionary[ES, dict[int, _KeptLayers]] = weakref.WeakKeyDictionary()


def _lowrank_layers(
    es: ES, group: dict, members: list[Member], linears: list[Projection]
) -> list[LowRankLinear]:
    """The low-rank layers of `members` for `group`'s weights, their sides copied from this generation's
    factors (`ES.lowrank_directions`).

    Building a tiny model's 14 layers took ~0.45 ms of a ~65 ms ES iteration, at every generation; the next
    generation's layers differ only in the factors they read and in the weights the update wrote in place.
    So the last population's layers are re-armed where they were built for the same members, projections,
    weights, backend and threads, and still view their sides (a layer that dropped members holds copies):
    the new factors are written into the buffers they view (`LowRankLinear.rearm_all`)."""
    factors = es.lowrank_directions(group, list(range(len(group["params"]))))
    directions = [m.direction for m in members]
    scales = [m.sign * group["sigma"] for m in members]
    transposed = [linear.transposed for linear in linears]
    stamp = (
        tuple(m.index for m in members),
        tuple(
            (
                id(linear.module),
                linear.transposed,
                weight.data_ptr(),
                weight.dtype,
                _address(linear.module.bias),
            )
            for linear, weight in zip(linears, group["params"])
        ),
        es.backend,
        torch.get_num_threads(),
    )
    kept_by_group = _kept_layers.setdefault(es, {})
    kept = kept_by_group.get(id(group))
    if (
        kept is not None
        and kept.stamp == stamp
        and all(map(LowRankLinear.views, kept.layers, kept.sides.per_matrix))
    ):
        factors.member_sides(directions, scales, transposed, into=kept.sides)
        LowRankLinear.rearm_all(kept.layers)
        return kept.layers
    sides = factors.member_sides(directions, scales, transposed)
    layers = [
        LowRankLinear(linear.module, side, linear.transposed, es.backend)
        for linear, side in zip(linears, sides.per_matrix)
    ]
    kept_by_group[id(group)] = _KeptLayers(stamp, layers, sides)
    return layers


def _address(tensor: torch.Tensor | None) -> int | None:
    return None if tensor is None else tensor.data_ptr()


def _materialised(
    es: ES, group: dict, members: list[Member], linears: list[Projection]
) -> list[torch.Tensor]:
    """Every member's perturbed weights of `group`, [members, *weight shape] each, held in memory as
    [members, in, out] (an nn.Linear's [out, in] weights are written transposed, straight into the layout
    PopulationLinear's batched matmul wants: no copy). An antithetic pair in `members` is written from one
    pass over its noise."""
    buffers = [
        torch.empty(
            (len(members), *(p.shape if linear.transposed else p.shape[::-1])), dtype=p.dtype, device=p.device
        )
        for p, linear in zip(group["params"], linears)
    ]
    views = [b if linear.transposed else b.transpose(1, 2) for b, linear in zip(buffers, linears)]
    position = {member.index: i for i, member in enumerate(members)}
    writes, written = [], set()
    for i, member in enumerate(members):
        if i in written:
            continue
        twin = position.get(member.index ^ 1) if es.antithetic else None  # members 2j and 2j + 1
        writes.append((member, [v[i] for v in views], None if twin is None else [v[twin] for v in views]))
        written.update({i} if twin is None else {i, twin})
    es.perturb_members_into(group, writes)
    return views


def member_groups(es: ES, mode: str, materialise_bytes: float) -> list[list[Member]]:
    """The members in evaluation groups: all at once, except in "materialised" mode, where a group's
    perturbed weights (one copy of the evolved weights per member) stay within `materialise_bytes`."""
    members = list(es.members())
    if mode != "materialised":
        return [members]
    evolved = sum(p.numel() * p.element_size() for group in es.param_groups for p in group["params"])
    size = max(1, int(materialise_bytes // max(evolved, 1)))
    return [members[i : i + size] for i in range(0, len(members), size)]


@contextmanager
def population_batched(
    es: ES, model: torch.nn.Module, mode: str = "materialised", members: list[Member] | None = None
) -> Iterator[list[Member]]:
    """Swap the evolved projection layers of `model` for population-batched ones; yields the members
    (all of this process's, or the given group).

    Feed the model `len(members) * b` rows, member i's rows being i * b ... (i + 1) * b - 1.
    """
    if mode not in MODES:
        raise ValueError(f"unknown batched mode {mode!r}; choose one of {MODES}")
    members = list(es.members()) if members is None else members
    owners = projections(model)
    swapped: list[tuple[torch.nn.Module, str, torch.nn.Module]] = []
    try:
        for group in es.param_groups:
            for name, p in zip(group["names"], group["params"]):
                if id(p) not in owners:
                    raise ValueError(
                        f"batched evaluation evolves projection weights (nn.Linear, Conv1D) only; {name!r} "
                        "is not one (use eval_mode 'member' to evolve embeddings, norms or biases)"
                    )
            linears = [owners[id(p)] for p in group["params"]]
            layers = _population_layers(es, group, members, linears, mode)
            for linear, layer in zip(linears, layers):
                parent_path, _, attribute = linear.path.rpartition(".")
                parent = model.get_submodule(parent_path)
                setattr(parent, attribute, layer)
                swapped.append((parent, attribute, linear.module))
        yield members
    finally:
        for parent, attribute, linear in swapped:
            setattr(parent, attribute, linear)
