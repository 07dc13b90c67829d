"""Does the installed torch fit the plan's hardware? Checked before any rank starts.

A CPU-only torch on a GPU node does not fail: every rank falls back to gloo and the CPU, and a run planned for days
on H100s crawls for months. A CUDA torch that sees fewer GPUs than the plan starts ranks on a node fails only inside
the ranks ("invalid device ordinal"), once per agent restart. Both are decided here, from facts torch states about
itself, and refused with the fix named.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from appliance.errors import BadInput


@dataclass(frozen=True)
class TorchBuild:
    version: str
    cuda: str | None  # torch.version.cuda: None for a CPU-only (or ROCm) build
    hip: str | None  # torch.version.hip: the ROCm build's counterpart
    visible_gpus: int  # torch.cuda.device_count(): what CUDA_VISIBLE_DEVICES leaves this process

    @property
    def has_gpu_support(self) -> bool:
        return self.cuda is not None or self.hip is not None


def installed_torch() -> TorchBuild:
    import torch

    visible = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return TorchBuild(torch.__version__, torch.version.cuda, getattr(torch.version, "hip", None), visible)


def check_torch_for_plan(
    gpus_per_node: int, gpu: str, ranks_per_node: int, source: str, build: TorchBuild | None = None
) -> None:
    """BadInput unless this torch can run `ranks_per_node` ranks on the plan's GPUs (nothing to check on CPU)."""
    if gpus_per_node <= 0:
        return
    build = build or installed_torch()
    if not build.has_gpu_support:
        raise BadInput(
            f"{source}: the plan trains on {gpus_per_node} x {gpu} per node, but the installed torch "
            f"({build.version}) is a CPU-only build, which would train on the CPU. Run ./install.sh on this node "
            "(where nvidia-smi lists a GPU it installs the CUDA build of the pinned torch), or plan for the CPU "
            "with `run --hardware cpu-laptop-2core`"
        )
    if build.visible_gpus < ranks_per_node:
        shown = os.environ.get("CUDA_VISIBLE_DEVICES")
        where = f"CUDA_VISIBLE_DEVICES={shown!r}" if shown is not None else "CUDA_VISIBLE_DEVICES unset"
        raise BadInput(
            f"{source}: the plan starts {ranks_per_node} ranks on this node, one per GPU, but torch "
            f"{build.version} sees {build.visible_gpus} GPU(s) ({where}). Give the job {ranks_per_node} GPUs, "
            "or plan again on this allocation (`run` detects the GPUs the job may use)"
        )
