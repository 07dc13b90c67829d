"""Detect the machine: GPUs through NVML, fabric ports and Ethernet through /sys, CPU and RAM through psutil, and
the SLURM allocation from its environment.

Every probe is allowed to fail: a laptop has no NVML, a container has no /sys/class/infiniband, most shells have no
SLURM. A failed probe becomes a note in the result and detection goes on; `detect()` never raises for the machine
it runs on, only for a variable that names GPUs it does not have (BadInput). The GPUs are those the job may use
(hardware/visible.py), not all the node's. The /sys root, the environment, the NVML module and torch's device count
are parameters so tests can fake each of them.
"""

from __future__ import annotations

import importlib
import os
import re
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from appliance.errors import BadInput
from appliance.hardware.profile import (
    NO_GPU,
    EthernetLink,
    FabricPort,
    GpuDevice,
    Hardware,
    SlurmAllocation,
)
from appliance.hardware.specs import FABRIC_GBPS, GIB, LOOPBACK_GBPS, match_nvml_name
from appliance.hardware.visible import VisibleGpu, VisibleGpus, visible_gpus

NVLINK3_GBS_PER_LINK_PER_DIRECTION = 25.0  # A100 NVLink 3: 50 GB/s per link, both directions together


def detect(
    *,
    sys_root: str | Path = "/sys",
    env: Mapping[str, str] | None = None,
    nvml: Any | None = None,
    cuda_count: Callable[[], int | None] | None = None,
) -> Hardware:
    """The hardware this process runs on. `nvml` is a pynvml-like module (imported when None); `cuda_count` says how
    many devices torch sees (None: ask torch)."""
    env = os.environ if env is None else env
    root = Path(sys_root)
    notes: list[str] = []

    visible, gpus = _probe_gpus(nvml, env, cuda_count, notes)
    ib_ports, opa_ports = _probe_fabric(root, notes)
    ethernet = _probe_ethernet(root, notes)
    cpu_cores, ram_gb = _probe_cpu(notes)
    slurm = _probe_slurm(env, notes)

    nodes = slurm.nodes if slurm else 1
    gpu, gpu_memory_gb, gpus_per_node, spec = NO_GPU, 0.0, 0, None
    if gpus:
        gpus_per_node = len(gpus)
        spec = match_nvml_name(gpus[0].name)
        gpu = spec.name if spec else gpus[0].name.removeprefix("NVIDIA ").strip()
        gpu_memory_gb = round(min(g.memory_gb for g in gpus), 1)
        if spec is None:
            notes.append(f"GPU {gpus[0].name!r} is not in the specs table: the planner cannot rate it")
        if len({g.name for g in gpus}) > 1:
            notes.append(f"mixed GPU models on this node: {sorted({g.name for g in gpus})}; planning for GPU 0")
    elif slurm and slurm.gpus_per_node and not (visible and visible.node_gpus):
        gpus_per_node = slurm.gpus_per_node
        gpu = "unknown"
        notes.append(f"SLURM allocates {gpus_per_node} GPUs per node but NVML saw none here (a login node?)")

    if gpus and gpus[0].nvlink_active > 0:
        intra_node = "nvlink"
        intra_gbps = (
            spec.intra_node_gbps_nvlink if spec else gpus[0].nvlink_active * NVLINK3_GBS_PER_LINK_PER_DIRECTION * 8
        )
    elif gpus_per_node > 0:
        intra_node = "pcie"
        intra_gbps = spec.intra_node_gbps_pcie if spec else 256.0  # PCIe Gen4 x16: 32 GB/s per direction
    else:
        intra_node, intra_gbps = "loopback", LOOPBACK_GBPS

    inter_node, inter_gbps = _inter_node_link(ib_ports, opa_ports, ethernet)
    if nodes > 1 and inter_node == "none":
        inter_node, inter_gbps = "ethernet", FABRIC_GBPS["ethernet"]
        notes.append(f"{nodes} nodes but no fabric port or Ethernet speed found: assuming {inter_gbps:g} Gb/s Ethernet")

    return Hardware(
        nodes=nodes,
        gpus_per_node=gpus_per_node,
        gpu=gpu,
        gpu_memory_gb=gpu_memory_gb,
        intra_node=intra_node,
        intra_node_gbps=float(intra_gbps),
        inter_node=inter_node,
        inter_node_gbps=float(inter_gbps),
        cpu_cores=cpu_cores,
        ram_gb=ram_gb,
        name="detected",
        description=f"detected on {os.uname().nodename}",
        gpus=tuple(gpus),
        infiniband=tuple(ib_ports),
        omnipath=tuple(opa_ports),
        ethernet=tuple(ethernet),
        slurm=slurm,
        notes=tuple(notes),
        gpus_limited_by=visible.limited_by if visible else (),
    )


