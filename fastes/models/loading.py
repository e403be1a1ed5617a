"""Models and tokenizers: the built-in tiny character-level Llama, and loading any local HF checkpoint.

Every model is a plain Hugging Face causal LM directory (config.json + model.safetensors + tokenizer
files), so the tiny model and a real one go through exactly the same code path.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import SafetensorError
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    GenerationConfig,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedModel,
    PreTrainedTokenizerBase,
    PreTrainedTokenizerFast,
)
from transformers.utils import logging as hf_logging

from fastes.errors import FastesError, MissingFileError
from fastes.tasks.base import ALPHABET

from .adapters import ADAPTER_CONFIG, quiet, read_adapter_config, require_peft

PAD, BOS, EOS, UNK = "<pad>", "<bos>", "<eos>", "<unk>"
SPECIAL_TOKENS = [PAD, BOS, EOS, UNK]

# Built-in model sizes. "small" has ~3x the parameters of "tiny" (for the population-size sweep).
# Tasks are short, so 64 positions are plenty; the vocabulary is ALPHABET plus the special tokens.
MODEL_SIZES: dict[str, dict[str, int]] = {
    "tiny": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=256),
    "small": dict(hidden_size=96, num_hidden_layers=3, num_attention_heads=4, intermediate_size=384),
}
MAX_POSITIONS = 64

# torch dtypes load_model accepts, by name; None keeps the checkpoint's own (as "auto" does).
DTYPES: dict[str, torch.dtype | str] = {
    "auto": "auto",
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}


# A tokenizer needs one of these (fast, sentencepiece, BPE or WordPiece vocabularies).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt")


class ModelError(FastesError, ValueError):
    """A model directory that cannot be used as it is; the message names the file and the fix."""


def build_tokenizer() -> PreTrainedTokenizerFast:
    """A character-level tokenizer over ALPHABET: every character is one token, prompts start with <bos>."""
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS + list(dict.fromkeys(ALPHABET)))}
    tok = Tokenizer(models.WordLevel(vocab, unk_token=UNK))
    # Split into single characters (each one a "word"), and glue them back together when decoding.
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A $B", special_tokens=[(BOS, vocab[BOS])]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token=PAD,
        bos_token=BOS,
        eos_token=EOS,
        unk_token=UNK,
        padding_side="left",  # decoder-only generation appends on the right, so pad on the left
        clean_up_tokenization_spaces=False,  # " ," must decode as " ,", not ","
        model_max_length=MAX_POSITIONS,
    )


def char_llama_config(tokenizer: PreTrainedTokenizerBase, **shape: int) -> LlamaConfig:
    """A Llama config for the character tokenizer; `shape` sets hidden_size, num_hidden_layers, ..."""
    return LlamaConfig(
        vocab_size=len(tokenizer),
        max_position_embeddings=MAX_POSITIONS,
        tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        **shape,
    )


def build_tiny_model(
    size: str = "tiny", tokenizer: PreTrainedTokenizerBase | None = None
) -> LlamaForCausalLM:
    """A freshly initialised small Llama for the character tokenizer; `size` is a key of MODEL_SIZES."""
    if size not in MODEL_SIZES:
        raise ValueError(f"unknown model size {size!r}; choose one of {sorted(MODEL_SIZES)}")
    tokenizer = tokenizer or build_tokenizer()
    model = LlamaForCausalLM(char_llama_config(tokenizer, **MODEL_SIZES[size]))
    model.generation_config = GenerationConfig(
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    return model


def save_model(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, path: str | Path) -> Path:
    """Write a normal HF directory: config.json, model.safetensors, generation_config and tokenizer files.
    A model with a PEFT adapter writes the adapter alone (adapter_config.json, adapter_model.safetensors)
    and the tokenizer: load_model and peft.PeftModel.from_pretrained(base, path) both load it."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    return path


