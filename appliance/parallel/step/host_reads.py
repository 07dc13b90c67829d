"""Counting what makes the host wait for the device, on any device: the ops that read a tensor's value on the host.

On a GPU the host queues kernels and runs ahead; it waits only when it reads a value the device computes: a
scalar (`.item()`, `float(t)`, `bool(t)`, `if t:` all end in `aten._local_scalar_dense`), a data-dependent shape
(`nonzero`, `masked_select`, indexing by a boolean mask), a comparison answered on the host (`aten.equal`,
`is_nonzero`), or a copy to host memory. The same ops run on CPU tensors, so counting them in a CPU test shows the
syncs a GPU step would have (tests/unit/test_host_reads.py has a positive control for each).
`Tensor.tolist()` reads without going through the dispatcher and is counted apart (`tolist` in the counts).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

# Ops whose result the host must wait for, by the name of their schema.
HOST_READ_OPS = frozenset(
    {"aten::_local_scalar_dense", "aten::nonzero", "aten::is_nonzero", "aten::equal", "aten::masked_select"}
)
_COPIES = frozenset({"aten::_to_copy", "aten::copy_"})
# Indexing by a boolean mask sizes its result from the mask's values (on a GPU a nonzero inside the op, which the
# dispatcher does not show on CPU): counted as "boolean_index".
_INDEXING = frozenset({"aten::index", "aten::index_put_", "aten::index_put"})


def _is_mask(index: Any) -> bool:
    return isinstance(index, torch.Tensor) and index.dtype in (torch.bool, torch.uint8)


def _device_of(value: Any) -> torch.device | None:
    return value.device if isinstance(value, torch.Tensor) else None


class HostReadCounter(TorchDispatchMode):
    """Counts host reads by op (see the module docstring), plus device-to-host copies as "device_to_host"."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: Counter[str] = Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        name = func._schema.name
        if name in HOST_READ_OPS:
            self.counts[name] += 1
        elif name in _INDEXING and len(args) > 1 and any(_is_mask(i) for i in args[1]):
            self.counts["boolean_index"] += 1
        out = func(*args, **kwargs)
        if name in _COPIES:
            source = _device_of(args[1]) if name == "aten::copy_" and len(args) > 1 else _device_of(args[0])
            target = _device_of(args[0]) if name == "aten::copy_" else _device_of(out)
            if source is not None and target is not None and source.type != "cpu" and target.type == "cpu":
                self.counts["device_to_host"] += 1
        return out

    @property
    def total(self) -> int:
        return sum(self.counts.values())


@contextmanager
def counting_host_reads() -> Iterator[HostReadCounter]:
    """Count the host reads of the enclosed code (this thread's ops and the autograd engine's on CPU), including
    `Tensor.tolist()` calls."""
    counter = HostReadCounter()
    original = torch.Tensor.tolist

    def tolist(self: torch.Tensor) -> Any:
        counter.counts["tolist"] += 1
        return original(self)

    torch.Tensor.tolist = tolist  # type: ignore[method-assign,assignment]
    try:
        with counter:
            yield counter
    finally:
        torch.Tensor.tolist = original  # type: ignore[method-assign]
