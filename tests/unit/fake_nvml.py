"""A node of GPUs behind the real pynvml module, its functions monkeypatched: detection and the monitor load and call
it as they would a driver's, and a failing call raises pynvml's own NVMLError (NOT_SUPPORTED), as MIG instances and
some boards do for power and energy."""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import pynvml
import pytest

GIB = 2**30


@dataclass(eq=False)
class FakeGpu:
    """One device; its handle is the object itself. Energy in mJ, power in mW, as NVML reports them."""

    uuid: str
    name: str = "NVIDIA A100-SXM4-80GB"
    memory_gb: float = 80.0
    energy_mj: float = 1_000_000.0
    power_mw: float = 300_000.0
    mig: list[FakeGpu] = field(default_factory=list)  # MIG instances; MIG mode is on when there are any
    failing: set[str] = field(default_factory=set)  # NVML functions that raise NOT_SUPPORTED for this device


def node_of(count: int) -> list[FakeGpu]:
    return [FakeGpu(uuid=f"GPU-{i:02d}a6d1f2-0000-4000-8000-00000000000{i % 10}") for i in range(count)]


class PatchedNvml:
    """Installs itself over pynvml; `reads` lists (function, uuid) for every per-device query."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, gpus: list[FakeGpu]) -> None:
        self.gpus = gpus
        self.reads: list[tuple[str, str]] = []
        device_queries = {
            "nvmlDeviceGetUUID": lambda gpu: gpu.uuid,
            "nvmlDeviceGetName": lambda gpu: gpu.name,
            "nvmlDeviceGetMemoryInfo": lambda gpu: SimpleNamespace(
                used=gpu.memory_gb * GIB / 2, total=gpu.memory_gb * GIB
            ),
            "nvmlDeviceGetUtilizationRates": lambda gpu: SimpleNamespace(gpu=90, memory=40),
            "nvmlDeviceGetTemperature": lambda gpu, sensor: 60,
            "nvmlDeviceGetPowerUsage": lambda gpu: gpu.power_mw,
            "nvmlDeviceGetTotalEnergyConsumption": lambda gpu: gpu.energy_mj,
            "nvmlDeviceGetPowerManagementLimit": lambda gpu: 400_000,
            "nvmlDeviceGetNvLinkState": lambda gpu, link: self._not_supported(),
            "nvmlDeviceGetP2PStatus": lambda gpu, other, cap: pynvml.NVML_P2P_STATUS_OK,
            "nvmlDeviceGetMigMode": lambda gpu: [int(bool(gpu.mig)), int(bool(gpu.mig))],
            "nvmlDeviceGetMaxMigDeviceCount": lambda gpu: 7,
            "nvmlDeviceGetMigDeviceHandleByIndex": self._mig_handle,
        }
        for name, query in device_queries.items():
            monkeypatch.setattr(pynvml, name, self._device_query(name, query))
        monkeypatch.setattr(pynvml, "nvmlInit", lambda: None)
        monkeypatch.setattr(pynvml, "nvmlShutdown", lambda: None)
        monkeypatch.setattr(pynvml, "nvmlDeviceGetCount", lambda: len(self.gpus))
        monkeypatch.setattr(pynvml, "nvmlDeviceGetHandleByIndex", lambda i: self.gpus[i])

    @staticmethod
    def _not_supported() -> Any:
        raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)

    def _mig_handle(self, gpu: FakeGpu, slot: int) -> FakeGpu:
        if slot >= len(gpu.mig):
            raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_FOUND)
        return gpu.mig[slot]

    def _device_query(self, name: str, query: Any) -> Any:
        def call(gpu: FakeGpu, *args: Any) -> Any:
            self.reads.append((name, gpu.uuid))
            if name in gpu.failing:
                self._not_supported()
            return query(gpu, *args)

        return call

    def read_uuids(self, function: str) -> list[str]:
        return [uuid for name, uuid in self.reads if name == function]