def _probe_gpus(
    nvml_module: Any | None, env: Mapping[str, str], cuda_count: Callable[[], int | None] | None, notes: list[str]
) -> tuple[VisibleGpus | None, list[GpuDevice]]:
    """The GPUs this job may use (None when NVML cannot say), and their descriptions."""
    nvml: Any = nvml_module
    if nvml is None:
        try:
            nvml = importlib.import_module("pynvml")  # nvidia-ml-py
        except ImportError as e:
            notes.append(f"no GPUs: pynvml is not importable ({e})")
            return None, []
    try:
        nvml.nvmlInit()
    except Exception as e:  # NVMLError_LibraryNotFound, DriverNotLoaded, ...: no GPU driver here
        notes.append(f"no GPUs: NVML did not start ({e})")
        return None, []
    try:
        visible = visible_gpus(nvml, env, cuda_count=cuda_count)
        notes.extend(visible.notes)
        if any(gpu.mig for gpu in visible.gpus):
            notes.append("MIG instances: the planner rates each as a whole GPU, though it has a share of one")
        return visible, [_gpu_device(nvml, gpu, visible.gpus, notes) for gpu in visible.gpus]
    except BadInput:
        raise  # a variable naming GPUs this node lacks: the user's to fix, not a probe that failed
    except Exception as e:
        notes.append(f"NVML failed while listing GPUs ({e})")
        return None, []
    finally:
        try:
            nvml.nvmlShutdown()
        except Exception as e:
            notes.append(f"NVML shutdown failed ({e})")


def _gpu_device(nvml: Any, gpu: VisibleGpu, peers: tuple[VisibleGpu, ...], notes: list[str]) -> GpuDevice:
    index, handle = gpu.index, gpu.handle
    name = nvml.nvmlDeviceGetName(handle)
    name = name.decode() if isinstance(name, bytes) else str(name)
    memory_gb = nvml.nvmlDeviceGetMemoryInfo(handle).total / GIB
    links = active = 0
    for link in range(int(getattr(nvml, "NVML_NVLINK_MAX_LINKS", 18))):
        try:
            state = nvml.nvmlDeviceGetNvLinkState(handle, link)
        except Exception:  # NotSupported / InvalidArgument: this link does not exist
            continue
        links += 1
        active += int(state == getattr(nvml, "NVML_FEATURE_ENABLED", 1))
    read_cap = getattr(nvml, "NVML_P2P_CAPS_INDEX_READ", 0)
    read_cap = read_cap[0] if isinstance(read_cap, tuple) else read_cap  # some pynvml releases define it as (0,)
    p2p = []
    for peer in peers:  # the job's own GPUs only: it cannot reach the others
        if peer is gpu:
            continue
        try:
            if nvml.nvmlDeviceGetP2PStatus(handle, peer.handle, read_cap) == getattr(nvml, "NVML_P2P_STATUS_OK", 0):
                p2p.append(peer.index)
        except Exception as e:
            notes.append(f"GPU {index}: P2P status with GPU {peer.index} unknown ({e})")
    try:
        power_limit_w: float | None = nvml.nvmlDeviceGetPowerManagementLimit(handle) / 1000.0  # NVML reports mW
    except Exception as e:
        power_limit_w = None
        notes.append(f"GPU {index}: power limit unknown ({e})")
    return GpuDevice(index, name, round(memory_gb, 2), links, active, tuple(p2p), power_limit_w)


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except (OSError, UnicodeDecodeError):
        return None


def _probe_fabric(root: Path, notes: list[str]) -> tuple[list[FabricPort], list[FabricPort]]:
    """InfiniBand (and RoCE) ports, and Omni-Path ports: the hfi1 driver registers them under infiniband too."""
    base = root / "class" / "infiniband"
    if not base.is_dir():
        notes.append(f"no InfiniBand/Omni-Path devices ({base} absent)")
        return [], []
    ib: list[FabricPort] = []
    opa: list[FabricPort] = []
    for dev in sorted(base.iterdir()):
        is_opa = dev.name.startswith(("hfi1", "qib"))
        for port_dir in sorted((dev / "ports").glob("*")):
            state = _read(port_dir / "state") or "unknown"  # "4: ACTIVE"
            rate_text = _read(port_dir / "rate") or ""  # "100 Gb/sec (4X EDR)"
            match = re.match(r"\s*([\d.]+)\s*Gb", rate_text)
            layer = "OmniPath" if is_opa else (_read(port_dir / "link_layer") or "InfiniBand")
            if not port_dir.name.isdigit():
                continue
            port = FabricPort(
                device=dev.name,
                port=int(port_dir.name),
                state=state.split(":", 1)[-1].strip(),
                rate_gbps=float(match.group(1)) if match else 0.0,
                link_layer=layer,
            )
            (opa if is_opa else ib).append(port)
            if not match:
                notes.append(f"{dev.name} port {port_dir.name}: rate unreadable ({rate_text!r})")
    return ib, opa


