"""What one rank runs on, and the links between ranks, as rates the cost model can divide by.

A rank is a GPU, or on a machine without GPUs a CPU process with its share of the cores (gloo ranks). Ranks are
laid out TP innermost, then CP, then DP, then PP (layout.py), so a TP group is consecutive ranks and sits inside a
node whenever tp <= ranks per node, a CP group spans tp x cp consecutive ranks, and the gradient-reducing dp x cp
ranks span tp x cp x dp. The links below take the rank counts that matter to them: callers pass dp x cp as `dp`
where the group is dp_cp (gradients, ZeRO's gather, what a pipeline stage holds).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from appliance.errors import BadInput
from appliance.hardware.profile import Hardware
from appliance.hardware.specs import CPU_SPEC, FABRIC_GBPS, GENERIC_GPU, LOOPBACK_GBPS, gpu_spec
from appliance.planner import calibration as cal
from appliance.planner.calibration import Efficiency
from appliance.planner.train_settings import DTYPES


@dataclass(frozen=True)
class Device:
    kind: str  # "gpu" or "cpu"
    name: str
    peak_flops: float  # per rank, FLOP/s: dense bf16/fp16 tensor peak on GPUs (their fp32 peak when training in
    # fp32), fp32 FMA peak on CPU ranks
    memory_bw: float  # per rank, bytes/s
    capacity_gb: float  # memory a rank may fill, GiB
    dtype: str  # "bf16", "fp16" or "fp32"
    efficiency: Efficiency
    fixed_overhead_gb: float
    watts: float  # average power per rank while training, host share included
    ranks_per_node: int

    @property
    def mixed_precision(self) -> bool:
        return self.dtype != "fp32"

    @property
    def act_bytes(self) -> int:
        return 4 if self.dtype == "fp32" else 2

    @property
    def grad_comm_bytes(self) -> int:
        """Bytes per gradient element in the DP reduce and the tied-embedding all-reduce: bf16 sums the fp32
        accumulation buffers in fp32 (deepspeed_config: communication_data_type), fp16 reduces its fp16
        gradients as they are, fp32 is fp32."""
        return 2 if self.dtype == "fp16" else 4


def default_precision(hw: Hardware) -> str:
    """bf16 where the GPU has bf16 tensor cores (BLOOM's choice), fp16 on V100-class GPUs, fp32 on CPU ranks."""
    if not hw.has_gpus:
        return "fp32"
    spec = gpu_spec(hw.gpu) or GENERIC_GPU
    return "bf16" if spec.bf16 else "fp16"


def check_precision(hw: Hardware, precision: str) -> None:
    """BadInput naming the setting when `precision` is unknown or the GPU has no bf16 tensor cores for it."""
    if precision not in DTYPES:
        raise BadInput(f"--set precision={precision}: must be one of {', '.join(DTYPES)}")
    if precision == "bf16" and hw.has_gpus:
        spec = gpu_spec(hw.gpu) or GENERIC_GPU
        if not spec.bf16:
            raise BadInput(f"--set precision=bf16: {spec.name} has no bf16 tensor cores; use fp16 or fp32")


def ranks_per_node(hw: Hardware, world_size: int) -> int:
    """How many of the plan's `world_size` ranks share a node: one per GPU, or on CPU nodes the ranks spread evenly
    over the profile's nodes (rounded up). The engine cuts its expert groups into nodes by the same count
    (parallel/experts/exchange.py), so the all-to-all it picks is the one the plan priced."""
    if hw.has_gpus:
        return hw.gpus_per_node
    return max(1, math.ceil(world_size / hw.nodes))


def make_device(hw: Hardware, world_size: int, precision: str | None = None) -> Device:
    """The per-rank device for `world_size` ranks on this hardware, training in `precision` (None: the hardware's
    default_precision)."""
    dtype = precision or default_precision(hw)
    check_precision(hw, dtype)
    if hw.has_gpus:
        spec = gpu_spec(hw.gpu) or GENERIC_GPU  # detection can meet GPUs the table lacks; make_plan notes it
        if hw.gpu_memory_gb <= 0:
            raise BadInput(f"hardware {hw.name or 'profile'}: gpu {hw.gpu!r} has no memory size (gpu_memory_gb)")
        fp32_share = cal.GPU_FP32_PEAK_FRACTION.get(spec.family, cal.DEFAULT_GPU_FP32_PEAK_FRACTION)
        return Device(
            kind="gpu",
            name=spec.name,
            peak_flops=spec.peak_tflops * 1e12 * (fp32_share if dtype == "fp32" else 1.0),
            memory_bw=spec.memory_bw_gbs * 1e9,
            capacity_gb=hw.gpu_memory_gb,
            dtype=dtype,
            efficiency=cal.gpu_efficiency(spec.family),
            fixed_overhead_gb=cal.GPU_FIXED_OVERHEAD_GB,
            watts=spec.tdp_w * cal.GPU_POWER_FRACTION + cal.HOST_WATTS_PER_GPU,
            ranks_per_node=ranks_per_node(hw, world_size),
        )
    per_node = ranks_per_node(hw, world_size)
    cores = hw.cpu_cores / per_node  # fractional when ranks outnumber cores: they time-share
    return Device(
        kind="cpu",
        name=f"CPU rank ({cores:g} cores)",
        peak_flops=cores * CPU_SPEC.peak_gflops_per_core * 1e9,
        memory_bw=cores * CPU_SPEC.memory_bw_gbs_per_core * 1e9,
        capacity_gb=hw.ram_gb * cal.CPU_RAM_USABLE_FRACTION / per_node,
        dtype=dtype,  # the fp32 FMA peak whatever the dtype: no bf16/fp16 matrix units assumed on CPU
        efficiency=cal.CPU_EFFICIENCY,
        fixed_overhead_gb=cal.CPU_FIXED_OVERHEAD_GB,
        watts=cores * CPU_SPEC.watts_per_core + CPU_SPEC.base_watts / per_node,
        ranks_per_node=per_node,
    )


@dataclass(frozen=True)
class Link:
    bandwidth: float  # bytes/s one rank sees for this traffic
    latency: float  # seconds per ring step or message
    kind: str  # "nvlink", "pcie", "loopback", "omnipath", ...


def _intra(hw: Hardware) -> Link:
    kind = hw.intra_node if hw.intra_node in ("nvlink", "pcie") else "loopback"
    gbps = hw.intra_node_gbps if hw.intra_node_gbps > 0 else LOOPBACK_GBPS
    return Link(gbps / 8 * 1e9 * cal.LINK_EFFICIENCY, cal.RING_STEP_LATENCY_S[kind], kind)


def _inter(hw: Hardware, sharing: float) -> Link:
    """The fabric as one rank sees it when `sharing` ranks of its node drive the node's ports at once."""
    gbps = hw.inter_node_gbps if hw.inter_node_gbps > 0 else FABRIC_GBPS["ethernet"]
    bandwidth = gbps / 8 * 1e9 * cal.LINK_EFFICIENCY / max(1.0, sharing)
    return Link(min(bandwidth, _intra(hw).bandwidth), cal.RING_STEP_LATENCY_S["fabric"], hw.inter_node)


def tp_link(hw: Hardware, device: Device, tp: int) -> Link:
    if tp <= device.ranks_per_node:
        return _intra(hw)
    return _inter(hw, sharing=1.0)  # every rank of the node is in the same TP group: one ring uses the ports


def cp_link(hw: Hardware, device: Device, tp: int, cp: int) -> Link:
    """CP ranks sit right outside TP, strided by tp: inside a node when tp x cp <= ranks per node, otherwise
    across nodes, sharing the ports as a DP group of cp ranks would."""
    return dp_link(hw, device, tp, cp)


def dp_link(hw: Hardware, device: Device, tp: int, dp: int) -> Link:
    """DP groups are strided by tp (`dp`: dp x cp ranks when they reduce gradients over dp_cp). Inside a node when
    tp*dp ranks fit in one; otherwise each node's ports carry one ring per DP group that has members there
    (ranks_per_node / members-per-node of them)."""
    if tp * dp <= device.ranks_per_node:
        return _intra(hw)
    members_per_node = max(1, min(dp, device.ranks_per_node // tp))
    return _inter(hw, sharing=device.ranks_per_node / members_per_node)


def pp_link(hw: Hardware, device: Device, tp: int, dp: int, pp: int) -> Link:
    """Stage boundaries cross nodes unless the whole model replica set fits in one node; then every rank of a
    boundary node sends at once."""
    if tp * dp * pp <= device.ranks_per_node:
        return _intra(hw)
    return _inter(hw, sharing=min(tp * dp, device.ranks_per_node))


def tied_link(hw: Hardware, device: Device, tp: int, dp: int, pp: int) -> Link:
    """First and last stage sit far apart: across nodes unless everything fits in one."""
    return pp_link(hw, device, tp, dp, pp)
