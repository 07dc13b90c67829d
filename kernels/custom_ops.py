"""How a launcher becomes a torch custom op ("bloom::<name>"), the layer torch.compile traces through.

Each kernel module wraps its launchers in `kernel_op`: a `torch.library.custom_op` the dispatcher knows, so
dynamo puts one call of it into the graph instead of breaking the graph at Python it cannot trace, and AOT autograd
differentiates it through `register_autograd` (whose backward is again a kernel op). An op has three bodies:

  the launcher path, for CPU tensors (Triton's interpreter) and CUDA tensors, run on the tensors' own GPU;
  the same path for meta tensors, where inside `kernels.launch.recording` the launchers record their launches
  instead of starting them (what `kernels.aot` compiles); outside a recording nothing sends meta tensors here;
  the fake (`register_fake`): output shapes, dtypes and strides only, what the compiler traces with.

The fake must describe exactly what the launcher path returns (torch.library.opcheck checks it, in
tests/kernels/test_custom_ops.py), so each launcher path returns dense, freshly allocated outputs.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import torch

NAMESPACE = "bloom"

_F = TypeVar("_F", bound=Callable[..., Any])


@contextlib.contextmanager
def on_device(t: torch.Tensor) -> Iterator[None]:
    """Triton launches on the current CUDA device: make it the tensor's, only when it is another one (a context
    switch is a driver call per launch; autograd already runs a backward on its forward's device)."""
    if t.is_cuda and t.device.index is not None and t.device.index != torch.cuda.current_device():
        with torch.cuda.device(t.device):
            yield
    else:
        yield


def kernel_op(name: str, fake: Callable[..., Any]) -> Callable[[_F], Any]:
    """Decorator: the launcher-path function (annotated, as custom_op infers the schema from its signature) as the
    custom op bloom::<name>, with `fake` as its fake and the launcher path also registered for meta tensors."""

    def define(impl: _F) -> Any:
        op = torch.library.custom_op(f"{NAMESPACE}::{name}", mutates_args=())(impl)
        op.register_fake(fake)
        # torch before 2.13 keeps the fake as the Meta kernel and refuses a second one: meta tensors then get the
        # fake's empty outputs, and only kernels.aot's recording (CPU tooling, run on the CPU build) misses the
        # launches. Training never sends meta tensors here.
        with contextlib.suppress(RuntimeError):
            op.register_kernel("meta", impl)
        return op

    return define
