"""The timer every measurement of `bench` shares, and the machine's ceilings measured with it in the same run.

Ceilings: the copy bandwidth (a device-to-device copy of a buffer far larger than the last-level cache, read and
write both counted) and the matmul rate (a large square matmul in the training dtype). Kernels report their share of
these, so a row reads "this kernel moves 80% of what a plain copy can" on any machine.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

Thunk = Callable[[], Any]


class Timer:
    """Median milliseconds per call over `iters` calls after `warmup` untimed ones (CUDA events on GPUs)."""

    def __init__(self, cuda: bool, warmup: int, iters: int) -> None:
        self.cuda, self.warmup, self.iters = cuda, warmup, iters

    def __call__(self, fn: Thunk) -> float:
        for _ in range(self.warmup):
            fn()
        samples = []
        for _ in range(self.iters):
            if self.cuda:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                end.record()
                torch.cuda.synchronize()
                samples.append(start.elapsed_time(end))
            else:
                t0 = time.perf_counter()
                fn()
                samples.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(samples)


def machine_ceilings(timer: Timer, device: torch.device, dtype: torch.dtype, *, small: bool) -> dict[str, Any]:
    """{"copy_gbps", "matmul_tflops", "matmul_dtype"}, measured now. `small`: sizes for a smoke run."""
    if small:
        n, m = 1 << 16, 128
    elif device.type == "cuda":
        n, m = 1 << 28, 8192  # 1 GiB of fp32: far past any L2; 8192^3 keeps the tensor cores busy
    else:
        n, m = 1 << 24, 1024  # 64 MiB: past a CPU's last-level cache; a 1024^3 fp32 matmul is ~0.1 s on one core
    src, dst = torch.randn(n, device=device), torch.empty(n, device=device)
    copy_ms = timer(lambda: dst.copy_(src))
    a, b = (torch.randn(m, m, device=device, dtype=dtype) for _ in range(2))
    mm_ms = timer(lambda: a @ b)
    return {
        "copy_gbps": 2 * src.nbytes / copy_ms / 1e6,  # bytes/ms -> GB/s
        "matmul_tflops": 2 * m**3 / mm_ms / 1e9,  # FLOP/ms -> TFLOP/s
        "matmul_dtype": str(dtype).removeprefix("torch."),
    }
