"""Hardware: detection (NVML, /sys, psutil, SLURM), profiles (TOML presets) and the GPU specs table."""

from appliance.hardware.detect import detect
from appliance.hardware.format import format_hardware
from appliance.hardware.profile import (
    EthernetLink,
    FabricPort,
    GpuDevice,
    Hardware,
    SlurmAllocation,
    hardware_from_table,
    load_hardware,
)
from appliance.hardware.specs import CPU_SPEC, GPU_SPECS, CpuSpec, GpuSpec, gpu_spec, known_gpus, match_nvml_name

__all__ = [
    "CPU_SPEC",
    "GPU_SPECS",
    "CpuSpec",
    "EthernetLink",
    "FabricPort",
    "GpuDevice",
    "GpuSpec",
    "Hardware",
    "SlurmAllocation",
    "detect",
    "format_hardware",
    "gpu_spec",
    "hardware_from_table",
    "known_gpus",
    "load_hardware",
    "match_nvml_name",
]
