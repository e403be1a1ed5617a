"""PEFT adapters (LoRA and its kin), as TRL's `peft_config` takes them: wrapping the model, what a run
trains, GRPO's KL reference, checkpoints, and loading a saved adapter directory.

With an adapter, the adapter's trainable tensors are the only ones a run changes: GRPO's optimizer holds
them alone, and ES evolves its projection weights (LoRA's lora_A / lora_B: fastes.linear_weights picks
the trainable ones of a PeftModel), under the same noise contract as any other tensor. The base weights
stay bit-identical, so a checkpoint holds the adapter only, and final/ is an adapter directory that
`peft.PeftModel.from_pretrained(base, final)` and fastes.models.loading.load_model both load.

peft is an optional extra (pip install 'fastes[peft]'): nothing here imports it until an adapter is asked
for, and `is_peft_model` never does (a model cannot be a PeftModel unless peft is already imported).
"""

from __future__ import annotations

import hashlib
import json
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from fastes.checkpoint import CheckpointError
from fastes.errors import ConfigError, MissingPackageError
from fastes.es.params import is_peft_model

INSTALL = "pip install 'fastes[peft]'"
ADAPTER_CONFIG = "adapter_config.json"  # what makes a directory a PEFT adapter
# Settings in a PeftConfig that do not change the model: left out of the run's identity.
NOT_IDENTIFYING = ("base_model_name_or_path", "inference_mode", "peft_version", "revision")


def require_peft(what: str = "peft_config") -> Any:
    """The peft module, or one line saying how to install it."""
    try:
        import peft
    except ImportError:
        raise MissingPackageError(f"{what}: needs the peft package; {INSTALL}") from None
    return peft


@contextmanager
def quiet() -> Iterator[None]:
    """Without the FutureWarning that peft's calls into transformers 5 raise on every wrap and load
    (is_gradient_checkpointing): the user can do nothing about it."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing", category=FutureWarning)
        yield


def trainable(model: torch.nn.Module) -> list[tuple[str, torch.nn.Parameter]]:
    """(name, parameter) of every parameter that requires a gradient: an adapter's own tensors."""
    return [(name, p) for name, p in model.named_parameters() if p.requires_grad]


def check_peft_config(peft_config: Any, model: Any) -> None:
    """Refuse, in one line, what fastes cannot train: not a PeftConfig, a model that already carries an
    adapter, or prompt learning (virtual tokens, not weights in the model's layers)."""
    peft = require_peft()
    if not isinstance(peft_config, peft.PeftConfig):
        raise ConfigError(
            f"peft_config: expected a peft.PeftConfig such as peft.LoraConfig(target_modules=[...]), got "
            f"{type(peft_config).__name__}"
        )
    if is_peft_model(model):
        raise ConfigError(
            "peft_config: the model is already a PeftModel; pass peft_config=None to train its adapter, or "
            "pass its base model (model.merge_and_unload()) to train a new one"
        )
    if peft_config.is_prompt_learning:
        raise ConfigError(
            f"peft_config: {type(peft_config).__name__} is prompt learning (learned virtual tokens put "
            "before every input), which fastes cannot train: ES evolves weight matrices and GRPO reads "
            "log-probabilities at the model's own token positions; use an adapter on the model's layers, "
            "e.g. peft.LoraConfig"
        )


def wrap(model: torch.nn.Module, peft_config: Any, seed: int) -> torch.nn.Module:
    """`model` with a new adapter (peft.get_peft_model), initialised from `seed` alone, so that the run
    and its resume (or the trainer before training) make the same starting adapter. The base model's
    directory is recorded as an absolute path, for loading the saved adapter from anywhere."""
    peft = require_peft()
    check_peft_config(peft_config, model)
    cuda = sorted({p.device.index or 0 for p in model.parameters() if p.device.type == "cuda"})
    with torch.random.fork_rng(devices=cuda), quiet():  # the caller's random state is left as it was
        torch.manual_seed(seed)
        wrapped = peft.get_peft_model(model, peft_config)
    for config in wrapped.peft_config.values():
        base = config.base_model_name_or_path
        if base and Path(base).is_dir():
            config.base_model_name_or_path = str(Path(base).resolve())
    return wrapped


def prepare(model: torch.nn.Module, peft_config: Any, seed: int) -> torch.nn.Module:
    """The model a run trains: wrapped with a new adapter when `peft_config` is given; a PeftModel must
    have something to train."""
    if peft_config is not None:
        model = wrap(model, peft_config, seed)
    if is_peft_model(model) and not trainable(model):
        raise ConfigError(
            "model: the PeftModel's adapter is frozen (loaded for inference); load it with "
            "peft.PeftModel.from_pretrained(base, path, is_trainable=True)"
        )
    return model


