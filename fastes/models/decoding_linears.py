"""The linear layers of a decoding step on the CPU, at the speed of streaming their weights.

Late in a batched generation few rows are still going, and a step does little more than read every
weight from memory (SmolLM2-135M: 540 MB a step). On a 2-core AMD EPYC torch's CPU `linear` was slow
there, on two counts (docs/results/decoding-linears-2026-12-06.md, weights streamed from memory):
- BLAS read the weight again for each row: SmolLM2's vocabulary projection (49152 x 576) took 10, 23
  and 34 ms at 1, 2 and 3 rows. `cpu_library.few_rows_linear` reads each weight row once for up to
  FEW_ROWS rows: 3.9, 3.1 and 7.3 ms; a 576 x 576 projection 142 -> 70 us at one row, 175 -> 36 at two.
- Above that, a vocabulary-wide output was faster computed as (W x^T)^T, the vocabulary as the GEMM's
  long side (SmolLM2's vocabulary 140 -> 111 ms at 256 rows; other vocabularies 1.2-1.6x at 32 and 64
  rows).
A decoding step of SmolLM2 at 1 to 8 rows ran 1.7-3.1x faster, at 64 rows 1.08x. Since 2026-12-07 the
few-rows linear takes every row count below the packed linear's (`cpu_linear.PACKED_MIN_ROWS`), FEW_ROWS
rows at a time over blocks of the weight that stay in L2, and at 8 rows streams the weight at 32-35 GB/s
where it reached 13-16: SmolLM2's projections at 8-96 rows took 0.41-0.65 of torch's time and 0.25-0.88
of the packed linear's (docs/results/few-rows-linear-2026-12-07.md); a vocabulary-wide output from
128 rows takes it too, and from 256 the packed linear, where they measure faster than torch's `linear`
(the weight-major product was the slowest of four ways there: docs/results/vocabulary-head-2026-12-07.md).
At a prefill's many rows the library's packed linear ran SmolLM2's projections 1.10-1.15x faster than
torch's `linear` (docs/results/packed-linear-2026-12-06.md). On a 2-core Intel Xeon, torch's MKL was
the faster one at most of these sizes (docs/results/cpu-products-2026-12-06.md), so
`fastes.engine.cpu_linear.linear` takes each library product only where it measured faster on the
machine it runs on. The low-rank
population layer calls it with its members' term, which the few-rows linear and the packed linear add in
the same pass, so ES and plain generation run the same products.

`decoding_linears(model)` swaps each nn.Linear of `model` that this applies to
(`cpu_linear.linear_applies`: fp32 on the CPU, no hooks, a weight of at least MIN_WEIGHT_BYTES or a
smaller one where the packed linear measured faster for it) for `DecodingLinear` while it is held, and
puts the originals back after. fastes' decoding loop holds it for every generation, plain and population
alike (a population layer's `base` projection is swapped as any other), so ES and plain generation run
the same products. A tiny model's weights stay below the threshold: they take the packed linear at 96
rows or more (`cpu_linear.SMALL_PACKED_MIN_ROWS`) where `cpu_linear.Products.small_packed` says so, else
torch's `linear`.

The library's products agree with torch's `linear` to float tolerance, not bit for bit (they sum in
another order): a row's tokens agree with transformers' `generate` as far as the logits do.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

from fastes.engine import cpu_library, cpu_linear
from fastes.engine.cpu_linear import linear_applies


class DecodingLinear(torch.nn.Module):
    """`base` (an nn.Linear) computed by the product this machine runs fastest for its rows
    (`cpu_linear.linear`): the few-rows linear at a decoding step's rows (a vocabulary-wide output's up
    to 255), the packed linear at a prefill's many rows, the weight-major product for a vocabulary-wide
    output where neither is taken, or torch's own `linear`."""

    def __init__(self, base: torch.nn.Linear) -> None:
        super().__init__()
        self.base = base

    @property
    def weight(self) -> torch.Tensor:
        return self.base.weight

    @property
    def bias(self) -> torch.Tensor | None:
        return self.base.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = cpu_linear.linear(x.reshape(-1, x.shape[-1]), self.base.weight, self.base.bias)
        return y.reshape(*x.shape[:-1], y.shape[-1])


@contextmanager
def decoding_linears(model: torch.nn.Module) -> Iterator[None]:
    """Run `model`'s linear layers as `DecodingLinear` while held (where `cpu_linear.linear_applies`); put
    them back after."""
    swapped = []
    if cpu_library.available():
        for parent in list(model.modules()):
            for name, child in parent.named_children():
                if linear_applies(child):
                    swapped.append((parent, name, child))
    try:
        for parent, name, child in swapped:
            setattr(parent, name, DecodingLinear(child))
        yield
    finally:
        for parent, name, child in swapped:
            setattr(parent, name, child)
