"""Where an expert's tensors live when they are not on the compute device: host memory and local disk.

An expert travels as one flat dict of named tensors (its parameters, their gradients and AdamW's exp_avg and
exp_avg_sq; `experts/store.py` builds it). The host tier holds a separate copy, pinned when CUDA is there so the
copy back to the GPU can run asynchronously; on a CPU-only machine "device" and "host" are both RAM and the copy
is a plain memcpy, which is what the CPU figures of docs/PERFORMANCE.md measure. The disk tier holds one
safetensors file per expert, written to a temporary name and renamed, so a reader (or a crash) sees the whole file
or the previous one, never half of it.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from appliance.errors import BadInput

Tensors = dict[str, torch.Tensor]


def tensors_bytes(tensors: Tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors.values())


def to_host(tensors: Tensors) -> Tensors:
    """A host copy (never an alias of the device tensors: on CPU `.to("cpu")` would return the same storage)."""
    pin = torch.cuda.is_available()  # pinned memory needs a CUDA driver; on CPU it would raise
    return {name: torch.empty_like(t, device="cpu", pin_memory=pin).copy_(t) for name, t in tensors.items()}


def to_device(tensors: Tensors, device: torch.device) -> Tensors:
    """A device copy of host tensors; from pinned memory the copy is asynchronous on the current stream."""
    return {name: t.to(device, non_blocking=t.is_pinned(), copy=True) for name, t in tensors.items()}


class DiskTier:
    """One safetensors file per expert under `directory`, named by its layer and index."""

    def __init__(self, directory: Path) -> None:
        self.directory = Path(directory)
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise BadInput(f"expert store: cannot create the disk tier directory {self.directory}: {exc}") from exc
        # A new store starts from the weights it is given (a checkpoint's, on resume): expert files an earlier
        # launch left behind are stale, and would only fill the disk.
        for stale in [*self.directory.glob("layer*-expert*.safetensors"), *self.directory.glob("layer*-expert*.tmp")]:
            stale.unlink()

    def path(self, key: tuple[int, int]) -> Path:
        layer, index = key
        return self.directory / f"layer{layer:03d}-expert{index:04d}.safetensors"

    def write(self, key: tuple[int, int], tensors: Tensors) -> None:
        final = self.path(key)
        temporary = final.with_suffix(".tmp")
        save_file({name: t.contiguous() for name, t in tensors.items()}, str(temporary))
        os.replace(temporary, final)  # atomic on one file system: the old file or the new one, never half

    def peek(self, key: tuple[int, int], names: list[str] | None = None) -> Tensors:
        """The expert's tensors (or only `names`) on CPU, leaving the file in place."""
        if names is None:
            return load_file(str(self.path(key)), device="cpu")
        with safe_open(str(self.path(key)), framework="pt", device="cpu") as f:
            return {name: f.get_tensor(name) for name in names}

    def read(self, key: tuple[int, int], device: torch.device) -> Tensors:
        # safetensors reads straight into the target device (no intermediate host copy on CUDA)
        tensors = load_file(str(self.path(key)), device=str(device))
        self.path(key).unlink()  # the expert now lives in exactly one tier
        return tensors
