"""fastes' batched decoding loop: a KV cache, one token per row and step, and finished rows leave the batch.

transformers' `generate` decodes every row until the last one stops: a finished row keeps costing a row
of every matmul, attention and cache copy until then. In an ES generation that is most of the decode
work: one member that answers at length keeps all members' rows decoding (on SmolLM2 at 16 members x
16 prompts x 24 tokens, the rows still going were 21-39% of the row-steps decoded:
docs/results/finished-rows-2026-12-06.md).

Inside `fastes.es.population.population_batched` the batch is read as the members' equal groups of rows
(one group for a plain model). Population layers that take groups of any size (the materialised
layer's compiled CPU matmul: `takes_unequal_groups`) are told each member's count of rows still going
(`set_member_rows`), and every finished row leaves, as in plain generation. Otherwise the rows kept
after each step are the live groups' live columns: a group is live while any of its rows is
unfinished, and column j (the j-th row of every group) while the j-th row of any live group is. So the
kept rows are again equal groups. When members leave, the population layers are told which stay
(`keep_members`), and go on with those members' weights. A cache with a recurrent state that takes no
row selection (a hybrid model's convolution or Mamba layers) keeps every row, as transformers'
`generate` does.

Each step computes what transformers' greedy `generate` computes for the rows it keeps (the same inputs,
positions and cache), so a row's tokens agree with it as far as the logits do: a CPU GEMM may round a row
differently at another batch size (tests/test_decoding.py compares both, bit for bit while no row
leaves and in float64 while rows leave). On the CPU a model's larger linear layers run as
`fastes.models.decoding_linears` computes them for the duration: torch's `linear` reads a weight once
per row at a few rows, and a step late in a generation does little more than read the weights.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence

import torch
from transformers import DynamicCache, PreTrainedModel

from .decoding_linears import decoding_linears

# (sequences so far, the step's logits, the rows' indices in the whole batch, step) -> next tokens
ChooseTokens = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, int], torch.Tensor]


@torch.inference_mode()
def decode(
    model: PreTrainedModel,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    *,
    max_new_tokens: int,
    eos_ids: Sequence[int],
    pad_id: int,
    choose: ChooseTokens,
) -> torch.Tensor:
    """[rows, max_new_tokens] generated ids of left-padded `input_ids`, pad_id after a row's EOS.

    `choose` picks each step's tokens from the float32 logits of the last position (greedy: argmax).
    """
    with decoding_linears(model):  # torch's CPU linear is slow at few rows (decoding_linears)
        return _decode(model, input_ids, attention_mask, max_new_tokens, eos_ids, pad_id, choose)


def _decode(
    model: PreTrainedModel,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    max_new_tokens: int,
    eos_ids: Sequence[int],
    pad_id: int,
    choose: ChooseTokens,
) -> torch.Tensor:
    rows = input_ids.shape[0]
    layers = _population_layers(model)
    members = layers[0].population_members if layers else 1
    # layers that take the members' rows in groups of any size let every finished row leave, as in a
    # plain model (one group); the others keep the live groups' live columns
    unequal = bool(layers) and all(layer.takes_unequal_groups for layer in layers)
    groups = 1 if unequal else members
    out = torch.full((rows, max_new_tokens), pad_id, dtype=torch.long, device=input_ids.device)
    eos = torch.tensor(list(eos_ids), dtype=torch.long, device=input_ids.device)
    live = torch.arange(rows, device=input_ids.device)  # the batch's rows, as indices into the whole batch
    finished = torch.zeros(rows, dtype=torch.bool, device=input_ids.device)
    sequences, mask = input_ids, attention_mask
    cache = DynamicCache(config=model.config.get_text_config(decoder=True))
    options = _forward_options(model, cache)
    # transformers' positions for a left-padded batch (the padding's positions are never attended to)
    positions = (mask.long().cumsum(-1) - 1).masked_fill(mask == 0, 0)
    logits = _forward(model, sequences, mask, positions, options)
    # a recurrent layer's state (a hybrid model's convolution or Mamba state) may take no row selection:
    # then every row decodes until the last stops, as in transformers' generate
    droppable = all(hasattr(layer, "batch_select_indices") for layer in cache.layers)
    try:
        for step in range(max_new_tokens):
            # a finished row that stays (its group or column is live) is fed padding, as transformers does
            tokens = choose(sequences, logits, live, step).masked_fill(finished, pad_id)
            out[live, step] = tokens
            finished = finished | torch.isin(tokens, eos)
            kept_groups, kept = _kept(~finished, groups)
            if kept is None or step + 1 == max_new_tokens:
                break
            if droppable and kept.shape[0] < live.shape[0]:  # the finished rows leave, and their cache
                tokens, sequences, mask, positions, live, finished = (
                    t[kept] for t in (tokens, sequences, mask, positions, live, finished)
                )
                cache.batch_select_indices(kept)
                if unequal:  # row i of the whole batch is member i // (rows / members)'s
                    counts = torch.bincount(live // (rows // members), minlength=members).tolist()
                    for layer in layers:
                        layer.set_member_rows(counts)
                elif len(kept_groups) < groups:
                    groups = len(kept_groups)
                    for layer in layers:
                        layer.keep_members(kept_groups)
            sequences = torch.cat([sequences, tokens[:, None]], dim=-1)
            mask = torch.cat([mask, mask.new_ones(mask.shape[0], 1)], dim=-1)
            positions = positions[:, -1:] + 1
            logits = _forward(model, tokens[:, None], mask, positions, options)
    finally:
        if unequal:  # the layers read equal groups again, as population_batched made them
            for layer in layers:
                layer.set_member_rows(None)
    return out


def _population_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's population layers (fastes.es.population): modules that read their rows as the
    members' groups (`population_members`) and can go on with some of them (`keep_members`), or with
    groups of any size (`takes_unequal_groups`, `set_member_rows`)."""
    return [m for m in model.modules() if hasattr(m, "keep_members")]


def _kept(unfinished: torch.Tensor, groups: int) -> tuple[list[int], torch.Tensor | None]:
    """(the groups that stay, as positions among the current ones; the rows that stay, as indices into the
    current batch, or None when every row has finished): the live groups' live columns."""
    grid = unfinished.view(groups, -1)
    live_groups = grid.any(dim=1)
    if not bool(live_groups.any()):
        return [], None
    live_columns = grid[live_groups].any(dim=0)
    keep = (live_groups[:, None] & live_columns[None, :]).flatten()
    return live_groups.nonzero().flatten().tolist(), keep.nonzero().flatten()


def _forward(
    model: PreTrainedModel,
    input_ids: torch.Tensor,
    mask: torch.Tensor,
    positions: torch.Tensor,
    options: dict,
) -> torch.Tensor:
    """The float32 logits of each row's last position; the cache in `options` extended by `input_ids`."""
    out = model(
        input_ids=input_ids.contiguous(),
        attention_mask=mask,
        position_ids=positions[:, -input_ids.shape[1] :].contiguous(),
        **options,
    )
    return out.logits[:, -1].to(copy=True, dtype=torch.float32)


def _forward_options(model: PreTrainedModel, cache: DynamicCache) -> dict:
    """The cache under the name the model's forward takes it by ("cache" since transformers 5.x renamed
    it, "past_key_values" before), and logits for the last position only where the model can give them."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model  # a PEFT wrapper
    accepted = inspect.signature(type(base).forward).parameters
    options = {"use_cache": True, "cache" if "cache" in accepted else "past_key_values": cache}
    if "logits_to_keep" in accepted:
        options["logits_to_keep"] = 1
    return options
