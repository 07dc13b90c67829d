"""Which GPU a launcher targets, how it starts a kernel, and a recording mode for compiling without a GPU.

Every launcher asks `gpu_target(tensor)` where its kernels run (None: Triton's CPU interpreter), picks its tile
sizes from that through its module's `launch_config`, and starts each kernel with `launch`. Inside
`recording(target)` the launchers run on meta tensors (real shapes and strides, no memory) as if on `target`, and
`launch` keeps each kernel with its exact arguments instead of starting it. `kernels.aot` compiles those records
for sm_80 and sm_90: the configuration and the argument specialisation a real launch gets, from the launcher's
own code.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from functools import cache
from typing import Any

import torch


@dataclass(frozen=True)
class GpuTarget:
    """What a launcher needs to know about its GPU: compute capability (80 for sm_80) and SM count."""

    capability: int
    multiprocessors: int
    name: str = ""


# The GPUs the appliance trains on. SM counts from NVIDIA's architecture whitepapers: A100 SXM4 108 SMs,
# H100 SXM5 132 SMs.
A100 = GpuTarget(capability=80, multiprocessors=108, name="A100")
H100 = GpuTarget(capability=90, multiprocessors=132, name="H100")


@dataclass(frozen=True)
class Launch:
    """One kernel launch as a launcher made it: kernel, grid, positional arguments, keyword options (constexpr
    arguments by name, num_warps, num_stages)."""

    kernel: Any  # a triton JITFunction
    grid: tuple[int, ...]
    args: tuple[Any, ...]
    options: dict[str, Any] = field(default_factory=dict)


@dataclass
class _Recording:
    target: GpuTarget
    launches: list[Launch]


_recording: ContextVar[_Recording | None] = ContextVar("kernel_launch_recording", default=None)


@cache
def _cuda_target(index: int) -> GpuTarget:
    props = torch.cuda.get_device_properties(index)
    return GpuTarget(props.major * 10 + props.minor, props.multi_processor_count, props.name)


def gpu_target(t: torch.Tensor) -> GpuTarget | None:
    """The GPU kernels on `t` run on; None for CPU tensors (the interpreter). Inside `recording`, its target."""
    active = _recording.get()
    if active is not None:
        return active.target
    if not t.is_cuda:
        return None
    return _cuda_target(t.device.index if t.device.index is not None else torch.cuda.current_device())


def compute_capability(t: torch.Tensor) -> int | None:
    """Compute capability of the GPU kernels on `t` run on (80, 90, ...); None for the interpreter."""
    target = gpu_target(t)
    return None if target is None else target.capability


def launch(kernel: Any, grid: tuple[int, ...], *args: Any, **options: Any) -> None:
    """kernel[grid](*args, **options); inside `recording`, only remembered."""
    active = _recording.get()
    if active is None:
        kernel[grid](*args, **options)
    else:
        active.launches.append(Launch(kernel, tuple(grid), args, options))


@contextmanager
def recording(target: GpuTarget) -> Iterator[list[Launch]]:
    """Launchers called inside (on meta tensors) pick their configuration for `target` and record their launches
    into the yielded list instead of running them."""
    if _recording.get() is not None:
        raise RuntimeError("kernels.launch.recording: already recording")
    launches: list[Launch] = []
    token = _recording.set(_Recording(target, launches))
    try:
        yield launches
    finally:
        _recording.reset(token)
