"""Shared test setup.

The Triton kernels are tested under the interpreter on CPU tensors. TRITON_INTERPRET must be set before
`triton` is first imported, so it is set here, when pytest imports this file (before any test module).
"""

import os
import sys
from pathlib import Path

os.environ["TRITON_INTERPRET"] = "1"
# A model's CPU linear layers take the library's products at the rows their rules give, on every machine,
# so that each test runs the paths it names (fastes.engine.cpu_linear; its own tests set the others)
os.environ["FASTES_CPU_PRODUCTS"] = "library"

import gguf  # noqa: E402  (the test extra installs it, with accelerate, which transformers needs for GGUF)
import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

from fastes.models.loading import build_tiny_model, build_tokenizer  # noqa: E402
from fastes.models.sources import resolve_model  # noqa: E402

# The models under test are tiny: a second thread costs more in synchronisation than it gives, and on a
# shared 2-core machine it makes every test several times slower.
torch.set_num_threads(1)


@pytest.fixture(scope="module")
def tiny():
    """A random-weight model of the built-in tiny architecture and its tokenizer (eval mode).
    test_virtual.py overrides it with a smaller one for its interpreted kernels."""
    torch.manual_seed(0)
    tokenizer = build_tokenizer()
    return build_tiny_model("tiny", tokenizer).eval(), tokenizer


def kernel_llama(**config):
    """A Llama smaller than the built-in tiny one, and its tokenizer, for tests whose interpreted kernels
    run every linear layer as Python; `config` overrides LlamaConfig's settings."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    tokenizer = build_tokenizer()
    settings = dict(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=32,
        tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id,
    )
    return LlamaForCausalLM(LlamaConfig(**{**settings, **config})).eval(), tokenizer


HIDDEN, LAYERS, HEADS, FFN = 16, 2, 2, 32
# A byte-level BPE vocabulary: enough for prompts of digits, lowercase letters and punctuation.
CHARS = [chr(c) for c in range(32, 127)]
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def write_tiny_gguf(path: Path, seed: int = 0) -> Path:
    """A random Llama in GGUF (fp32 tensors, gpt2-style tokenizer with a chat template)."""
    rng = np.random.default_rng(seed)
    tokens = SPECIAL + [c.replace(" ", "\u0120") for c in CHARS] + ["an"]  # one merge: a file has some
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(LAYERS)
    writer.add_context_length(128)
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(FFN)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(HEADS)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_freq_base(10000.0)
    writer.add_vocab_size(len(tokens))
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_types([3] * len(SPECIAL) + [1] * (len(CHARS) + 1))
    writer.add_token_merges(["a n"])
    writer.add_bos_token_id(0)
    writer.add_eos_token_id(2)
    writer.add_pad_token_id(0)
    writer.add_chat_template(TEMPLATE)

    def tensor(name: str, *shape: int) -> None:
        writer.add_tensor(name, (0.1 * rng.standard_normal(shape)).astype(np.float32))

    tensor("token_embd.weight", len(tokens), HIDDEN)
    writer.add_tensor("output_norm.weight", np.ones(HIDDEN, dtype=np.float32))
    for i in range(LAYERS):
        writer.add_tensor(f"blk.{i}.attn_norm.weight", np.ones(HIDDEN, dtype=np.float32))
        writer.add_tensor(f"blk.{i}.ffn_norm.weight", np.ones(HIDDEN, dtype=np.float32))
        for name in ("attn_q", "attn_k", "attn_v", "attn_output"):
            tensor(f"blk.{i}.{name}.weight", HIDDEN, HIDDEN)
        tensor(f"blk.{i}.ffn_gate.weight", FFN, HIDDEN)
        tensor(f"blk.{i}.ffn_up.weight", FFN, HIDDEN)
        tensor(f"blk.{i}.ffn_down.weight", HIDDEN, FFN)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture(scope="session")
def chat_llama(tmp_path_factory) -> Path:
    """A random-weight Llama with a chat template (write_tiny_gguf), converted once into a Hugging Face
    directory as fastes converts any .gguf: the stand-in for SmolLM2 in the real-model plumbing tests."""
    root = tmp_path_factory.mktemp("chat_llama")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("FASTES_CACHE_DIR", str(root / "cache"))
        return resolve_model(str(write_tiny_gguf(root / "chat-llama.gguf")))


# The two noise distributions (docs/noise.md): the per-op tests run for both. Sign arithmetic is exact
# (w * eps and scale * eps are sign flips), so for "rademacher" the interpreted kernels must equal the torch
# reference bit for bit, where Gaussian noise is compared to a tolerance.
NOISE_KINDS = ["gaussian", "rademacher"]


def make_tensors(dtype, seed, shapes):
    """Standard-normal tensors of the given shapes, rounded to `dtype`, from a seeded generator."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=g).to(dtype) for s in shapes]


