import pytest
import torch

from fastes.generation import generate, generate_in_chunks
from fastes.models import build_tiny_model, build_tokenizer, load_model, tiny_model_path

PROMPTS = ["12+34=", "7*8=", "(1+2)*3=", "a b c"]


@pytest.fixture(scope="module")
def model_and_tok():
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = build_tiny_model().eval()
    return model, build_tokenizer()


def test_greedy_is_deterministic_and_matches_manual_argmax(model_and_tok):
    model, tok = model_and_tok
    steps = 4
    out = generate(model, tok, PROMPTS[:1], max_new_tokens=steps)
    assert out.completion_ids == generate(model, tok, PROMPTS[:1], max_new_tokens=steps).completion_ids

    ids = tok(PROMPTS[0], return_tensors="pt")["input_ids"]
    manual = []
    with torch.no_grad():
        for _ in range(steps):
            nxt = model(ids).logits[0, -1].argmax().item()
            manual.append(nxt)
            if nxt == tok.eos_token_id:
                break
            ids = torch.cat([ids, torch.tensor([[nxt]])], dim=1)
    assert out.completion_ids == [manual]
    assert out.texts == [tok.decode(manual, skip_special_tokens=True)]
    assert out.prompt_ids == [tok(PROMPTS[0])["input_ids"]]
    assert out.num_tokens == len(manual) and out.lengths == [len(manual)]


def test_sampling_same_seed_same_text_different_seed_differs(model_and_tok):
    model, tok = model_and_tok
    kw = dict(max_new_tokens=6, temperature=1.0, num_return_sequences=3)
    torch.manual_seed(123)
    before = torch.random.get_rng_state()
    a = generate(model, tok, PROMPTS, seed=1, **kw)
    assert torch.equal(torch.random.get_rng_state(), before)  # the caller's RNG is untouched
    b = generate(model, tok, PROMPTS, seed=1, **kw)
    c = generate(model, tok, PROMPTS, seed=2, **kw)
    assert a.texts == b.texts and a.completion_ids == b.completion_ids
    assert a.texts != c.texts
    assert len(a.texts) == len(PROMPTS) * 3
    # rows are grouped by prompt: sample j of prompt i is row 3 * i + j
    assert a.prompt_ids[3:6] == [tok(PROMPTS[1])["input_ids"]] * 3
    # without a seed the global RNG is used and advanced, so two calls differ
    assert generate(model, tok, PROMPTS, **kw).texts != generate(model, tok, PROMPTS, **kw).texts


def test_top_p_tiny_is_greedy(model_and_tok):
    model, tok = model_and_tok
    greedy = generate(model, tok, PROMPTS, max_new_tokens=8)
    nucleus = generate(model, tok, PROMPTS, max_new_tokens=8, temperature=1.0, top_p=1e-6, seed=0)
    assert nucleus.completion_ids == greedy.completion_ids


def test_left_padding_does_not_change_the_completion(model_and_tok):
    model, tok = model_and_tok
    short = "7*8="
    alone = generate(model, tok, [short], max_new_tokens=10)
    batch = generate(model, tok, ["(12+34)*(56-7)=", short, "1+2+3+4+5+6="], max_new_tokens=10)
    assert batch.completion_ids[1] == alone.completion_ids[0]
    assert batch.texts[1] == alone.texts[0]


def test_stops_at_eos_and_strips_special_tokens():
    # the shipped checkpoint was trained to end each solution with <eos>
    from fastes.tasks import get_task

    model, tok = load_model(tiny_model_path())
    examples = get_task("countdown", seed=0).split("test")[:8]
    out = generate(model, tok, [ex.prompt for ex in examples], max_new_tokens=40)
    assert all(ids[-1] == tok.eos_token_id for ids in out.completion_ids)
    assert all(n < 40 for n in out.lengths)
    # the text is the completion minus its <eos>, and no prompt
    assert out.texts == [tok.decode(ids[:-1]) for ids in out.completion_ids]


def test_bad_arguments(model_and_tok):
    model, tok = model_and_tok
    with pytest.raises(ValueError, match="temperature"):
        generate(model, tok, PROMPTS, max_new_tokens=2, temperature=-1.0)
    with pytest.raises(ValueError, match="identical"):
        generate(model, tok, PROMPTS, max_new_tokens=2, num_return_sequences=2)


