import pytest
import torch

from fastes.models.generation import generate, generate_in_chunks
from fastes.models.loading import build_tiny_model, build_tokenizer, load_model, tiny_model_path

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


def test_repeated_prompts_and_completions_are_tokenized_once(model_and_tok, monkeypatch):
    """A population's rows repeat the batch's prompts once per member: each distinct prompt is encoded
    once and each distinct completion decoded once, and the rows are what encoding and decoding every
    row gives, in the rows' order."""
    from fastes.models.generation import decode_texts, encode_prompts

    model, tok = model_and_tok
    rows = [PROMPTS[i] for i in (2, 0, 2, 3, 0, 1, 3, 2)]  # lengths differ: the padding is the longest's
    every_row = tok(rows, return_tensors="pt", padding=True, padding_side="left")
    encoded, decoded = [], []
    encode, decode = type(tok).__call__, type(tok).batch_decode
    monkeypatch.setattr(
        type(tok), "__call__", lambda self, texts, **kw: encoded.append(texts) or encode(self, texts, **kw)
    )
    monkeypatch.setattr(
        type(tok), "batch_decode", lambda self, ids, **kw: decoded.append(ids) or decode(self, ids, **kw)
    )
    enc = encode_prompts(tok, rows)
    assert encoded == [[PROMPTS[2], PROMPTS[0], PROMPTS[3], PROMPTS[1]]]
    assert set(enc) == set(every_row)
    for name in every_row:
        assert torch.equal(enc[name], every_row[name]), name
    completions = [[5, 6, 7], [8], [5, 6, 7], [], [8], [9, 5]]
    texts = decode_texts(tok, completions)
    assert decoded == [[[5, 6, 7], [8], [], [9, 5]]]
    assert texts == [tok.decode(ids, skip_special_tokens=True) for ids in completions]
    out = generate(model, tok, rows, max_new_tokens=5)
    for i, prompt in enumerate(rows):  # each row as it generates alone
        alone = generate(model, tok, [prompt], max_new_tokens=5)
        assert out.completion_ids[i] == alone.completion_ids[0] and out.texts[i] == alone.texts[0]
        assert out.prompt_ids[i] == alone.prompt_ids[0]


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


def test_without_stopping_at_eos_every_row_decodes_max_new_tokens():
    """The benchmarks' equal-work setting: the rows answer as they do when stopping (greedy), then go on."""
    from fastes.tasks import get_task

    model, tok = load_model(tiny_model_path())
    prompts = [ex.prompt for ex in get_task("countdown", seed=0).split("test")[:8]]
    stopped = generate(model, tok, prompts, max_new_tokens=40)
    full = generate(model, tok, prompts, max_new_tokens=40, stop_at_eos=False)
    assert full.lengths == [40] * len(prompts) and full.num_tokens == 40 * len(prompts)
    for short, long in zip(stopped.completion_ids, full.completion_ids, strict=True):
        assert long[: len(short)] == short and short[-1] == tok.eos_token_id


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


# --- top_k, min_p, repetition_penalty -----------------------------------------------------------------


def _transformers_distribution(logits, temperature, top_k=0, top_p=1.0, min_p=None, penalty=1.0, ids=None):
    """softmax of the logits after transformers' own processors, in the order and with the conditions of
    GenerationMixin._get_logits_processor: the repetition penalty, then temperature, top-k, top-p, min-p."""
    from transformers import (
        LogitsProcessorList,
        MinPLogitsWarper,
        RepetitionPenaltyLogitsProcessor,
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    chain = LogitsProcessorList()
    if penalty != 1.0:
        chain.append(RepetitionPenaltyLogitsProcessor(penalty))
    if temperature != 1.0:
        chain.append(TemperatureLogitsWarper(temperature))
    if top_k != 0:
        chain.append(TopKLogitsWarper(top_k))
    if top_p < 1.0:
        chain.append(TopPLogitsWarper(top_p))
    if min_p is not None:
        chain.append(MinPLogitsWarper(min_p))
    if ids is None:
        ids = torch.zeros((logits.shape[0], 0), dtype=torch.long)
    return torch.softmax(chain(ids, logits.clone()), dim=-1)


def _sampler(temperature, top_p=1.0, top_k=0, min_p=None):
    from fastes.models.generation import RowSampler

    return RowSampler(0, temperature, top_p, 0, 0, 1, top_k=top_k, min_p=min_p)


CUTS = [  # (temperature, top_k, top_p, min_p)
    (1.0, 5, 1.0, None),
    (0.7, 1, 1.0, None),
    (1.0, 0, 1.0, 0.2),
    (1.3, 0, 1.0, 0.05),
    (1.0, 0, 1.0, 1.0),
    (0.8, 10, 0.9, None),
    (1.0, 0, 0.8, 0.3),
    (0.6, 20, 0.95, 0.1),
    (1.5, 3, 0.5, 0.5),
]


@pytest.mark.parametrize("temperature,top_k,top_p,min_p", CUTS)
@pytest.mark.parametrize("seed,rows,vocab", [(0, 1, 7), (1, 16, 55), (2, 8, 1000), (3, 4, 32000)])
def test_the_cuts_are_transformers_warpers(temperature, top_k, top_p, min_p, seed, rows, vocab):
    """RowSampler.probabilities is the softmax after transformers' warpers, in transformers' order."""
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, vocab, generator=gen) * 3
    ours = _sampler(temperature, top_p, top_k, min_p).probabilities(logits)
    theirs = _transformers_distribution(logits, temperature, top_k, top_p, min_p)
    assert torch.equal(ours > 0, theirs > 0)  # the same tokens survive
    assert torch.allclose(ours, theirs, atol=1e-6, rtol=1e-5)
    if top_k > 0:
        assert ((ours > 0).sum(-1) <= top_k).all()


