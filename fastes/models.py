"""Models and tokenizers: the built-in tiny character-level Llama, and loading any local HF checkpoint.

Every model is a plain Hugging Face causal LM directory (config.json + model.safetensors + tokenizer
files), so the tiny model and a real one go through exactly the same code path.
"""

from __future__ import annotations

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

from fastes.tasks.base import ALPHABET

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
    """Write a normal HF directory: config.json, model.safetensors, generation_config and tokenizer files."""
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
    if not path.is_dir():
        raise FileNotFoundError(
            f"model directory {path} does not exist (pass a local HF checkpoint directory)"
        )
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"{path} has no config.json, so it is not a Hugging Face model directory")
    if not any(path.glob("*.safetensors")) and not any(path.glob("*.safetensors.index.json")):
        if any(path.glob("*.bin")) or any(path.glob("*.pt")) or any(path.glob("*.pth")):
            raise ValueError(
                f"{path} only has pickle weights (.bin/.pt); they can run arbitrary code when loaded, "
                "so fastes only loads safetensors. Convert them once with a trusted script, "
                "e.g. model.save_pretrained(dir, safe_serialization=True)."
            )
        raise FileNotFoundError(f"{path} has no *.safetensors weights")
    torch_dtype = _resolve_dtype(dtype)
    hf_logging.disable_progress_bar()  # a bar per load is noise next to fastes' own progress

    try:
        model = AutoModelForCausalLM.from_pretrained(
            path,
            dtype=torch_dtype,
            use_safetensors=True,
            local_files_only=True,
            trust_remote_code=trust_remote_code,
        )
    except SafetensorError as error:  # the library's message names neither the file nor the cause
        raise ValueError(
            f"{path}: the safetensors weights cannot be read ({error}); the file is truncated, damaged "
            "or not a safetensors file"
        ) from None
    tokenizer = AutoTokenizer.from_pretrained(
        path, local_files_only=True, trust_remote_code=trust_remote_code
    )
    if tokenizer.pad_token is None:  # many real tokenizers have none; batching needs one
        tokenizer.pad_token = tokenizer.eos_token
    return model.to(device).eval(), tokenizer


def _resolve_dtype(dtype: torch.dtype | str | None) -> torch.dtype | str:
    if dtype is None:
        return "auto"
    if isinstance(dtype, torch.dtype):
        if dtype not in {torch.float32, torch.bfloat16, torch.float16}:
            raise ValueError(f"unsupported dtype {dtype}; use float32, bfloat16 or float16")
        return dtype
    if dtype not in DTYPES:
        raise ValueError(f"unsupported dtype {dtype!r}; choose one of {sorted(DTYPES)}")
    return DTYPES[dtype]


def tiny_model_path() -> Path:
    """The shipped pretrained tiny checkpoint (fastes/assets/tiny, made by fastes.pretrain)."""
    return Path(__file__).parent / "assets" / "tiny"


def format_prompt(tokenizer: PreTrainedTokenizerBase, prompt: str) -> str:
    """The text to feed the model: `prompt` in the chat template if the tokenizer has one, else as is."""
    if getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True
        )
    return prompt


def num_params(model: torch.nn.Module) -> int:
    """Number of distinct parameters (tied embeddings counted once)."""
    return sum(p.numel() for p in model.parameters())