def fingerprint(model: torch.nn.Module, base: str) -> str:
    """The starting model of a run that trains an adapter: the base model's fingerprint `base`, the
    adapters' settings (lora_alpha changes the model but no tensor) and their starting tensors."""
    digest = hashlib.sha256(base.encode())
    for name, config in sorted(model.peft_config.items()):
        settings = {k: v for k, v in config.to_dict().items() if k not in NOT_IDENTIFYING}
        digest.update(f"\0{name}\0{json.dumps(settings, sort_keys=True, default=_plain)}".encode())
    for name, p in trainable(model):
        tensor = p.detach().cpu().contiguous()
        digest.update(f"\0{name}\0{tensor.dtype}\0{tuple(tensor.shape)}\0".encode())
        digest.update(tensor.view(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def _plain(value: Any) -> Any:
    """JSON for what a PeftConfig holds besides JSON: sets of module names, enums."""
    return sorted(value) if isinstance(value, (set, frozenset)) else str(value)


def base_directory(model_dir: Path) -> Path:
    """The base model's directory of an adapter directory (its adapter_config.json names it); any other
    directory is its own base."""
    if not (model_dir / ADAPTER_CONFIG).is_file():
        return model_dir
    return Path(read_adapter_config(model_dir).get("base_model_name_or_path") or "")


def read_adapter_config(path: Path) -> dict[str, Any]:
    """An adapter directory's adapter_config.json (fastes.models.loading.load_model has checked that it
    is JSON)."""
    return json.loads((path / ADAPTER_CONFIG).read_text(encoding="utf-8"))


# --- checkpoints --------------------------------------------------------------------------------------


def checkpoint_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """What a checkpoint holds of the model: with an adapter its trainable tensors (the base never
    changes), else the whole state dict."""
    if not is_peft_model(model):
        return model.state_dict()
    return {name: p.detach() for name, p in trainable(model)}


def load_checkpoint_state(model: torch.nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Put a checkpoint_state back; an adapter's must name exactly its trainable tensors."""
    if not is_peft_model(model):
        model.load_state_dict(state)
        return
    expected = {name for name, _ in trainable(model)}
    if set(state) != expected:
        missing, extra = sorted(expected - set(state)), sorted(set(state) - expected)
        raise CheckpointError(
            f"the checkpoint does not hold this adapter's tensors ({len(missing)} missing, e.g. "
            f"{missing[:1]}; {len(extra)} others, e.g. {extra[:1]}); resume with the same peft_config"
        )
    model.load_state_dict(state, strict=False)


# --- GRPO's KL reference ------------------------------------------------------------------------------


class StartingAdapter:
    """GRPO's KL reference for a model with an adapter: the model as the run started, without a copy.

    A new adapter starts as the identity (LoRA's lora_B is zero), so the reference is the base model:
    the adapter is switched off for the reference's forward passes, as TRL does. An adapter that starts
    elsewhere (a PeftModel trained before, or an initialisation that is not the identity) keeps its
    starting tensors (the adapter's size, not the model's) and they are swapped in for those passes.
    Called like the model: reference(input_ids=..., attention_mask=...).
    """

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        zero_b = [p for name, p in trainable(model) if "lora_B" in name or "lora_embedding_B" in name]
        identity = bool(zero_b) and not any(bool(p.detach().any()) for p in zero_b)
        self.start = None if identity else {name: p.detach().clone() for name, p in trainable(model)}

    @torch.no_grad()
    def __call__(self, **inputs: Any) -> Any:
        if self.start is None:
            with self.model.disable_adapter():
                return self.model(**inputs)
        params = dict(self.model.named_parameters())
        current = {name: params[name].data for name in self.start}
        try:
            for name, tensor in self.start.items():
                params[name].data = tensor
            return self.model(**inputs)
        finally:
            for name, tensor in current.items():
                params[name].data = tensor


# --- ES -----------------------------------------------------------------------------------------------

# The batched evaluation modes (materialised, virtual, lowrank) swap lora_A / lora_B for population
# layers, which compute x A_m^T and h B_m^T as they would any projection's; a LoRA variant (DoRA) also
# reads their weights outside those layers, so only member-by-member evaluation sees its members.


def _has_variant(model: torch.nn.Module) -> bool:
    return any(getattr(module, "lora_variant", None) for module in model.modules())


def auto_eval_mode(model: torch.nn.Module, noise_type: str) -> str | None:
    """es.eval_mode "auto" for a model with an adapter (None: it has none). The population's adapters
    are small, so materialised holds them all at once; low-rank noise keeps its own mode; a LoRA
    variant (DoRA) is evaluated member by member."""
    if not is_peft_model(model):
        return None
    if _has_variant(model):
        return "member"
    return "lowrank" if noise_type == "lowrank" else "materialised"


def check_es(model: torch.nn.Module, eval_mode: str) -> None:
    """Refuse, in one line, an ES evaluation mode that cannot evaluate this adapter's members."""
    if is_peft_model(model) and eval_mode != "member" and _has_variant(model):
        raise ConfigError(
            f"es.eval_mode: {eval_mode!r} evaluates the population through the adapter's lora_A / lora_B "
            "layers, which a LoRA variant (DoRA: use_dora) does not compute through alone; use 'member'"
        )