def bits(tensors):
    """The raw bytes of each tensor: equal bits means equal values, -0.0 and NaN payloads included."""
    return [t.view(-1).view(torch.uint8).clone() for t in tensors]


def ordered(t):
    """Integers in the order of the float values (one step = one ulp) for a 16-bit float tensor."""
    raw = t.view(torch.int16).to(torch.int32)
    return torch.where(raw < 0, -(raw & 0x7FFF), raw)


def correlation(a, b):
    """Pearson correlation of two samples, in float64."""
    a, b = a.double() - a.double().mean(), b.double() - b.double().mean()
    return (a @ b / (a.norm() * b.norm())).item()


def is_timing(key: str) -> bool:
    """Metrics that measure time: different on every run, so left out when two runs are compared."""
    timed = (
        "seconds",
        "tokens_per_second",
        "train_runtime",
        "train_samples_per_second",
        "train_steps_per_second",
    )
    return key in timed or key.startswith("time/")


def python_steps(function, *args):
    """(result, the number of Python lines executed by function(*args), nested calls included): a measure
    of work that does not depend on the machine's load, for bounds that a timing would make flaky."""
    steps = 0

    def count(frame, event, arg):
        nonlocal steps
        steps += event == "line"
        return count

    previous = sys.gettrace()
    sys.settrace(count)
    try:
        result = function(*args)
    finally:
        sys.settrace(previous)
    return result, steps


def linear_reference(x, w, bias, term=None) -> torch.Tensor:
    """x w^T (+ bias) (+ each row's member's sum_j (x . inputs[m, j]) outputs[m, j]) in float64: the
    plain-torch reference of the library's linear products (cpu_library.LowRankTerm)."""
    y = x.double() @ w.double().T
    if bias is not None:
        y = y + bias.double()
    if term is not None:
        for m in range(term.inputs.shape[0]):
            rows = slice(int(term.offsets[m]), int(term.offsets[m + 1]))
            y[rows] += (x[rows].double() @ term.inputs[m].double().T) @ term.outputs[m].double()
    return y


def linear_problem(rows, k, n, seed, with_bias, members=0, rank=1):
    """(x, w, bias or None, LowRankTerm or None): random fp32 operands of a linear layer, and with
    members, a low-rank term whose row groups are cut at random (repeats allowed: some members get no
    rows at all)."""
    from fastes.engine.cpu_library import LowRankTerm

    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k, generator=generator)
    w = torch.randn(n, k, generator=generator)
    bias = torch.randn(n, generator=generator) if with_bias else None
    if not members:
        return x, w, bias, None
    cuts = torch.randint(0, rows + 1, (members - 1,), generator=generator).sort().values
    offsets = torch.cat([torch.tensor([0]), cuts, torch.tensor([rows])])
    inputs = torch.randn(members, rank, k, generator=generator)
    outputs = torch.randn(members, rank, n, generator=generator)
    return x, w, bias, LowRankTerm(inputs, outputs, offsets)


