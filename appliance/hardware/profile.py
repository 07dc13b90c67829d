"""The hardware profile: what the planner needs to know about a machine or cluster, plus what detection saw.

The ten profile keys are public (docs/ARCHITECTURE.md, "Input files"); the TOML files in presets/hardware/ hold exactly
them plus a few optional extras (name, description, cost and carbon figures). Bandwidths are Gb/s per direction:
`intra_node_gbps` per GPU (its NVLink or PCIe share), `inter_node_gbps` per node (all its fabric ports together).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from appliance.errors import BadInput
from appliance.hardware.specs import gpu_spec, known_gpus
from appliance.presets import load_preset

INTRA_NODE_KINDS = ("nvlink", "pcie", "loopback", "none")  # "loopback": CPU ranks on one host (gloo over TCP)
INTER_NODE_KINDS = ("infiniband", "omnipath", "ethernet", "none")
NO_GPU = "none"


@dataclass(frozen=True)
class GpuDevice:
    index: int
    name: str  # as NVML reports it
    memory_gb: float  # GiB
    nvlink_links: int = 0  # links that exist
    nvlink_active: int = 0  # links whose state is up
    p2p: tuple[int, ...] = ()  # indices of the GPUs this one can read from peer-to-peer
    power_limit_w: float | None = None


@dataclass(frozen=True)
class FabricPort:
    device: str  # "mlx5_0", "hfi1_0"
    port: int
    state: str  # "ACTIVE", "DOWN", ...
    rate_gbps: float
    link_layer: str  # "InfiniBand", "Ethernet" (RoCE), "OmniPath"


@dataclass(frozen=True)
class EthernetLink:
    interface: str
    speed_gbps: float | None  # None when the kernel does not know (virtual interfaces report -1)
    operstate: str
    virtual: bool


@dataclass(frozen=True)
class SlurmAllocation:
    job_id: str
    nodes: int
    node_list: str
    tasks: int | None
    tasks_per_node: int | None
    gpus_per_node: int | None
    cpus_per_task: int | None


@dataclass(frozen=True)
class Hardware:
    nodes: int
    gpus_per_node: int
    gpu: str  # canonical name from the specs table, or "none"
    gpu_memory_gb: float
    intra_node: str
    intra_node_gbps: float
    inter_node: str
    inter_node_gbps: float
    cpu_cores: int  # per node
    ram_gb: float  # per node, GiB
    # Optional extras (profiles may set them; detection fills the lists).
    name: str = ""
    description: str = ""
    usd_per_gpu_hour: float | None = None  # price for cost estimates; a default applies when unset
    pue: float | None = None  # the site's power usage effectiveness; None: see hardware/carbon.py
    kg_co2_per_kwh: float | None = None  # grid carbon intensity
    gpus: tuple[GpuDevice, ...] = ()
    infiniband: tuple[FabricPort, ...] = ()
    omnipath: tuple[FabricPort, ...] = ()
    ethernet: tuple[EthernetLink, ...] = ()
    slurm: SlurmAllocation | None = None
    notes: tuple[str, ...] = field(default=())
    # Detection: the variables that left the job fewer GPUs than the node has ("CUDA_VISIBLE_DEVICES", ...).
    gpus_limited_by: tuple[str, ...] = ()

    @property
    def has_gpus(self) -> bool:
        return self.gpus_per_node > 0

    @property
    def world_gpus(self) -> int:
        return self.nodes * self.gpus_per_node

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        for key in ("gpus", "infiniband", "omnipath", "ethernet", "notes", "gpus_limited_by"):
            d[key] = list(d[key])
        return d


PROFILE_KEYS: dict[str, type | tuple[type, ...]] = {
    "nodes": int,
    "gpus_per_node": int,
    "gpu": str,
    "gpu_memory_gb": (int, float),
    "intra_node": str,
    "intra_node_gbps": (int, float),
    "inter_node": str,
    "inter_node_gbps": (int, float),
    "cpu_cores": int,
    "ram_gb": (int, float),
}
OPTIONAL_KEYS: dict[str, type | tuple[type, ...]] = {
    "name": str,
    "description": str,
    "usd_per_gpu_hour": (int, float),
    "pue": (int, float),
    "kg_co2_per_kwh": (int, float),
}


def hardware_from_table(table: dict[str, Any], source: str) -> Hardware:
    """Build and validate a Hardware from a TOML table; BadInput naming `source` and the key on any problem."""
    for key in table:
        if key not in PROFILE_KEYS and key not in OPTIONAL_KEYS:
            allowed = ", ".join([*PROFILE_KEYS, *OPTIONAL_KEYS])
            raise BadInput(f"{source}: unknown key {key!r} (allowed: {allowed})")
    for key in PROFILE_KEYS:
        if key not in table:
            raise BadInput(f"{source}: missing key {key!r}")
    for key, kind in {**PROFILE_KEYS, **OPTIONAL_KEYS}.items():
        if key in table and (not isinstance(table[key], kind) or isinstance(table[key], bool)):
            raise BadInput(f"{source}: key {key!r} must be {_type_words(kind)}, got {table[key]!r}")
    values = dict(table)
    for key in ("gpu_memory_gb", "intra_node_gbps", "inter_node_gbps", "ram_gb", "usd_per_gpu_hour", "pue"):
        if key in values:
            values[key] = float(values[key])
    if "kg_co2_per_kwh" in values:
        values["kg_co2_per_kwh"] = float(values["kg_co2_per_kwh"])
    hw = Hardware(**values)
    _check_values(hw, source)
    return hw


def _type_words(kind: type | tuple[type, ...]) -> str:
    return "a number" if isinstance(kind, tuple) else {int: "an integer", str: "a string"}.get(kind, str(kind))


def _check_values(hw: Hardware, source: str) -> None:
    if hw.nodes < 1:
        raise BadInput(f"{source}: nodes must be >= 1, got {hw.nodes}")
    if hw.gpus_per_node < 0:
        raise BadInput(f"{source}: gpus_per_node must be >= 0, got {hw.gpus_per_node}")
    if hw.cpu_cores < 1:
        raise BadInput(f"{source}: cpu_cores must be >= 1, got {hw.cpu_cores}")
    if hw.ram_gb <= 0:
        raise BadInput(f"{source}: ram_gb must be > 0, got {hw.ram_gb}")
    if hw.intra_node not in INTRA_NODE_KINDS:
        raise BadInput(f"{source}: intra_node must be one of {', '.join(INTRA_NODE_KINDS)}, got {hw.intra_node!r}")
    if hw.inter_node not in INTER_NODE_KINDS:
        raise BadInput(f"{source}: inter_node must be one of {', '.join(INTER_NODE_KINDS)}, got {hw.inter_node!r}")
    if hw.intra_node_gbps < 0 or hw.inter_node_gbps < 0:
        raise BadInput(f"{source}: intra_node_gbps and inter_node_gbps must be >= 0")
    if hw.nodes > 1 and (hw.inter_node == "none" or hw.inter_node_gbps <= 0):
        raise BadInput(f"{source}: {hw.nodes} nodes need an inter_node link with inter_node_gbps > 0")
    if hw.pue is not None and hw.pue < 1.0:
        raise BadInput(f"{source}: pue must be >= 1.0, got {hw.pue}")
    if hw.gpus_per_node == 0:
        if hw.gpu != NO_GPU:
            raise BadInput(f'{source}: gpus_per_node is 0 but gpu is {hw.gpu!r} (use gpu = "none")')
        return
    spec = gpu_spec(hw.gpu)
    if spec is None:
        raise BadInput(f"{source}: gpu {hw.gpu!r} is not in the specs table; known: {', '.join(known_gpus())}")
    if hw.gpu_memory_gb <= 0:
        raise BadInput(f"{source}: gpu_memory_gb must be > 0 for gpu {hw.gpu!r}")
    if hw.intra_node in ("loopback", "none") and hw.gpus_per_node > 1:
        raise BadInput(f"{source}: {hw.gpus_per_node} GPUs per node need intra_node nvlink or pcie")
    if hw.intra_node_gbps <= 0 and hw.gpus_per_node > 1:
        raise BadInput(f"{source}: intra_node_gbps must be > 0 with {hw.gpus_per_node} GPUs per node")


def load_hardware(name_or_path: str) -> Hardware:
    """A hardware profile from a preset name (presets/hardware/NAME.toml) or a TOML file path."""
    path, table = load_preset("hardware", name_or_path)
    table.setdefault("name", Path(path).stem)
    return hardware_from_table(table, str(path))