def _suggesting(config, **settings):
    """A copy of a generation config with the settings a real checkpoint might suggest."""
    return type(config)(**{**config.to_dict(), **settings})


def _first_token_distribution(model, tok, prompt, temperature):
    with torch.no_grad():
        logits = model(**tok([prompt], return_tensors="pt")).logits[0, -1]
    return torch.softmax(logits.double() / temperature, dim=-1)


@pytest.mark.parametrize("temperature,top_p", [(1.0, 1.0), (0.7, 1.0), (1.0, 0.5)])
def test_samples_come_from_the_softmax_whatever_the_checkpoint_suggests(model_and_tok, temperature, top_p):
    """A checkpoint's generation_config (top_k, repetition_penalty, suppress_tokens) must not leak in, and
    there is no default top_k = 50: the tiny vocabulary's 55 near-uniform tokens would lose ~9% of mass."""
    model, tok = model_and_tok
    saved = model.generation_config
    model.generation_config = _suggesting(saved, top_k=1, repetition_penalty=5.0, suppress_tokens=[9])
    try:
        n = 8000
        out = generate(
            model,
            tok,
            ["cd 1 2"],
            max_new_tokens=1,
            temperature=temperature,
            top_p=top_p,
            seed=3,
            num_return_sequences=n,
        )
    finally:
        model.generation_config = saved
    expected = _first_token_distribution(model, tok, "cd 1 2", temperature)
    if top_p < 1:  # the nucleus: the most likely tokens until their mass reaches top_p
        sorted_p, order = expected.sort(descending=True)
        keep = (sorted_p.cumsum(0) - sorted_p) < top_p
        expected = torch.zeros_like(expected).scatter(0, order, sorted_p * keep)
        expected /= expected.sum()
    counts = torch.bincount(torch.tensor([ids[0] for ids in out.completion_ids]), minlength=len(expected))
    empirical = counts.double() / n
    assert 0.5 * (empirical - expected).abs().sum() < 0.04  # total variation; ~0.02 is sampling noise
    assert counts[expected == 0].sum() == 0  # nothing outside the nucleus
    assert (counts[expected > 0.005] > 0).all()  # every likely token is drawn, token 9 included
    assert expected[9] > 0.005 or top_p < 1


def test_a_row_samples_the_same_whatever_else_is_in_the_batch(model_and_tok):
    model, tok = model_and_tok
    kw = dict(max_new_tokens=6, temperature=1.0, seed=11, num_return_sequences=3)
    whole = generate(model, tok, PROMPTS, **kw)
    first = generate(model, tok, PROMPTS[:2], **kw)
    second = generate(model, tok, PROMPTS[2:], first_row=6, **kw)  # rows 6.. of the whole batch
    assert first.completion_ids + second.completion_ids == whole.completion_ids


@pytest.mark.parametrize("rows_per_call", [1, 4, 5, 100])
def test_generating_in_chunks_equals_one_call(model_and_tok, rows_per_call):
    model, tok = model_and_tok
    kw = dict(max_new_tokens=6, temperature=1.0, seed=11, num_return_sequences=3)
    whole = generate(model, tok, PROMPTS, **kw)
    chunked = generate_in_chunks(model, tok, PROMPTS, rows_per_call=rows_per_call, **kw)
    assert chunked == whole
    later = generate_in_chunks(model, tok, PROMPTS[1:], rows_per_call=rows_per_call, first_row=3, **kw)
    assert later.completion_ids == whole.completion_ids[3:]


def test_greedy_ignores_the_checkpoints_penalties(model_and_tok):
    model, tok = model_and_tok
    plain = generate(model, tok, PROMPTS, max_new_tokens=8)
    saved = model.generation_config
    model.generation_config = _suggesting(saved, repetition_penalty=50.0, no_repeat_ngram_size=1)
    try:
        suggested = generate(model, tok, PROMPTS, max_new_tokens=8)
    finally:
        model.generation_config = saved
    assert suggested.completion_ids == plain.completion_ids
    assert any(len(set(ids)) < len(ids) for ids in plain.completion_ids)  # repeats exist to penalise
