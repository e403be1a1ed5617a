"""Measurements for comparing ES with GRPO: pure functions on tensors and arrays (no models, no tasks).

- passk: unbiased pass@k and Pass@K curves
- entropy: token entropy of next-token distributions
- diversity: (verifier-projected) Jensen-Shannon diversity of a population
- sparsity: update sparsity, top-k masked updates, gain retained, |delta| histograms
- drift: token-level KL to the base model, perplexity
- plots: the figures (imports matplotlib, so import it explicitly: `from fastes.analysis import plots`)
"""

from .diversity import JSDiversity, binary_entropy, generalized_js, js_diversity, shannon_entropy
from .drift import masked_nll, perplexity, token_kl
from .entropy import token_entropies, token_entropy
from .passk import k_values, pass_at_k, pass_at_k_curve
from .sparsity import (
    DEFAULT_TOLERANCES,
    KEEP_FRACTIONS,
    DeltaHistogram,
    UpdateSparsity,
    delta_log10_histogram,
    gain_retained,
    keep_masks,
    kept_count,
    per_tensor_delta_norms,
    topk_mask_state,
    update_deltas,
    update_sparsity,
)

__all__ = [
    "DEFAULT_TOLERANCES",
    "KEEP_FRACTIONS",
    "DeltaHistogram",
    "JSDiversity",
    "UpdateSparsity",
    "binary_entropy",
    "delta_log10_histogram",
    "gain_retained",
    "generalized_js",
    "js_diversity",
    "k_values",
    "keep_masks",
    "kept_count",
    "masked_nll",
    "pass_at_k",
    "pass_at_k_curve",
    "per_tensor_delta_norms",
    "perplexity",
    "shannon_entropy",
    "token_entropies",
    "token_entropy",
    "token_kl",
    "topk_mask_state",
    "update_deltas",
    "update_sparsity",
]