def load_model(
    path: str | Path,
    *,
    dtype: torch.dtype | str | None = None,
    device: str | torch.device = "cpu",
    trust_remote_code: bool = False,
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load a local HF causal LM directory (safetensors weights only) in eval mode, with its tokenizer.

    `dtype` is a torch dtype, one of the names in DTYPES, or None for the checkpoint's own dtype.
    Code shipped inside the checkpoint is never run unless `trust_remote_code=True`.
    """
    path = Path(path)
    if (path / ADAPTER_CONFIG).is_file():  # a PEFT adapter: the final/ of a run with peft_config
        return _load_adapter(path, dtype=dtype, device=device, trust_remote_code=trust_remote_code)
    _check_model_files(path)
    torch_dtype = _resolve_dtype(dtype)
    hf_logging.disable_progress_bar()  # a bar per load is noise next to fastes' own progress
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # its load report would repeat, at length, what ModelError says
    try:
        model, info = AutoModelForCausalLM.from_pretrained(
            path,
            dtype=torch_dtype,
            use_safetensors=True,
            local_files_only=True,
            trust_remote_code=trust_remote_code,
            output_loading_info=True,
            ignore_mismatched_sizes=True,  # reported below with every other mismatch, not as a traceback
        )
    except SafetensorError as error:  # the library's message names neither the file nor the cause
        raise ModelError(
            f"{path}: the safetensors weights cannot be read ({error}); the file is truncated, damaged "
            "or not a safetensors file"
        ) from None
    except (OSError, ValueError, KeyError) as error:
        raise ModelError(f"{path}: transformers cannot load this model ({error})") from None
    finally:
        hf_logging.set_verbosity(verbosity)
    _check_loading_info(path, info)
    return model.to(device).eval(), _load_tokenizer(path, trust_remote_code)


def _load_tokenizer(path: Path, trust_remote_code: bool) -> PreTrainedTokenizerBase:
    try:
        tokenizer = AutoTokenizer.from_pretrained(
            path, local_files_only=True, trust_remote_code=trust_remote_code
        )
    except Exception as error:  # tokenizers raises plain Exceptions for a file it cannot parse
        raise ModelError(
            f"{path}: the tokenizer cannot be loaded ({type(error).__name__}: {error}); copy the tokenizer "
            "files of the model this one was made from"
        ) from None
    if tokenizer.pad_token is None:  # many real tokenizers have none; batching needs one
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def _load_adapter(
    path: Path, *, dtype: torch.dtype | str | None, device: str | torch.device, trust_remote_code: bool
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """A PEFT adapter directory on its base model (adapter_config.json names the base's directory): the
    base loaded as load_model loads any model, then the adapter, trainable, in eval mode. The tokenizer
    is the adapter directory's own when it has one (a run saves it there), else the base's."""
    peft = require_peft(f"{path} is a PEFT adapter directory; loading it")
    try:
        base = read_adapter_config(path).get("base_model_name_or_path")
    except (ValueError, UnicodeDecodeError) as error:
        raise ModelError(f"{path / ADAPTER_CONFIG} is not valid JSON ({error}); restore it") from None
    if not base or not Path(base).is_dir() or (Path(base) / ADAPTER_CONFIG).is_file():
        raise ModelError(
            f"{path}: the adapter's base model {base!r} (base_model_name_or_path in {ADAPTER_CONFIG}) is not "
            "a local model directory; set it to one, or load the base yourself and then "
            f"peft.PeftModel.from_pretrained(base, {str(path)!r})"
        )
    model, tokenizer = load_model(base, dtype=dtype, device=device, trust_remote_code=trust_remote_code)
    try:
        with quiet():
            model = peft.PeftModel.from_pretrained(model, path, is_trainable=True)
    except (OSError, ValueError, KeyError, RuntimeError) as error:
        raise ModelError(f"{path}: peft cannot load this adapter onto {base} ({error})") from None
    if any((path / name).is_file() for name in TOKENIZER_FILES):
        tokenizer = _load_tokenizer(path, trust_remote_code)
    return model.to(device).eval(), tokenizer


def _check_model_files(path: Path) -> None:
    """What can be checked before transformers reads anything: each failure names the file and the fix."""
    if not path.is_dir():
        raise MissingFileError(
            f"model directory {path} does not exist (pass a local HF checkpoint directory)"
        )
    if not (path / "config.json").is_file():
        raise MissingFileError(f"{path} has no config.json, so it is not a Hugging Face model directory")
    if not any(path.glob("*.safetensors")) and not any(path.glob("*.safetensors.index.json")):
        if any(path.glob("*.bin")) or any(path.glob("*.pt")) or any(path.glob("*.pth")):
            raise ModelError(
                f"{path} only has pickle weights (.bin/.pt); they can run arbitrary code when loaded, "
                "so fastes only loads safetensors. Convert them once with a trusted script, "
                "e.g. model.save_pretrained(dir, safe_serialization=True)."
            )
        raise MissingFileError(f"{path} has no *.safetensors weights")
    if not any((path / name).is_file() for name in TOKENIZER_FILES):
        raise MissingFileError(
            f"{path} has no tokenizer files (one of {', '.join(TOKENIZER_FILES)}, with "
            "tokenizer_config.json); copy them from the model this one was made from"
        )
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        if (path / name).is_file():
            try:
                json.loads((path / name).read_text(encoding="utf-8"))
            except (ValueError, UnicodeDecodeError) as error:
                raise ModelError(
                    f"{path / name} is not valid JSON ({error}); restore it from the model's source"
                ) from None


def _check_loading_info(path: Path, info: dict) -> None:
    """Refuse weights that do not fit the architecture in config.json (transformers would fill the gaps
    with random values and carry on)."""
    problems = []
    for kind, keys in (("missing", info["missing_keys"]), ("unexpected", info["unexpected_keys"])):
        keys = sorted(keys)
        if keys:
            shown = ", ".join(keys[:3]) + (", ..." if len(keys) > 3 else "")
            problems.append(f"{len(keys)} {kind} tensors ({shown})")
    mismatched = sorted(info.get("mismatched_keys") or [], key=lambda entry: entry[0])
    if mismatched:
        name, found, expected = mismatched[0][:3]
        problems.append(
            f"{len(mismatched)} tensors of the wrong shape ({name}: {tuple(found)} in the file, "
            f"{tuple(expected)} in config.json)"
        )
    if problems:
        raise ModelError(
            f"{path}: the weights do not match config.json: {'; '.join(problems)}. The weight files and "
            "config.json must come from the same model"
        )


def _resolve_dtype(dtype: torch.dtype | str | None) -> torch.dtype | str:
    if dtype is None:
        return "auto"
    if isinstance(dtype, torch.dtype):
        if dtype not in {torch.float32, torch.bfloat16, torch.float16}:
            raise ModelError(f"unsupported dtype {dtype}; use float32, bfloat16 or float16")
        return dtype
    if dtype not in DTYPES:
        raise ModelError(f"unsupported dtype {dtype!r}; choose one of {sorted(DTYPES)}")
    return DTYPES[dtype]


def tiny_model_path() -> Path:
    """The shipped pretrained tiny checkpoint (fastes/assets/tiny, made by fastes.run.pretrain)."""
    return Path(__file__).parents[1] / "assets" / "tiny"


TEMPLATE_SYSTEM_PROMPT = "<default>"  # system_prompt value that keeps the chat template's own default


def uses_chat_template(tokenizer: PreTrainedTokenizerBase, mode: str = "auto") -> bool:
    """Whether prompts go through the tokenizer's chat template: mode "on", "off", or "auto" (if it has one).

    "on" without a template is an error that names the fix.
    """
    has_template = bool(getattr(tokenizer, "chat_template", None))
    if mode == "on" and not has_template:
        raise ModelError(
            "chat_template = 'on', but the tokenizer has no chat template; set it to auto or off"
        )
    return mode == "on" or (mode == "auto" and has_template)


def format_prompt(
    tokenizer: PreTrainedTokenizerBase,
    prompt: str | list[dict[str, str]],
    *,
    chat_template: str = "auto",
    system_prompt: str = "",
) -> str:
    """The text to feed the model: `prompt` (text, or a list of {"role", "content"} chat messages) in the
    chat template when it is used (see uses_chat_template); else text as is.

    `system_prompt` "" means none: a template that inserts a default system prompt when the messages have
    none (SmolLM2's, ~20 tokens of every prompt) gets an empty system turn instead, whichever is shorter.
    TEMPLATE_SYSTEM_PROMPT keeps the template's default; any other text becomes the system turn.
    """
    if not uses_chat_template(tokenizer, chat_template):  # messages: their contents, one per line
        return prompt if isinstance(prompt, str) else "\n".join(m["content"] for m in prompt)
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
    has_system = messages and messages[0].get("role") == "system"

    def render(turns: list[dict[str, str]]) -> str:
        return tokenizer.apply_chat_template(turns, tokenize=False, add_generation_prompt=True)

    if has_system or system_prompt == TEMPLATE_SYSTEM_PROMPT:
        return render(messages)
    if system_prompt:
        return render([{"role": "system", "content": system_prompt}, *messages])
    plain = render(messages)
    try:
        empty_system = render([{"role": "system", "content": ""}, *messages])
    except Exception:  # a template without a system role (it raises its own error types)
        return plain
    return empty_system if len(empty_system) < len(plain) else plain


def is_character_tokenizer(tokenizer: PreTrainedTokenizerBase) -> bool:
    """Whether `tokenizer` is the built-in character tokenizer (or one like it): every token a special
    token or a character of ALPHABET, so prompts must be written in that alphabet."""
    allowed = set(SPECIAL_TOKENS) | set(ALPHABET)
    return set(tokenizer.get_vocab()) <= allowed


def num_params(model: torch.nn.Module) -> int:
    """Number of distinct parameters (tied embeddings counted once)."""
    return sum(p.numel() for p in model.parameters())
