"""fastes keeps the memory a CPU generation frees, for its next tensors, instead of handing it back to the
operating system and faulting it in again page by page.

torch allocates its CPU tensors with the C library's malloc. glibc's malloc gives a large block (above a
threshold that it moves between 128 KiB and 32 MiB) pages of its own from the kernel and returns them when
the block is freed, and it returns the free top of its heap beyond a trim threshold. A generation
allocates and frees the same large activations at every layer, so with glibc's defaults each of them can
come back as fresh pages: one page fault for every 4 KiB written. Measured on SmolLM2-135M at the demo's
16 x 16 x 24 on a 2-core AMD EPYC: 0.8-2.3 million page faults per plain batched generation (3-9 GiB
faulted in), 14-16 s, against ~0 faults and 12.9-13.4 s with the setting below; at 8 x 8 x 16 plain
generation settled at ~0 faults but the low-rank population's generation, whose allocations differ,
went on faulting up to 334 thousand pages per generation (docs/results/freed-memory-2026-12-06.md).

`keep_freed_memory` makes glibc serve every allocation from its heap (M_MMAP_MAX 0) and keep the heap's
free top (M_TRIM_THRESHOLD at its largest), so a process keeps what it once used (its peak stays the
same or falls: the blocks are reused, not mapped beside each other) until it exits. fastes' `generate`
calls it on the CPU. Left alone: a process whose user tuned glibc's malloc (any MALLOC_*_ variable, or
another allocator preloaded, which those settings do not reach), or that set FASTES_KEEP_FREED_MEMORY=0;
a C library other than glibc.
"""

from __future__ import annotations

import ctypes
import functools
import os
import platform

# mallopt's parameters (glibc's malloc.h)
M_TRIM_THRESHOLD = -1
M_MMAP_MAX = -4
_LARGEST_TRIM_THRESHOLD = 2**31 - 1  # mallopt takes an int


def runs_glibc() -> bool:
    """Whether this process runs on glibc, whose malloc the setting tunes."""
    return platform.system() == "Linux" and platform.libc_ver()[0] == "glibc"


def _user_tuned_malloc() -> bool:
    """Whether this process's user chose its allocator's settings: glibc's tunables (MALLOC_*_ or
    GLIBC_TUNABLES) or a preloaded allocator (jemalloc, tcmalloc, mimalloc)."""
    preloaded = os.environ.get("LD_PRELOAD", "")
    return any(name.startswith("MALLOC_") for name in os.environ) or bool(
        os.environ.get("GLIBC_TUNABLES") or "malloc" in preloaded
    )


@functools.cache  # a process-wide setting: applied once, later calls return the answer
def keep_freed_memory() -> bool:
    """Keep freed memory in this process (see the module's docstring); whether it is in effect."""
    if os.environ.get("FASTES_KEEP_FREED_MEMORY", "1") == "0" or _user_tuned_malloc() or not runs_glibc():
        return False
    mallopt = ctypes.CDLL(None).mallopt
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return mallopt(M_MMAP_MAX, 0) == 1 and mallopt(M_TRIM_THRESHOLD, _LARGEST_TRIM_THRESHOLD) == 1