def test_the_order_of_the_cuts_matters_and_is_transformers():
    """Cases where another order keeps other tokens, so the comparisons above can tell the orders apart."""
    logits = torch.tensor([[0.4, 0.3, 0.2, 0.1]]).log()

    def kept(probs):
        return (probs[0] > 0).tolist()

    # top-k 2 first renormalises to (0.57, 0.43), whose nucleus at 0.5 is one token; top-p first keeps two
    ours = _sampler(1.0, top_p=0.5, top_k=2).probabilities(logits)
    assert torch.allclose(ours, _transformers_distribution(logits, 1.0, top_k=2, top_p=0.5), atol=1e-6)
    assert kept(ours) == [True, False, False, False]
    top_p_first = _sampler(1.0, top_k=2).probabilities(_sampler(1.0, top_p=0.5).probabilities(logits).log())
    assert kept(top_p_first) == [True, True, False, False]
    # the nucleus at 0.75 first keeps three, min-p 0.3 then drops none; min-p first drops 0.1, and the
    # renormalised nucleus is then two tokens
    ours = _sampler(1.0, top_p=0.75, min_p=0.3).probabilities(logits)
    assert torch.allclose(ours, _transformers_distribution(logits, 1.0, top_p=0.75, min_p=0.3), atol=1e-6)
    assert kept(ours) == [True, True, True, False]
    min_p_first = _sampler(1.0, top_p=0.75).probabilities(
        _sampler(1.0, min_p=0.3).probabilities(logits).log()
    )
    assert kept(min_p_first) == [True, True, False, False]


@pytest.mark.parametrize("top_k,min_p", [(2, None), (3, None), (0, 0.5), (2, 0.9)])
def test_ties_are_kept_as_transformers_keeps_them(top_k, min_p):
    logits = torch.tensor([[1.0, 2.0, 2.0, 2.0, 0.0, 1.0], [5.0, 5.0, 1.0, 1.0, 1.0, 0.0]])
    ours = _sampler(1.0, top_k=top_k, min_p=min_p).probabilities(logits)
    theirs = _transformers_distribution(logits, 1.0, top_k=top_k, min_p=min_p)
    assert torch.equal(ours > 0, theirs > 0)
    assert torch.allclose(ours, theirs, atol=1e-6)


def test_off_cuts_change_nothing():
    """top_k 0 and min_p None or 0 give the very same floats as plain temperature / top-p sampling."""
    gen = torch.Generator().manual_seed(4)
    logits = torch.randn(8, 55, generator=gen)
    for top_p in (1.0, 0.7):
        plain = _sampler(0.9, top_p).probabilities(logits)
        assert torch.equal(_sampler(0.9, top_p, top_k=0, min_p=0.0).probabilities(logits), plain)
        assert torch.equal(_sampler(0.9, top_p, top_k=0, min_p=None).probabilities(logits), plain)


# Completions of the shipped checkpoint sampled before top_k, min_p and repetition_penalty existed.
BEFORE = {
    (1.0, 1.0): [[7, 9, 26, 2], [6, 6, 26, 2], [16, 6, 5, 5, 17, 5], [16, 6, 5, 5, 14, 5]],
    (0.7, 0.9): [[8, 8, 26, 2], [8, 5, 26, 2], [16, 6, 5, 5, 17, 5], [16, 6, 5, 5, 14, 5]],
}


