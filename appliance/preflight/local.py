"""The device preflight builds its roles on, beside the one the plan is for.

A role is built where DeepSpeed's accelerator puts a rank of this process: the current GPU, or the CPU. Its bytes
are the rank's on any device of the plan's kind (the same shards, optimizer and kernels); its time is the plan's
only on the GPU model the plan is for (an H200's step says how an H200 runs, not an A100). A plan for GPUs is not
built on a machine without one: the CPU runs other kernels (the torch twins, model/ops.py) and keeps other
activations. A role whose planned bytes exceed what this device has free is not built at all: it is listed as
unchecked with both figures, and the roles whose shards fit are still checked.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from appliance.errors import BadInput
from appliance.planner.runspec import RunSpec

MEMINFO = "/proc/meminfo"


@dataclass(frozen=True)
class LocalDevice:
    kind: str  # "gpu" or "cpu", as the planner's Device.kind
    name: str  # the GPU's name as torch reports it, or "CPU"
    free_bytes: float  # what a role built now may take: the GPU's free memory, or the memory the OS has available

    def runs_like(self, spec: RunSpec) -> bool:
        """Whether a built rank's time here is the plan's: the same kind of device and, on GPUs, the same model
        (the plan names its GPU as the specs table does, e.g. "H100-SXM"; torch as "NVIDIA H100 80GB HBM3")."""
        if self.kind != spec.device.kind:
            return False
        if self.kind == "cpu":
            return True
        return _gpu_family(self.name) == _gpu_family(spec.device.name)


def _gpu_family(name: str) -> str:
    """The model in a GPU's name: "A100", "H100", "H200" (the first word with a digit, without its suffix)."""
    for word in name.upper().replace("-", " ").split():
        if any(c.isdigit() for c in word) and word[0].isalpha():
            return word.rstrip("X").split("PCIE")[0].split("SXM")[0]
    return name.upper()


def local_device() -> LocalDevice:
    """This process's device as preflight builds on it: CUDA's current device when there is one, else the CPU."""
    if torch.cuda.is_available():
        free, _ = torch.cuda.mem_get_info()
        return LocalDevice("gpu", torch.cuda.get_device_name(), float(free))
    return LocalDevice("cpu", "CPU", available_ram_bytes())


def available_ram_bytes(meminfo: str = MEMINFO) -> float:
    """Memory the OS can give a process without swapping: MemAvailable of /proc/meminfo (kB), else psutil's."""
    try:
        with open(meminfo) as lines:
            for line in lines:
                if line.startswith("MemAvailable:"):
                    return float(line.split()[1]) * 1024
    except OSError:
        pass
    import psutil

    return float(psutil.virtual_memory().available)


def check_kind(spec: RunSpec, local: LocalDevice) -> None:
    """BadInput when the plan's ranks are GPUs and this machine has none, or the other way round."""
    if spec.device.kind == local.kind:
        return
    planned = f"{spec.device.name} GPUs" if spec.device.kind == "gpu" else "CPU ranks"
    here = f"a GPU ({local.name})" if local.kind == "gpu" else "no GPU"
    raise BadInput(
        f"preflight: the plan is for {planned} and this machine has {here}: a role built here would run other"
        f" kernels and hold other activations than the plan's ranks; run it on a machine of the plan's kind (the"
        f" SLURM job does, on its first node)"
    )
