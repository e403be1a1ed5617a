import pytest
import torch
from transformers import AutoModelForCausalLM

from fastes.models.generation import generate
from fastes.models.loading import (
    MODEL_SIZES,
    build_tiny_model,
    build_tokenizer,
    format_prompt,
    load_model,
    num_params,
    save_model,
    tiny_model_path,
)
from fastes.tasks.base import ALPHABET


def test_tokenizer_round_trips_every_alphabet_char():
    tok = build_tokenizer()
    for ch in ALPHABET:
        ids = tok(ch, add_special_tokens=False)["input_ids"]
        assert len(ids) == 1 and ids[0] != tok.unk_token_id, ch
        assert tok.decode(ids) == ch
    ids = tok(ALPHABET)["input_ids"]
    assert ids[0] == tok.bos_token_id and tok.unk_token_id not in ids
    assert tok.decode(ids, skip_special_tokens=True) == ALPHABET
    assert len(set(ids[1:])) == len(ALPHABET)  # one distinct id per character


def test_tokenizer_pads_left_and_marks_unknown_chars():
    tok = build_tokenizer()
    batch = tok(["1", "123"], padding=True)
    assert batch["input_ids"][0][:2] == [tok.pad_token_id] * 2
    assert batch["attention_mask"][0] == [0, 0, 1, 1]
    assert tok("A", add_special_tokens=False)["input_ids"] == [tok.unk_token_id]


def test_sizes_are_distinct_and_small_is_bigger():
    tiny, small = (num_params(build_tiny_model(s)) for s in ("tiny", "small"))
    assert 2 * tiny <= small <= 4 * tiny
    assert set(MODEL_SIZES) == {"tiny", "small"}
    with pytest.raises(ValueError, match="unknown model size"):
        build_tiny_model("huge")


def test_save_load_round_trip_gives_identical_logits(tmp_path):
    torch.manual_seed(0)
    model, tok = build_tiny_model().eval(), build_tokenizer()
    save_model(model, tok, tmp_path)
    assert {"config.json", "model.safetensors", "generation_config.json", "tokenizer.json"} <= {
        p.name for p in tmp_path.iterdir()
    }
    loaded, loaded_tok = load_model(tmp_path)
    assert loaded_tok.padding_side == "left"
    ids = tok(["12+3=", "ab"], padding=True, return_tensors="pt")
    with torch.no_grad():
        assert torch.equal(model(**ids).logits, loaded(**ids).logits)
        # and through the plain HF entry point too
        auto = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
        assert torch.equal(model(**ids).logits, auto(**ids).logits)
    assert loaded_tok(ALPHABET)["input_ids"] == tok(ALPHABET)["input_ids"]


def test_load_dtype(tmp_path):
    save_model(build_tiny_model(), build_tokenizer(), tmp_path)
    assert load_model(tmp_path, dtype="bf16")[0].dtype == torch.bfloat16
    assert load_model(tmp_path, dtype=torch.float32)[0].dtype == torch.float32
    with pytest.raises(ValueError, match="unsupported dtype"):
        load_model(tmp_path, dtype="int8")
    with pytest.raises(ValueError, match="unsupported dtype"):
        load_model(tmp_path, dtype=torch.int64)


def test_load_errors_are_clear(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_model(tmp_path / "nope")
    with pytest.raises(FileNotFoundError, match="no config.json"):
        load_model(tmp_path)
    model = build_tiny_model()
    model.config.save_pretrained(tmp_path)
    with pytest.raises(FileNotFoundError, match="no .*safetensors"):
        load_model(tmp_path)
    torch.save(model.state_dict(), tmp_path / "pytorch_model.bin")
    with pytest.raises(ValueError, match="pickle"):
        load_model(tmp_path)


def test_format_prompt_uses_chat_template_only_when_present():
    tok = build_tokenizer()
    assert format_prompt(tok, "1+2=") == "1+2="
    tok.chat_template = "{% for m in messages %}<{{ m['content'] }}>{% endfor %}"
    assert format_prompt(tok, "1+2=") == "<1+2=>"


def test_shipped_checkpoint_loads_and_beats_chance():
    from fastes.tasks import get_task, parse_expression

    model, tok = load_model(tiny_model_path())
    task = get_task("countdown", seed=0)
    examples = task.split("test")[:64]
    out = generate(model, tok, [format_prompt(tok, ex.prompt) for ex in examples], max_new_tokens=24)
    scores = [task.score(ex, text) for ex, text in zip(examples, out.texts, strict=True)]
    # an untrained model essentially never solves countdown; the shipped one solves a fair share, and
    # answers either as a valid expression or in the "expression=target;" style of its pretraining mix,
    # each on a fair share of the prompts (a base that post-training can teach the verifiable style)
    answers = [text.partition(";")[0] for text in out.texts]
    styled = [parse_expression(a.partition("=")[0]) is not None and a.count("=") == 1 for a in answers]
    valid = [s.format == 1.0 for s in scores]
    assert sum(v or st for v, st in zip(valid, styled)) / len(scores) > 0.8
    assert 0.2 < sum(styled) / len(scores) < 0.8
    assert sum(s.answer for s in scores) / len(scores) > 0.05
