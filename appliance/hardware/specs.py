"""Facts about accelerators and links, in one table each (the llm.c `mfu.h` way), with their sources.

Units: TFLOPs are dense (no 2:4 sparsity) tensor-core peaks in bf16 (fp16 where the GPU has no bf16, marked);
GB/s for memory and GPU links as the datasheets quote them (NVLink figures are bidirectional totals per GPU);
Gb/s (gigabits) in hardware profiles, per direction. Every number below is a datasheet peak, not a measurement:
the planner applies its calibrated efficiencies (appliance/planner/calibration.py) on top.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

# Memory sizes in the specs and profiles are GiB: "80 GB" GPUs report 80 GiB, so the figures equal the name on the box.
GIB = 2**30


@dataclass(frozen=True)
class GpuSpec:
    name: str  # canonical name, used in hardware profiles ("A100-SXM4-80GB")
    family: str  # calibration key ("A100", "H100", ...)
    peak_tflops: float  # dense bf16 tensor-core peak (fp16 when bf16 is False)
    memory_gb: float
    memory_bw_gbs: float  # HBM/GDDR bandwidth, GB/s
    nvlink_gbs: float  # NVLink bandwidth per GPU, GB/s bidirectional; 0 without NVLink
    pcie_gbs: float  # host link, GB/s bidirectional (Gen4 x16 = 64, Gen5 x16 = 128)
    tdp_w: float  # board power limit, W
    bf16: bool = True  # native bf16 tensor cores (V100 has none: it trains in fp16)
    nvml_patterns: tuple[str, ...] = ()  # regexes over the NVML device name (case-insensitive)

    @property
    def intra_node_gbps_nvlink(self) -> float:
        """NVLink per GPU and direction, in Gb/s: half the bidirectional GB/s, times 8 bits."""
        return self.nvlink_gbs / 2 * 8

    @property
    def intra_node_gbps_pcie(self) -> float:
        return self.pcie_gbs / 2 * 8


# Sources (NVIDIA datasheets): "NVIDIA A100 Tensor Core GPU" datasheet (2021); "NVIDIA H100 Tensor Core GPU"
# datasheet (2023); "NVIDIA H200 Tensor Core GPU" datasheet (2024); "NVIDIA L40S" datasheet (2023);
# "NVIDIA A10" datasheet (2021); "NVIDIA L4" datasheet (2023); "NVIDIA V100" datasheet (2020); "NVIDIA RTX A6000"
# datasheet (2021); "NVIDIA Ada GPU Architecture" whitepaper v2.1, Appendix A (RTX 4090: bf16 with fp32 accumulate).
# Datasheets quote sparse tensor peaks ("with sparsity"); the dense peak is half of that.
GPU_SPECS: dict[str, GpuSpec] = {
    s.name: s
    for s in (
        # A100: 312 TFLOPs bf16 dense; SXM4 80GB 2,039 GB/s, 40GB 1,555 GB/s; NVLink 3: 12 links x 50 GB/s = 600 GB/s.
        GpuSpec("A100-SXM4-80GB", "A100", 312, 80, 2039, 600, 64, 400, nvml_patterns=(r"A100.*SXM.*80",)),
        GpuSpec("A100-SXM4-40GB", "A100", 312, 40, 1555, 600, 64, 400, nvml_patterns=(r"A100.*SXM.*40",)),
        # A100 PCIe: same peak, 1,935 GB/s (80GB) / 1,555 GB/s (40GB), 300/250 W; an NVLink bridge joins pairs only.
        GpuSpec(
            "A100-PCIe-80GB", "A100", 312, 80, 1935, 0, 64, 300, nvml_patterns=(r"A100.*80GB PCIe", r"A100-PCIE-80")
        ),
        GpuSpec("A100-PCIe-40GB", "A100", 312, 40, 1555, 0, 64, 250, nvml_patterns=(r"A100.*PCIE.*40", r"A100-PCIE")),
        # H100 SXM5: 1,979 TFLOPs bf16 with sparsity -> 989 dense; 3.35 TB/s; NVLink 4: 900 GB/s; 700 W.
        GpuSpec("H100-SXM5-80GB", "H100", 989, 80, 3350, 900, 128, 700, nvml_patterns=(r"H100.*HBM3", r"H100.*SXM")),
        # H100 PCIe: 1,513 sparse -> 756 dense; 2.0 TB/s; 350 W; PCIe Gen5.
        GpuSpec("H100-PCIe", "H100", 756, 80, 2000, 0, 128, 350, nvml_patterns=(r"H100.*PCIe",)),
        # H200 SXM: the H100 compute with 141 GB HBM3e at 4.8 TB/s; 700 W.
        GpuSpec("H200", "H200", 989, 141, 4800, 900, 128, 700, nvml_patterns=(r"H200",)),
        # L40S: 733 sparse -> 362 dense bf16; 48 GB GDDR6 at 864 GB/s; no NVLink; 350 W.
        GpuSpec("L40S", "L40S", 362, 48, 864, 0, 64, 350, nvml_patterns=(r"L40S",)),
        # L4: 242 sparse -> 121 dense; 24 GB at 300 GB/s; 72 W.
        GpuSpec("L4", "L4", 121, 24, 300, 0, 64, 72, nvml_patterns=(r"\bL4\b",)),
        # A10: 250 sparse -> 125 dense; 24 GB at 600 GB/s; 150 W.
        GpuSpec("A10", "A10", 125, 24, 600, 0, 64, 150, nvml_patterns=(r"\bA10\b",)),
        # RTX A6000: 309.7 sparse -> 154.8 dense; 48 GB at 768 GB/s; 300 W.
        GpuSpec("RTX-A6000", "A6000", 154.8, 48, 768, 0, 64, 300, nvml_patterns=(r"RTX A6000",)),
        # V100 SXM2: 125 TFLOPs fp16 tensor (no bf16); 900 GB/s; NVLink 2: 300 GB/s; 300 W. BLOOM's smaller
        # models were trained on Jean Zay's V100-32GB in fp16.
        GpuSpec("V100-SXM2-32GB", "V100", 125, 32, 900, 300, 32, 300, bf16=False, nvml_patterns=(r"V100.*SXM2.*32",)),
        GpuSpec("V100-SXM2-16GB", "V100", 125, 16, 900, 300, 32, 300, bf16=False, nvml_patterns=(r"V100.*SXM2",)),
        GpuSpec("V100-PCIe-32GB", "V100", 112, 32, 900, 0, 32, 250, bf16=False, nvml_patterns=(r"V100.*PCIE",)),
        # GeForce RTX 4090: 165.2 TFLOPs bf16 with fp32 accumulate (GeForce halves that rate); 24 GB at 1,008 GB/s.
        GpuSpec("RTX-4090", "RTX4090", 165.2, 24, 1008, 0, 64, 450, nvml_patterns=(r"RTX 4090",)),
    )
}


# A GPU that detection finds but the table does not know (a new or cloud-specific board): planned as a modest
# accelerator so the appliance still runs; hardware profiles must name a GPU from the table instead.
GENERIC_GPU = GpuSpec(
    "generic", "generic", peak_tflops=100, memory_gb=0, memory_bw_gbs=1000, nvlink_gbs=0, pcie_gbs=64, tdp_w=300
)


@dataclass(frozen=True)
class CpuSpec:
    """A generic x86 core, for CPU ranks (gloo) where the planner needs a rate."""

    peak_gflops_per_core: float
    memory_bw_gbs_per_core: float
    watts_per_core: float
    base_watts: float


# 2 FMA units x 8 fp32 lanes (AVX2) x 2 FLOPs x 3.0 GHz = 96 GFLOP/s per core. Memory bandwidth: a DDR4/DDR5
# channel gives ~20 GB/s; with several cores sharing it, ~10 GB/s per core is what a streaming kernel sees.
# Power: ~10 W per loaded core plus ~5 W for the rest of a laptop-class package (assumptions, stated in the plan).
CPU_SPEC = CpuSpec(peak_gflops_per_core=96.0, memory_bw_gbs_per_core=10.0, watts_per_core=10.0, base_watts=5.0)

# Ranks on one host without GPUs talk through gloo over the loopback interface: a few GB/s in practice.
LOOPBACK_GBPS = 40.0

# Between nodes, per node and direction: what common fabrics carry (Gb/s).
FABRIC_GBPS = {"infiniband": 200.0, "omnipath": 100.0, "ethernet": 25.0, "none": 0.0}


def gpu_spec(name: str) -> GpuSpec | None:
    """The spec of a GPU by canonical name (case-insensitive), or None."""
    if name in GPU_SPECS:
        return GPU_SPECS[name]
    lowered = name.lower()
    for spec in GPU_SPECS.values():
        if spec.name.lower() == lowered:
            return spec
    return None


def match_nvml_name(nvml_name: str) -> GpuSpec | None:
    """The spec whose NVML patterns match a device name as NVML reports it ("NVIDIA A100-SXM4-80GB")."""
    for spec in GPU_SPECS.values():
        if any(re.search(p, nvml_name, re.IGNORECASE) for p in spec.nvml_patterns):
            return spec
    return None


def known_gpus() -> list[str]:
    return sorted(GPU_SPECS)
