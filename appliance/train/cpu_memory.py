"""CPU ranks keep the memory they free for the next step instead of handing it back to the kernel.

A training step on CPU makes the same large temporaries every step (logits, their softmax, their gradient: for
bloom-tiny-cpu each [8 x 128, 8192] fp32 tensor is 32 MiB). glibc serves blocks of 32 MiB and more from fresh mmap()
pages and unmaps them on free (its threshold adapts only up to 32 MiB), so every step faults those pages in again:
measured on this project's 2-core machine, a fresh exp() over such a tensor took 59 ms against 22 ms once the blocks
stayed in the heap (docs/PERFORMANCE.md, "bench"). Raising the mmap and trim thresholds keeps freed blocks in the
heap, as a caching allocator does on GPUs; the cost is that a rank holds on to its peak heap until it exits.
"""

from __future__ import annotations

import ctypes
import ctypes.util

# mallopt parameters (glibc malloc.h)
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
KEEP_BYTES = 1 << 30  # blocks up to 1 GiB come from the heap, and up to 1 GiB of free heap top is kept


def keep_freed_memory() -> bool:
    """Raise glibc's mmap and trim thresholds for this process; False where the C library is not glibc."""
    name = ctypes.util.find_library("c")
    if name is None:
        return False
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # musl and macOS have no mallopt
        return False
    return bool(mallopt(M_MMAP_THRESHOLD, KEEP_BYTES)) and bool(mallopt(M_TRIM_THRESHOLD, KEEP_BYTES))
