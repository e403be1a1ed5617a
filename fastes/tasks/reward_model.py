"""Reward models in `reward_funcs`, scored as TRL's GRPOTrainer scores them, and the one place that turns
each entry of `reward_funcs` into something that scores.

An entry is a callable (fastes/tasks/reward_file.py), "FILE.py:FUNCTION", a local directory holding a
saved sequence classifier (AutoModelForSequenceClassification, loaded with num_labels=1), or a loaded
transformers sequence classifier. A model's reward for a completion is the logit of label 0 on the
prompt followed by the completion: the text concatenated for text prompts, the model tokenizer's chat
template applied to the prompt's messages plus the assistant's completion for conversational ones;
tokenized as one right-padded batch without added special tokens. The model is named after the last part
of its config's `_name_or_path` (rewards/<name>/mean), runs in eval mode without gradients, on the run's
device.

Its tokenizer comes from `reward_processing_classes` (None, one tokenizer, or a list aligned with
reward_funcs whose None entries mean: the tokenizer saved with the model). A tokenizer without a padding
token pads with its end-of-sequence token, and the model is told that id (sequence classifiers score the
last token before the padding).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from .reward_file import RewardFunction, RewardFunctionError, check_rewards

ROWS_PER_CALL = 64  # completions per forward pass of a reward model: bounds its memory on a large ES batch


class RewardModel:
    """A sequence classifier whose label-0 logit is the reward of prompt + completion."""

    is_async = False

    def __init__(self, model: torch.nn.Module, tokenizer: Any = None) -> None:
        config = getattr(model, "config", None)
        if config is None:
            raise RewardFunctionError(
                f"reward_funcs: {type(model).__name__} is a torch module without a transformers config; pass "
                "a sequence classifier (AutoModelForSequenceClassification) or a reward function"
            )
        source = str(getattr(config, "_name_or_path", "") or "")
        self.name = source.rstrip("/").split("/")[-1] or type(model).__name__
        if tokenizer is None:
            tokenizer = _saved_tokenizer(source, self.name)
        if tokenizer.pad_token_id is None:
            tokenizer.pad_token = tokenizer.eos_token
        # The classifier reads the last token before the first pad id: it must be the tokenizer's.
        config.get_text_config().pad_token_id = tokenizer.pad_token_id
        self.model, self.tokenizer = model.eval(), tokenizer
        self.device: torch.device | None = None

    def check_columns(self, columns: list[str]) -> None:
        """A model reads prompts and completions only."""

    def to(self, device: str | torch.device) -> None:
        """Run on `device` from the next call on."""
        self.device = torch.device(device)

    def texts(self, prompts: list[Any], completions: list[Any]) -> list[str]:
        """What the model reads: prompt + completion, through the chat template for message prompts."""
        if prompts and isinstance(prompts[0], list):
            template = self.tokenizer.apply_chat_template
            return [template(p + c, tokenize=False) for p, c in zip(prompts, completions)]
        return [p + c for p, c in zip(prompts, completions)]

    @torch.inference_mode()
    def __call__(self, arguments: dict[str, Any], count: int) -> list[float]:
        texts = self.texts(arguments["prompts"], arguments["completions"])
        if self.device is not None and _device_of(self.model) != self.device:
            self.model.to(self.device)
        self.model.eval()  # a model trained elsewhere in the script may have been left in train mode
        rewards = []
        for start in range(0, len(texts), ROWS_PER_CALL):
            inputs = self.tokenizer(
                text=texts[start : start + ROWS_PER_CALL],
                return_tensors="pt",
                padding=True,
                padding_side="right",
                add_special_tokens=False,
            ).to(_device_of(self.model))
            rewards += self.model(**inputs).logits[:, 0].float().tolist()
        return check_rewards(rewards, count, f"reward model {self.name!r}")

    def __str__(self) -> str:
        return f"reward model {self.name!r}"


def _device_of(model: torch.nn.Module) -> torch.device:
    return next(model.parameters()).device


def _saved_tokenizer(source: str, name: str) -> Any:
    """The tokenizer saved in the model's directory."""
    if not source or not Path(source).is_dir():
        raise RewardFunctionError(
            f"reward model {name!r}: no tokenizer given and no local directory to load one from "
            f"({source!r}); pass its tokenizer in reward_processing_classes"
        )
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(source)
    except (OSError, ValueError) as error:
        raise RewardFunctionError(
            f"reward model {name!r}: cannot load the tokenizer of {source} ({type(error).__name__}); pass "
            "its tokenizer in reward_processing_classes"
        ) from None


def load_reward_model(path: str | Path, tokenizer: Any = None) -> RewardModel:
    """The sequence classifier saved in directory `path`, with one label (TRL loads it so)."""
    from transformers import AutoModelForSequenceClassification

    try:
        model = AutoModelForSequenceClassification.from_pretrained(str(path), num_labels=1)
    except (OSError, ValueError, KeyError) as error:
        raise RewardFunctionError(
            f"reward {str(path)!r}: the directory holds no sequence classifier that transformers can load "
            f"({type(error).__name__}: {str(error)[:120]}); save one with save_pretrained"
        ) from None
    return RewardModel(model, tokenizer)


def reward_sources(
    reward_funcs: Any, reward_processing_classes: Any = None, timeout: float = 60.0
) -> list[RewardFunction | RewardModel]:
    """Each entry of `reward_funcs` (one or a list) as something that scores, with its tokenizer from
    `reward_processing_classes` for reward models."""
    listed = list(reward_funcs) if isinstance(reward_funcs, (list, tuple)) else [reward_funcs]
    tokenizers = _processing_classes(reward_processing_classes, len(listed))
    return [_source(entry, tokenizer, timeout) for entry, tokenizer in zip(listed, tokenizers)]


def _processing_classes(given: Any, count: int) -> Sequence[Any]:
    if given is None:
        return [None] * count
    listed = list(given) if isinstance(given, (list, tuple)) else [given]
    if len(listed) != count:
        raise RewardFunctionError(
            f"reward_processing_classes has {len(listed)} entries for {count} reward functions: the lengths "
            "must match; give one per "
            "reward function (None for a function, or for a model whose own tokenizer to load), or a single "
            "tokenizer for a single reward model"
        )
    return listed


def _source(entry: Any, tokenizer: Any, timeout: float) -> RewardFunction | RewardModel:
    if isinstance(entry, (RewardFunction, RewardModel)):
        return entry
    if isinstance(entry, torch.nn.Module):  # before callable(): a module is callable
        return RewardModel(entry, tokenizer)
    if isinstance(entry, (str, Path)):
        path = Path(entry)
        if path.is_dir():
            if not (path / "config.json").is_file():
                raise RewardFunctionError(
                    f"reward {str(entry)!r}: a directory without config.json; a reward model's directory is "
                    "one written by save_pretrained, a reward function is given as FILE.py:FUNCTION"
                )
            return load_reward_model(path, tokenizer)
        if str(entry).rpartition(":")[0].endswith(".py"):
            return RewardFunction(str(entry), timeout)
        raise RewardFunctionError(
            f"reward {str(entry)!r}: neither a directory holding a reward model (saved with save_pretrained) "
            "nor FILE.py:FUNCTION naming a reward function (e.g. rewards.py:score)"
        )
    if callable(entry):
        return RewardFunction(entry, timeout)
    raise RewardFunctionError(
        f"reward_funcs: {type(entry).__name__} {repr(entry)[:60]} is not a reward function; give a callable, "
        "FILE.py:FUNCTION, a reward model's directory or a loaded sequence classifier"
    )
