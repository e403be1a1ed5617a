"""fastes.engine.cpu_memory: a CPU generation's freed memory is kept for its next tensors (no page
faults for memory it already had), unless the user tuned the allocator or opted out."""

import os
import subprocess
import sys

import pytest
import torch

from fastes.engine import cpu_memory
from fastes.models.generation import generate
from fastes.models.loading import build_tiny_model, build_tokenizer

glibc = pytest.mark.skipif(
    not cpu_memory.runs_glibc(),
    reason="the setting is glibc's malloc's (other C libraries are left alone)",
)

# Allocate, write and free a 64 MiB tensor (above every mmap threshold glibc picks by itself) sixteen
# times and count each round's page faults: the memory a freed tensor leaves behind is either kept (no
# faults once the heap holds enough free blocks) or given back and faulted in again (one fault per page).
_ROUNDS = 16
_PROBE = f"""
import resource, torch
from fastes.engine import cpu_memory
kept = cpu_memory.keep_freed_memory()
faults = []
for _ in range({_ROUNDS}):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    t = torch.empty(16 * 2**20)
    t.fill_(1.0)
    del t
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(kept, *faults)
"""


def _probe(**env: str) -> tuple[bool, list[int]]:
    """(whether the setting took effect, each round's page faults) in a fresh process, its environment
    this one's without glibc's malloc variables, plus `env`."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("MALLOC_", "GLIBC_TUNABLES"))}
    clean.pop("FASTES_KEEP_FREED_MEMORY", None)
    done = subprocess.run(
        [sys.executable, "-c", _PROBE], env={**clean, **env}, capture_output=True, text=True, check=True
    )
    kept, *faults = done.stdout.split()
    return kept == "True", [int(f) for f in faults]


def _faulting_rounds(faults: list[int], first: int = 0) -> int:
    """How many rounds from round `first` on faulted in at least half as many pages as round 0, whose
    tensor is fresh memory (16384 faults in 4 KiB pages; fewer where the kernel backs it with huge pages)."""
    return sum(f >= faults[0] // 2 for f in faults[first:])


@glibc
def test_freed_memory_is_reused_without_page_faults():
    kept, kept_faults = _probe()
    given_back, faults = _probe(FASTES_KEEP_FREED_MEMORY="0")
    assert kept and not given_back
    assert kept_faults[0] > 0 and faults[0] > 0  # the first round's tensor is fresh memory
    # given back, every round maps fresh pages; kept, the heap grows for the first rounds and then serves
    # them all. How many rounds it grows for depends on what the kernel mapped beside the heap (seen: 1 to
    # 4), so the check is the second half's: none of its rounds faults.
    assert _faulting_rounds(faults) == _ROUNDS, faults
    assert _faulting_rounds(kept_faults, first=_ROUNDS // 2) == 0, kept_faults


@glibc
def test_a_user_tuned_allocator_is_left_alone():
    assert _probe(MALLOC_ARENA_MAX="2")[0] is False
    assert _probe(LD_PRELOAD="libjemalloc.so.2")[0] is False  # not loaded: the name is enough
    assert _probe(FASTES_KEEP_FREED_MEMORY="0")[0] is False


def test_a_cpu_generation_keeps_freed_memory(monkeypatch):
    calls = []
    monkeypatch.setattr(cpu_memory, "keep_freed_memory", lambda: calls.append(1) or True)
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = build_tiny_model().eval()
    generate(model, build_tokenizer(), ["1+2="], max_new_tokens=2)
    assert calls == [1]