def library_calls(monkeypatch) -> list[str]:
    """The names of the library's products (few_rows_linear, packed_linear, lowrank_term, member_matmul)
    called from now on, in order: where none is called, torch's own ran."""
    from fastes.engine import cpu_library

    taken: list[str] = []
    for name in ("few_rows_linear", "packed_linear", "lowrank_term"):
        real = getattr(cpu_library, name)
        monkeypatch.setattr(
            cpu_library, name, lambda *a, _real=real, _name=name: taken.append(_name) or _real(*a)
        )
    # member_matmul and the population layers' prepared products (MemberMatmul) all run this
    real_call = cpu_library.MemberMatmul.__call__
    monkeypatch.setattr(
        cpu_library.MemberMatmul, "__call__", lambda *a: taken.append("member_matmul") or real_call(*a)
    )
    return taken


def measured_faster(monkeypatch, faster: set[str]) -> list[int]:
    """Replace fastes.engine.cpu_linear's timing with one where the library wins at the products named in
    `faster` (and loses elsewhere); returns the thread counts it is asked for."""
    from fastes.engine import cpu_linear

    asked: list[int] = []

    def measure(threads: int) -> dict:
        asked.append(threads)
        return {
            name: {"library": 1.0 if name in faster else 3.0, "torch": 2.0}
            for name in cpu_linear.Products._fields
        }

    monkeypatch.setattr(cpu_linear, "measure", measure)
    return asked


@pytest.fixture
def fresh_answer(monkeypatch, tmp_path):
    """No remembered answer of fastes.engine.cpu_linear.products, and a cache directory of the test's own
    (the test may set FASTES_CPU_PRODUCTS); the answer forgotten again after."""
    from fastes.engine import cpu_linear

    monkeypatch.setenv("FASTES_CACHE_DIR", str(tmp_path))
    cpu_linear.products.cache_clear()
    yield tmp_path
    cpu_linear.products.cache_clear()


def linear_tolerance(k: int, rank: int = 0) -> dict:
    """fp32 products summed over k (and the term's r products, each itself a sum over k)."""
    return dict(rtol=1e-5, atol=2e-6 * k * (1 + rank * k**0.5))


def hold_after_checkpoint(step: int) -> None:
    """Make this process's `fastes.run.train` hold once it has written checkpoint `step`, for a SIGKILL
    to land there: a tiny run can write its later checkpoints, and delete that one (the newest two are
    kept), between two polls of the test that waits to kill it."""
    import time

    import fastes.run.train as train

    save = train.save_checkpoint

    def held(run_dir, at, *args, **options):
        path = save(run_dir, at, *args, **options)
        if at == step:
            time.sleep(600)
        return path

    train.save_checkpoint = held


def fastes_greedy(
    model, ids: torch.Tensor, mask: torch.Tensor, new_tokens: int, eos: list[int]
) -> torch.Tensor:
    """fastes' greedy tokens (fastes.models.decoding.decode, pad id 0) of left-padded prompts."""
    from fastes.models.decoding import decode

    return decode(
        model,
        ids,
        mask,
        max_new_tokens=new_tokens,
        eos_ids=eos,
        pad_id=0,
        choose=lambda sequences, logits, rows, step: logits.argmax(dim=-1),
    )


def transformers_greedy(
    model, ids: torch.Tensor, mask: torch.Tensor, new_tokens: int, eos: list[int]
) -> torch.Tensor:
    """transformers' greedy generate of the same prompts, padded to new_tokens columns with 0 (the pad id)."""
    import transformers

    config = transformers.GenerationConfig(
        max_new_tokens=new_tokens, do_sample=False, eos_token_id=eos or None, pad_token_id=0
    )
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=mask, generation_config=config)[:, ids.shape[1] :]
    return torch.nn.functional.pad(out, (0, new_tokens - out.shape[1]))
