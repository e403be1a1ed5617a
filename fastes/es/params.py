"""Which tensors ES evolves: every projection matrix of a model, and what a user adds or filters out.

A projection is a layer that computes x W (+ b): torch's `nn.Linear` (weight [out, in]) and transformers'
`Conv1D` of GPT-2 and its relatives (weight [in, out], the transpose). Both count everywhere fastes
handles projections (selection, population-batched, virtual and low-rank evaluation), each in its own
layout. Embeddings (a tied lm_head included), norm weights and biases are opt-in.
"""

from __future__ import annotations

import re
import sys
import warnings
from dataclasses import dataclass
from typing import Any

import torch

try:  # transformers is a dependency of the training loops, not of fastes.ES itself
    from transformers.pytorch_utils import Conv1D
except ImportError:  # pragma: no cover
    Conv1D = None

PROJECTION_TYPES: tuple[type, ...] = (torch.nn.Linear,) if Conv1D is None else (torch.nn.Linear, Conv1D)


@dataclass(frozen=True)
class Projection:
    """A projection layer of a model: its module path, the module, and its weight layout."""

    path: str
    module: torch.nn.Module

    @property
    def transposed(self) -> bool:
        """True for Conv1D: the weight is stored [in, out] and the layer computes x W."""
        return not isinstance(self.module, torch.nn.Linear)

    @property
    def in_features(self) -> int:
        return self.module.weight.shape[0 if self.transposed else 1]

    @property
    def out_features(self) -> int:
        return self.module.weight.shape[1 if self.transposed else 0]


def is_peft_model(model: Any) -> bool:
    """Whether `model` is a peft.PeftModel (without importing peft): its trainable tensors are the ones
    that evolve (fastes.models.adapters wraps and loads adapters)."""
    peft = sys.modules.get("peft")
    return peft is not None and isinstance(model, peft.PeftModel)


def projections(model: torch.nn.Module) -> dict[int, Projection]:
    """id(weight) -> Projection for every nn.Linear and Conv1D layer of `model`."""
    return {
        id(m.weight): Projection(path, m)
        for path, m in model.named_modules()
        if isinstance(m, PROJECTION_TYPES) and isinstance(getattr(m, "weight", None), torch.Tensor)
    }


def linear_weights(
    model: torch.nn.Module,
    *,
    include_embeddings: bool = False,
    include_norms: bool = False,
    include_biases: bool = False,
    names: str | None = None,
    warn: bool = True,
) -> list[tuple[str, torch.nn.Parameter]]:
    """(name, parameter) pairs ES evolves: by default the weight of every projection (nn.Linear, Conv1D).

    A weight shared with the input embedding (tied lm_head) counts as an embedding. Norm weights, biases
    and embeddings are opt-in. `names` is a regular expression: only parameters whose name it matches
    (re.search) are kept, e.g. r"layers\\.(2[4-9]|3\\d)\\." or r"(q|v)_proj". Each tensor appears once,
    under its first name in `model.named_parameters()`. With `warn`, a warning lists the projection-like
    matrices that are not evolved (excluded by `names`, or in a layer type fastes does not know).

    With a PEFT adapter (a peft.PeftModel) only its trainable tensors count: LoRA's lora_A / lora_B are
    projections; the frozen base model is never evolved.
    """
    pattern = _compile(names)
    adapter = is_peft_model(model)
    projection = {key for key in projections(model)}
    embedding, norm, bias = set(), set(), set()
    for module in model.modules():
        weight = getattr(module, "weight", None)
        if isinstance(module, torch.nn.Embedding):
            embedding.add(id(module.weight))
        elif isinstance(weight, torch.nn.Parameter) and "norm" in type(module).__name__.lower():
            norm.add(id(weight))
        module_bias = getattr(module, "bias", None)
        if isinstance(module_bias, torch.nn.Parameter):
            bias.add(id(module_bias))
    chosen, filtered_out, unknown = [], [], []
    for name, p in model.named_parameters():  # named_parameters already lists a shared tensor once
        if adapter and not p.requires_grad:  # the base model under an adapter stays as it is
            continue
        key = id(p)
        if key in embedding:
            keep = include_embeddings
        elif key in projection:
            keep = True
        elif key in norm:
            keep = include_norms
        elif key in bias:
            keep = include_biases
        else:
            keep = False
            if p.dim() == 2:  # a matrix in a layer type we do not recognise as a projection
                unknown.append(name)
        if keep and pattern is not None and not pattern.search(name):
            keep = False
            if key in projection:
                filtered_out.append(name)
        if keep:
            chosen.append((name, p))
    if not chosen:
        if adapter:
            raise ValueError(
                "the PEFT adapter has no trainable projection weights to evolve (nn.Linear: LoRA's lora_A / "
                "lora_B); ES evolves LoRA adapters (peft.LoraConfig)"
                + (f" whose names match names={names!r}" if pattern is not None else "")
            )
        if pattern is not None:
            problem = f": no parameter name matches names={names!r} among the projection weights"
        else:
            problem = " has no projection weights to evolve"
        raise ValueError(
            f"{type(model).__name__}{problem} (nn.Linear or Conv1D); check the name filter "
            "(es.evolve), enable include_embeddings / include_norms (es.include_embeddings, "
            "es.include_norms), or pass the tensors to fastes.ES yourself"
        )
    if warn and (filtered_out or unknown):
        warnings.warn(_not_evolved_message(filtered_out, unknown, names), stacklevel=2)
    return chosen


def _compile(names: str | None) -> re.Pattern | None:
    if not names:
        return None
    try:
        return re.compile(names)
    except re.error as error:
        raise ValueError(f"names={names!r} is not a regular expression ({error})") from None


def _not_evolved_message(filtered_out: list[str], unknown: list[str], names: str | None) -> str:
    parts = []
    if filtered_out:
        parts.append(
            f"{len(filtered_out)} projection matrices do not match names={names!r} and are not evolved "
            f"(e.g. {', '.join(filtered_out[:3])})"
        )
    if unknown:
        parts.append(
            f"{len(unknown)} matrices sit in layers that are neither nn.Linear nor Conv1D and are not "
            f"evolved (e.g. {', '.join(unknown[:3])}); pass them to fastes.ES yourself to evolve them "
            "(member-by-member evaluation)"
        )
    return "; ".join(parts)