@pytest.fixture(scope="module")
def trained():
    return load_model(tiny_model_path())


@pytest.mark.parametrize("temperature,top_p", list(BEFORE))
def test_samples_are_unchanged_when_the_new_settings_are_off(trained, temperature, top_p):
    model, tok = trained
    kw = dict(max_new_tokens=6, temperature=temperature, top_p=top_p, seed=5, num_return_sequences=2)
    prompts = ["12+34=", "cd 1 2"]
    assert generate(model, tok, prompts, **kw).completion_ids == BEFORE[temperature, top_p]
    off = generate(model, tok, prompts, top_k=0, min_p=0.0, repetition_penalty=1.0, **kw)
    assert off.completion_ids == BEFORE[temperature, top_p]
    # and the cuts do change them
    assert (
        generate(model, tok, prompts, top_k=2, min_p=0.3, **kw).completion_ids != BEFORE[temperature, top_p]
    )


@pytest.mark.parametrize("penalty", [1.5, 0.7])
def test_greedy_repetition_penalty_is_transformers(trained, penalty):
    """Greedy decoding with a repetition penalty gives what transformers' greedy generate gives with it,
    prompts of different lengths in one left-padded batch (the padding is not penalised)."""
    from fastes.tasks import get_task

    model, tok = trained
    prompts = [ex.prompt for ex in get_task("countdown", seed=0).split("test")[:6]] + PROMPTS
    ours = generate(model, tok, prompts, max_new_tokens=24, repetition_penalty=penalty)
    enc = tok(prompts, return_tensors="pt", padding=True, padding_side="left")
    with torch.no_grad():
        out = model.generate(**enc, max_new_tokens=24, do_sample=False, repetition_penalty=penalty)
    theirs = [_cut(row, tok.eos_token_id) for row in out[:, enc["input_ids"].shape[1] :].tolist()]
    assert ours.completion_ids == theirs
    plain = generate(model, tok, prompts, max_new_tokens=24)
    assert ours.completion_ids != plain.completion_ids  # the penalty changed the completions


def _cut(ids, eos):
    return ids[: ids.index(eos) + 1] if eos in ids else ids


def test_sampled_with_every_setting_is_transformers_distribution(trained):
    """8,000 first tokens drawn with a repetition penalty, temperature, top-k, top-p and min-p follow the
    distribution transformers' processors give the model's logits (the prompt's tokens penalised)."""
    from fastes.tasks import get_task

    model, tok = trained
    prompt, n = get_task("countdown", seed=0).split("test")[0].prompt, 8000
    settings = dict(temperature=1.5, top_k=12, top_p=0.95, min_p=0.02)
    out = generate(
        model,
        tok,
        [prompt],
        max_new_tokens=1,
        seed=7,
        num_return_sequences=n,
        repetition_penalty=1.5,
        **settings,
    )
    enc = tok([prompt], return_tensors="pt")
    with torch.no_grad():
        logits = model(**enc).logits[:, -1].float()
    expected = _transformers_distribution(logits, penalty=1.5, ids=enc["input_ids"], **settings)[0].double()
    counts = torch.bincount(torch.tensor([ids[0] for ids in out.completion_ids]), minlength=len(expected))
    empirical = counts.double() / n
    assert 0.5 * (empirical - expected).abs().sum() < 0.04  # total variation; ~0.02 is sampling noise
    assert counts[expected == 0].sum() == 0 and (counts[expected > 0.005] > 0).all()
    unpenalised = _transformers_distribution(logits, **settings)[0].double()
    assert 0.5 * (unpenalised - expected).abs().sum() > 0.2  # the penalty matters here


def test_every_setting_is_reproducible_and_batch_independent(model_and_tok):
    model, tok = model_and_tok
    kw = dict(max_new_tokens=6, temperature=1.0, seed=11, num_return_sequences=3)
    kw.update(top_k=20, top_p=0.95, min_p=0.05, repetition_penalty=1.3)
    whole = generate(model, tok, PROMPTS, **kw)
    assert generate(model, tok, PROMPTS, **kw) == whole
    assert generate(model, tok, PROMPTS, **{**kw, "seed": 12}).completion_ids != whole.completion_ids
    # rows keep their samples whatever else is in the batch (the left padding changes, and is not penalised)
    assert generate_in_chunks(model, tok, PROMPTS, rows_per_call=3, **kw) == whole
    later = generate(model, tok, PROMPTS[3:], first_row=9, **kw)
    assert later.completion_ids == whole.completion_ids[9:]