def _probe_ethernet(root: Path, notes: list[str]) -> list[EthernetLink]:
    base = root / "class" / "net"
    if not base.is_dir():
        notes.append(f"no network interfaces listed ({base} absent)")
        return []
    links = []
    for iface in sorted(base.iterdir()):
        if iface.name == "lo" or _read(iface / "type") not in (None, "1"):  # type 1 is Ethernet (32: IPoIB)
            continue
        speed = _read(iface / "speed")  # Mb/s; -1 or EINVAL when the driver does not know
        speed_gbps = int(speed) / 1000 if speed and speed.lstrip("-").isdigit() and int(speed) > 0 else None
        links.append(
            EthernetLink(
                interface=iface.name,
                speed_gbps=speed_gbps,
                operstate=_read(iface / "operstate") or "unknown",
                virtual=not (iface / "device").exists(),
            )
        )
    return links


def _inter_node_link(ib: list[FabricPort], opa: list[FabricPort], ethernet: list[EthernetLink]) -> tuple[str, float]:
    active_opa = [p for p in opa if p.state == "ACTIVE"]
    active_ib = [p for p in ib if p.state == "ACTIVE" and p.link_layer.lower() == "infiniband"]
    active_roce = [p for p in ib if p.state == "ACTIVE" and p.link_layer.lower() == "ethernet"]
    if active_opa:
        return "omnipath", sum(p.rate_gbps for p in active_opa)
    if active_ib:
        return "infiniband", sum(p.rate_gbps for p in active_ib)
    if active_roce:
        return "ethernet", sum(p.rate_gbps for p in active_roce)
    up = [e for e in ethernet if e.speed_gbps and e.operstate in ("up", "unknown")]
    physical = [e for e in up if not e.virtual]
    chosen = physical or up
    if chosen:
        return "ethernet", max(e.speed_gbps or 0.0 for e in chosen)
    return "none", 0.0


def _probe_cpu(notes: list[str]) -> tuple[int, float]:
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    try:
        import psutil

        physical = psutil.cpu_count(logical=False) or usable
        ram_gb = psutil.virtual_memory().total / GIB
    except Exception as e:  # psutil missing or /proc unreadable
        notes.append(f"psutil failed ({e}); using os.cpu_count and sysconf")
        physical = usable
        ram_gb = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / GIB
    # Physical cores, but never more than this process may run on (cgroups, taskset, SLURM's --cpus-per-task).
    return max(1, min(physical, usable)), round(ram_gb, 1)


def _first_int(text: str | None) -> int | None:
    """The leading integer of a SLURM count: "8", "8(x2)", "a100:8" (after the last colon)."""
    if not text:
        return None
    match = re.match(r"\s*(\d+)", text.rsplit(":", 1)[-1])
    return int(match.group(1)) if match else None


def _probe_slurm(env: Mapping[str, str], notes: list[str]) -> SlurmAllocation | None:
    job_id = env.get("SLURM_JOB_ID") or env.get("SLURM_JOBID")
    if not job_id:
        notes.append("not inside a SLURM allocation (no SLURM_JOB_ID)")
        return None
    nodes = _first_int(env.get("SLURM_JOB_NUM_NODES") or env.get("SLURM_NNODES"))
    if nodes is None:
        notes.append("SLURM_JOB_NUM_NODES missing or unreadable: assuming 1 node")
    gpus = _first_int(env.get("SLURM_GPUS_ON_NODE")) or _first_int(env.get("SLURM_GPUS_PER_NODE"))
    if gpus is None and env.get("SLURM_JOB_GPUS"):
        gpus = len([g for g in env["SLURM_JOB_GPUS"].split(",") if g.strip()])
    return SlurmAllocation(
        job_id=job_id,
        nodes=max(1, nodes or 1),
        node_list=env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST") or "",
        tasks=_first_int(env.get("SLURM_NTASKS")),
        tasks_per_node=_first_int(env.get("SLURM_NTASKS_PER_NODE")),
        gpus_per_node=gpus,
        cpus_per_task=_first_int(env.get("SLURM_CPUS_PER_TASK")),
    )
