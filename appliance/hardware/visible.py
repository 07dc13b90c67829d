"""The GPUs this job may use, out of all those NVML sees on the node.

NVML lists every GPU of the node. A job gets the ones its environment leaves it, applied in this order:
  CUDA_VISIBLE_DEVICES       indices or GPU-/MIG- UUIDs (as `nvidia-smi -L` prints them), in the order CUDA
                             numbers them; set but empty means none
  SLURM_JOB_GPUS             the node's GPU indices SLURM allocated (used when CUDA_VISIBLE_DEVICES is unset)
  SLURM_GPUS_ON_NODE         how many GPUs SLURM allocated on this node
  torch.cuda.device_count()  what the training processes will see, when torch sees CUDA at all
Detection starts one rank per GPU of this list, and the monitor reads power and energy of exactly these devices:
one function for both, so a job given 1 of 8 GPUs neither starts 8 ranks nor is charged for 8 GPUs.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from appliance.errors import BadInput

log = logging.getLogger(__name__)

CUDA_VISIBLE_DEVICES = "CUDA_VISIBLE_DEVICES"
SLURM_JOB_GPUS = "SLURM_JOB_GPUS"
SLURM_GPUS_ON_NODE = "SLURM_GPUS_ON_NODE"
TORCH_DEVICE_COUNT = "torch.cuda.device_count()"


@dataclass(frozen=True)
class VisibleGpu:
    index: int  # NVML's index (nvidia-smi's numbering); for a MIG instance, its parent GPU's
    handle: Any  # the NVML handle of what the job uses: the GPU, or the MIG instance
    mig: bool = False


@dataclass(frozen=True)
class VisibleGpus:
    gpus: tuple[VisibleGpu, ...]  # in CUDA's order: gpus[i] is cuda:i in every process of the job
    node_gpus: int  # how many GPUs NVML sees on the node
    limited_by: tuple[str, ...] = ()  # the variables that brought the count below node_gpus, in the order applied
    notes: tuple[str, ...] = ()


def load_nvml() -> Any | None:
    """pynvml, initialised, or None when the library or the driver is not there."""
    try:
        import pynvml

        pynvml.nvmlInit()
    except Exception:  # ImportError, NVMLError_LibraryNotFound, NVMLError_DriverNotLoaded, ...
        return None
    return pynvml


def visible_gpus(
    nvml: Any, env: Mapping[str, str] | None = None, *, cuda_count: Callable[[], int | None] | None = None
) -> VisibleGpus:
    """The GPUs of this node the job may use. `nvml` is an initialised pynvml-like module; `cuda_count` says how
    many devices torch sees (None: torch has no CUDA; default: ask torch). BadInput when a variable cannot be read
    or names a GPU this node does not have: CUDA itself would silently drop every entry from the bad one on, which
    is the wrong GPU count this function exists to prevent."""
    env = os.environ if env is None else env
    node_gpus = int(nvml.nvmlDeviceGetCount())
    gpus = [VisibleGpu(i, nvml.nvmlDeviceGetHandleByIndex(i)) for i in range(node_gpus)]
    limited_by: list[str] = []
    notes: list[str] = []

    def keep(chosen: Sequence[VisibleGpu], name: str, setting: str) -> list[VisibleGpu]:
        if len(chosen) < len(gpus):
            limited_by.append(name)
            notes.append(f"{setting} leaves {len(chosen)} of {len(gpus)} GPU(s)")
        return list(chosen)

    if CUDA_VISIBLE_DEVICES in env:
        value = env[CUDA_VISIBLE_DEVICES]
        gpus = keep(_cuda_visible(nvml, gpus, value), CUDA_VISIBLE_DEVICES, f"{CUDA_VISIBLE_DEVICES}={value!r}")
    elif env.get(SLURM_JOB_GPUS, "").strip():
        ids = _index_list(env[SLURM_JOB_GPUS], SLURM_JOB_GPUS)
        # SLURM's ids are the node's GPU numbers. Where a device cgroup hides the other GPUs, NVML numbers the
        # allocated ones from 0 and the ids no longer fit: then all NVML sees is the allocation.
        chosen = [gpus[i] for i in ids] if all(i < len(gpus) for i in ids) else gpus[: len(ids)]
        gpus = keep(chosen, SLURM_JOB_GPUS, f"{SLURM_JOB_GPUS}={env[SLURM_JOB_GPUS]!r}")
    if env.get(SLURM_GPUS_ON_NODE, "").strip():
        allocated = _count(env[SLURM_GPUS_ON_NODE], SLURM_GPUS_ON_NODE)
        if allocated > len(gpus):
            notes.append(f"{SLURM_GPUS_ON_NODE}={allocated} but only {len(gpus)} GPU(s) are visible here")
        gpus = keep(gpus[:allocated], SLURM_GPUS_ON_NODE, f"{SLURM_GPUS_ON_NODE}={allocated}")
    if gpus:
        seen = (cuda_count or _torch_cuda_count)()
        if seen is not None:
            gpus = keep(gpus[:seen], TORCH_DEVICE_COUNT, f"{TORCH_DEVICE_COUNT} = {seen}")
    if limited_by:
        notes.append(
            f"this job may use {len(gpus)} of the {node_gpus} GPUs NVML sees here (limited by {', '.join(limited_by)})"
        )
    return VisibleGpus(tuple(gpus), node_gpus, tuple(limited_by), tuple(notes))


def job_gpus(nvml: Any | None) -> tuple[VisibleGpu, ...]:
    """visible_gpus in this process's environment, for a sampler: it never raises, because monitoring must not stop
    a run (detection has already refused a malformed variable, unless the plan came from a hardware file)."""
    if nvml is None:
        return ()
    try:
        return visible_gpus(nvml).gpus
    except Exception as e:
        log.warning("sampling no GPU: %s", e)
        return ()


def _torch_cuda_count() -> int | None:
    try:
        import torch
    except ImportError:
        return None
    return torch.cuda.device_count() if torch.cuda.is_available() else None


def _cuda_visible(nvml: Any, gpus: list[VisibleGpu], value: str) -> list[VisibleGpu]:
    """The devices CUDA_VISIBLE_DEVICES names, in its order.

    Indices are CUDA's, which equal NVML's with CUDA_DEVICE_ORDER=PCI_BUS_ID and, in practice, on a node of identical
    GPUs (the default FASTEST_FIRST order then falls back to the PCI bus order).
    """
    if not value.strip():
        return []  # set but empty: no GPU
    chosen: list[VisibleGpu] = []
    mig: list[tuple[VisibleGpu, str]] | None = None
    for entry in (e.strip() for e in value.split(",")):
        if re.fullmatch(r"-\d+", entry):
            break  # "-1" is the usual way to hide GPUs: CUDA stops at the first entry it cannot use
        if entry.isdigit():
            if int(entry) >= len(gpus):
                raise _bad(value, entry, f"there is no GPU {entry} here ({_seen(len(gpus))})")
            gpu = gpus[int(entry)]
        elif entry.startswith("MIG-GPU-"):
            raise _bad(value, entry, "the MIG-GPU-<uuid>/<gi>/<ci> form of drivers before R470 is not supported")
        elif entry.startswith("GPU-"):
            gpu = _by_uuid(value, entry, [(g, _uuid(nvml, g.handle)) for g in gpus])
        elif entry.startswith("MIG-"):
            mig = _mig_devices(nvml, gpus) if mig is None else mig
            gpu = _by_uuid(value, entry, mig)
        else:
            raise _bad(value, entry, "an entry must be a GPU index, a GPU-<uuid> or a MIG-<uuid>")
        if gpu in chosen:
            raise _bad(value, entry, "it names a device already listed")
        chosen.append(gpu)
    return chosen


def _by_uuid(value: str, entry: str, devices: list[tuple[VisibleGpu, str]]) -> VisibleGpu:
    exact = [gpu for gpu, uuid in devices if uuid == entry]
    # CUDA also takes a unique prefix of a UUID.
    matches = exact or [gpu for gpu, uuid in devices if uuid.startswith(entry)]
    if len(matches) != 1:
        what = "matches no device" if not matches else f"matches {len(matches)} devices"
        raise _bad(value, entry, f"it {what} here (`nvidia-smi -L` lists the UUIDs)")
    return matches[0]


def _mig_devices(nvml: Any, gpus: list[VisibleGpu]) -> list[tuple[VisibleGpu, str]]:
    out = []
    for gpu in gpus:
        try:
            current, _pending = nvml.nvmlDeviceGetMigMode(gpu.handle)
        except Exception:  # NVMLError_NotSupported: a GPU without MIG
            continue
        if current != getattr(nvml, "NVML_DEVICE_MIG_ENABLE", 1):
            continue
        for slot in range(int(nvml.nvmlDeviceGetMaxMigDeviceCount(gpu.handle))):
            try:
                handle = nvml.nvmlDeviceGetMigDeviceHandleByIndex(gpu.handle, slot)
            except Exception:  # NVMLError_NotFound: an empty slot
                continue
            out.append((VisibleGpu(gpu.index, handle, mig=True), _uuid(nvml, handle)))
    return out


def _uuid(nvml: Any, handle: Any) -> str:
    uuid = nvml.nvmlDeviceGetUUID(handle)
    return uuid.decode() if isinstance(uuid, bytes) else str(uuid)


def _index_list(value: str, name: str) -> list[int]:
    """SLURM's GPU id list: "0,2", "0-3", "0-1,4"."""
    ids: list[int] = []
    for part in (p.strip() for p in value.split(",")):
        match = re.fullmatch(r"(\d+)(?:-(\d+))?", part)
        if match is None:
            raise BadInput(f"{name}={value!r}: {part!r} is not a GPU index or a range of them (like 0-3)")
        first, last = int(match.group(1)), int(match.group(2) or match.group(1))
        ids.extend(range(first, last + 1))
    if len(set(ids)) != len(ids):
        raise BadInput(f"{name}={value!r}: a GPU is listed twice")
    return ids


def _count(value: str, name: str) -> int:
    if not value.strip().isdigit():
        raise BadInput(f"{name}={value!r}: expected a GPU count (a whole number)")
    return int(value)


def _seen(count: int) -> str:
    return f"NVML sees {count} GPU(s)" + (f", 0-{count - 1}" if count else "")


def _bad(value: str, entry: str, why: str) -> BadInput:
    return BadInput(
        f"{CUDA_VISIBLE_DEVICES}={value!r}: entry {entry!r} is unusable: {why}. "
        "Set it to indices or UUIDs of this node's GPUs, or unset it."
    )