@pytest.mark.parametrize(
    "settings,message",
    [
        (dict(top_k=-1), "top_k"),
        (dict(top_k=2.5), "top_k"),
        (dict(min_p=1.5), "min_p"),
        (dict(min_p=-0.1), "min_p"),
        (dict(repetition_penalty=0.0), "repetition_penalty"),
        (dict(repetition_penalty=-1.0), "repetition_penalty"),
        (dict(top_p=0.0), "top_p"),
    ],
)
def test_bad_cuts(model_and_tok, settings, message):
    model, tok = model_and_tok
    for temperature in (0.0, 1.0):
        with pytest.raises(ValueError, match=message):
            generate(model, tok, PROMPTS, max_new_tokens=2, temperature=temperature, **settings)


@pytest.mark.parametrize("section", ["es", "grpo"])
def test_config_keys(section):
    from fastes.errors import ConfigError
    from fastes.run.config import load_config

    cfg = load_config(
        None, {f"{section}.top_k": 5, f"{section}.min_p": 0.1, f"{section}.repetition_penalty": 1.2}
    )
    part = getattr(cfg, section)
    assert (part.top_k, part.min_p, part.repetition_penalty) == (5, 0.1, 1.2)
    default = getattr(load_config(None, {}), section)
    assert (default.top_k, default.min_p, default.repetition_penalty) == (0, 0.0, 1.0)  # off
    for key, value, problem in [
        ("top_k", -1, "must be >= 0"),
        ("min_p", 1.5, r"must be in \[0, 1\]"),
        ("min_p", -0.5, r"must be in \[0, 1\]"),
        ("repetition_penalty", 0.0, "must be > 0"),
        ("top_k", 2.0, "must be int"),
    ]:
        with pytest.raises(ConfigError, match=rf"{section}.{key}.*{problem}"):
            load_config(None, {f"{section}.{key}": value})


@pytest.mark.parametrize("algorithm", ["grpo", "es"])
def test_grpo_and_es_hand_the_keys_to_generate(tmp_path, monkeypatch, algorithm):
    """GRPO's sampling (sample_and_score) and ES's members (es_iteration) use the config's settings."""
    from fastes.run import auto_settings, es_loop, grpo_loop
    from fastes.run.config import load_config
    from fastes.run.shared import Run
    from fastes.tasks import get_task

    section = "grpo" if algorithm == "grpo" else "es"
    settings = {"top_k": 7, "min_p": 0.05, "repetition_penalty": 1.25}
    overrides = {
        "algorithm": algorithm,
        "task": "compare",
        "out_dir": str(tmp_path),
        "batch_size": 2,
        "max_new_tokens": 3,
        "progress": False,
        **{f"{section}.{k}": v for k, v in settings.items()},
    }
    if algorithm == "es":
        overrides.update({"es.population": 2, "es.temperature": 1.0, "es.eval_mode": "member"})
    model, tokenizer = load_model(tiny_model_path())
    cfg = auto_settings.resolve(load_config(None, overrides), model, tokenizer)
    run = Run(cfg, model, tokenizer, get_task("compare"), tmp_path)
    calls = []

    def recording(*args, **kwargs):
        calls.append(kwargs)
        return generate(*args, **kwargs)

    module = grpo_loop if algorithm == "grpo" else es_loop
    monkeypatch.setattr(module, "generate", recording)
    if algorithm == "grpo":
        grpo_loop.sample_and_score(run, 0)
    else:
        es_loop.es_iteration(run, es_loop.make_es(run), 0)
    assert calls and all(settings.items() <= call.items() for call in calls)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_the_left_padding_is_not_penalised(model_and_tok, temperature):
    """A row completes the same alone and left-padded next to a longer prompt: the padding is not one of
    the row's tokens for the repetition penalty. (The untrained model gives <pad> logit 0, which no
    penalty changes, so the padding here is "0", a likely next token none of the prompts holds.)"""
    import copy

    model, tok = model_and_tok
    tok = copy.deepcopy(tok)
    tok.pad_token = "0"
    kw = dict(max_new_tokens=8, temperature=temperature, seed=3, repetition_penalty=3.0)
    kw["num_return_sequences"] = rows = 4 if temperature > 0 else 1
    batch = generate(model, tok, ["(12+34)*(56-7)=(12+34)*(56-7)=", *PROMPTS], **kw)
    for i, prompt in enumerate(PROMPTS, start=1):
        alone = generate(model, tok, [prompt], first_row=i * rows, **kw)
        assert batch.completion_ids[i * rows : (i + 1) * rows] == alone.completion_ids
