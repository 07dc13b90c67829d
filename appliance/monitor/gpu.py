"""Per-node GPU sampling: a daemon thread that writes `gpu` and `energy` events every few seconds.

One sampler per node (the head or local rank 0 starts it), so a 384-GPU run writes 48 `gpu` events per interval,
each with that node's 8 devices; the dashboard aggregates them per node. The devices are the job's own
(hardware/visible.py, as detection counts them), not every GPU of the node. Without NVML (no driver, a CPU machine)
the device list is empty and the energy event carries the CPU figure alone. The second half of the module reads
gpu events back into the per-node records the dashboard's table shows.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from appliance.hardware.specs import GIB
from appliance.hardware.visible import VisibleGpu, job_gpus, load_nvml
from appliance.monitor.events import EventWriter, finite

if TYPE_CHECKING:
    from appliance.monitor.energy import EnergyMeter

log = logging.getLogger(__name__)


def _query(fn: Any, *args: Any) -> Any:
    """One NVML call; None where the device does not support it (NVMLError_NotSupported: power on some boards and
    on MIG instances) or it fails, so one missing reading never stops the others."""
    try:
        return fn(*args)
    except Exception:
        return None


def read_devices(nvml: Any | None, gpus: Sequence[VisibleGpu] | None = None) -> list[dict[str, Any]]:
    """The `devices` list of a gpu event: one dict per GPU of the job (`gpus`; None: find them) with the keys
    events.py documents."""
    if nvml is None:
        return []
    devices = []
    for gpu in job_gpus(nvml) if gpus is None else gpus:
        index, handle = gpu.index, gpu.handle
        name = _query(nvml.nvmlDeviceGetName, handle)
        util = _query(nvml.nvmlDeviceGetUtilizationRates, handle)
        memory = _query(nvml.nvmlDeviceGetMemoryInfo, handle)
        temperature = _query(nvml.nvmlDeviceGetTemperature, handle, getattr(nvml, "NVML_TEMPERATURE_GPU", 0))
        power_mw = _query(nvml.nvmlDeviceGetPowerUsage, handle)
        devices.append(
            {
                "index": index,
                "name": name.decode() if isinstance(name, bytes) else (name or ""),
                "util": float(util.gpu) if util is not None else None,
                "memory_used_gb": round(memory.used / GIB, 2) if memory is not None else None,
                "memory_total_gb": round(memory.total / GIB, 2) if memory is not None else None,
                "temperature_c": float(temperature) if temperature is not None else None,
                "power_w": round(power_mw / 1000.0, 1) if power_mw is not None else None,
            }
        )
    return devices


class GpuSampler:
    """Writes a `gpu` event (and an `energy` event when given a meter) every `interval_s` seconds.

    The thread is a daemon and never raises into training: a failing tick is logged and reported once as a
    `warning` event. stop() takes a last sample so the energy total covers the whole run.
    """

    def __init__(
        self,
        writer: EventWriter,
        *,
        node: str,
        interval_s: float = 5.0,
        energy: EnergyMeter | None = None,
        nvml: Any | None = None,
    ) -> None:
        if not interval_s > 0:
            raise ValueError(f"interval_s must be > 0, got {interval_s}")
        self.writer, self.node, self.interval_s, self.energy = writer, node, interval_s, energy
        self.nvml = nvml if nvml is not None else load_nvml()
        self.gpus = job_gpus(self.nvml)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._reported: set[str] = set()

    def tick(self) -> None:
        self.writer.emit("gpu", node=self.node, devices=read_devices(self.nvml, self.gpus))
        if self.energy is not None:
            self.writer.emit("energy", node=self.node, **self.energy.sample())

    def _run(self) -> None:
        while not self._stop.is_set():
            self.tick_safely()
            self._stop.wait(self.interval_s)

    def tick_safely(self) -> None:
        try:
            self.tick()
        except Exception as exc:  # a monitoring hiccup must never stop a training run
            message = f"GPU sampler on {self.node}: {type(exc).__name__}: {exc}"
            log.warning(message)
            if message not in self._reported:
                self._reported.add(message)
                with contextlib.suppress(OSError):  # the run dir itself is gone: nothing left to tell
                    self.writer.emit("warning", message=message)

    def start(self) -> GpuSampler:
        if self._thread is None:
            self._stop.clear()
            self._thread = threading.Thread(target=self._run, name=f"gpu-sampler-{self.node}", daemon=True)
            self._thread.start()
        return self

    def stop(self, timeout: float = 10.0) -> None:
        if self._thread is None:
            return
        self._stop.set()
        self._thread.join(timeout)
        self._thread = None
        self.tick_safely()

    def __enter__(self) -> GpuSampler:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


# ---- reading gpu events back (the dashboard's GPU table) ------------------------------------------------------


@dataclass
class GpuDevice:
    index: int
    name: str
    util: float | None
    memory_used_gb: float | None
    memory_total_gb: float | None
    temperature_c: float | None
    power_w: float | None


@dataclass
class NodeGpus:
    """The latest gpu event of one node, with the per-node aggregates the table shows for many nodes."""

    node: str
    t: float
    devices: list[GpuDevice]

    def _values(self, name: str) -> list[float]:
        return [v for d in self.devices if (v := getattr(d, name)) is not None]

    @property
    def util_mean(self) -> float | None:
        values = self._values("util")
        return sum(values) / len(values) if values else None

    @property
    def util_min(self) -> float | None:
        return min(self._values("util"), default=None)

    @property
    def memory_used_gb(self) -> float:
        return sum(self._values("memory_used_gb"))

    @property
    def memory_total_gb(self) -> float:
        return sum(self._values("memory_total_gb"))

    @property
    def temperature_max(self) -> float | None:
        return max(self._values("temperature_c"), default=None)

    @property
    def power_w(self) -> float:
        return sum(self._values("power_w"))


def parse_devices(raw: Any) -> list[GpuDevice]:
    """The `devices` of a gpu event as sent (missing or odd values become None), for the dashboard."""
    devices = []
    for i, d in enumerate(raw if isinstance(raw, list) else []):
        if not isinstance(d, dict):
            continue
        devices.append(
            GpuDevice(
                index=int(finite(d.get("index")) or i),
                name=str(d.get("name", "")),
                util=finite(d.get("util")),
                memory_used_gb=finite(d.get("memory_used_gb")),
                memory_total_gb=finite(d.get("memory_total_gb")),
                temperature_c=finite(d.get("temperature_c")),
                power_w=finite(d.get("power_w")),
            )
        )
    return devices
