"""The timer every measurement of `bench` shares, and the machine's ceilings measured with it in the same run.

Ceilings: the copy bandwidth (a device-to-device copy of a buffer far larger than the last-level cache, read and
write both counted) and the matmul rate (a large square matmul in the training dtype). Kernels report their share of
these, so a row reads "this kernel moves 80% of what a plain copy can" on any machine.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

Thunk = Callable[[], Any]


@dataclass(frozen=True)
class Timing:
    ms: float  # device time per call (GPU: CUDA events around back-to-back calls); on CPU the host time
    cpu_us: float  # host time per call: launching on a GPU (no synchronisation inside the loop), the work on CPU


class Timer:
    """Time per call of a thunk after `warmup` untimed calls.

    GPU: `iters` calls back to back between one pair of CUDA events, so a call's time excludes the launch gaps
    between calls that a lone call would show; the host time of the same loop (nothing synchronises inside it) is
    the CPU cost of launching. The median of GPU_GROUPS such loops. CPU: the median of `iters` calls timed one by
    one (robust to a neighbour's burst on a shared machine); the host time is the work itself."""

    GPU_GROUPS = 3

    def __init__(self, cuda: bool, warmup: int, iters: int) -> None:
        self.cuda, self.warmup, self.iters = cuda, warmup, iters

    def __call__(self, fn: Thunk) -> float:
        """Milliseconds per call (Timing.ms)."""
        return self.measure(fn).ms

    def measure(self, fn: Thunk) -> Timing:
        for _ in range(self.warmup):
            fn()
        if not self.cuda:
            samples = []
            for _ in range(self.iters):
                t0 = time.perf_counter()
                fn()
                samples.append((time.perf_counter() - t0) * 1e3)
            ms = statistics.median(samples)
            return Timing(ms, ms * 1e3)
        groups = [self._back_to_back(fn) for _ in range(self.GPU_GROUPS)]
        return Timing(statistics.median(g.ms for g in groups), statistics.median(g.cpu_us for g in groups))

    def _back_to_back(self, fn: Thunk) -> Timing:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()  # the queue is empty: the loop's host time is its launches alone
        t0 = time.perf_counter()
        start.record()
        for _ in range(self.iters):
            fn()
        end.record()
        host_s = time.perf_counter() - t0
        torch.cuda.synchronize()
        return Timing(start.elapsed_time(end) / self.iters, host_s * 1e6 / self.iters)


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
