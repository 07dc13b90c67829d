"""Energy and carbon of a run: GPU energy from NVML, CPU energy from RAPL, CO2eq from grid intensity and PUE.

Measured where the hardware says it, estimated (and labelled so) where it does not:
  GPU: NVML's total-energy counter (mJ since the driver loaded; Volta and newer), else power (mW) integrated
       over the sampling interval with the trapezoid rule.
  CPU: RAPL package counters under /sys/class/powercap (root-only on most kernels since CVE-2020-8694),
       else cores x CPU_WATTS_PER_CORE x utilization.
`kwh` in events and summaries is the IT energy (GPU + CPU) that was measured; the facility overhead enters
through the PUE in the carbon figure: co2_kg = kwh x PUE x grid intensity. The GPUs are the job's own
(hardware/visible.py, as detection counts them), not every GPU of the node.

Across restarts and resumes, each node's energy events carry the node's total for the whole run: a new sampler
(the agent's next attempt, `train --resume`) starts from the last `energy` event its node wrote to metrics.jsonl,
and adds what it measures (`attempt_kwh`). So the newest event of every node is that node's whole-run figure, and
summary.json, the dashboard and its projection sum those, as they always have. The energy used between a dead
attempt's last sample and the next attempt's first (at most a sampling interval plus the restart) is not measured.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil

from appliance.hardware.carbon import DEFAULT_PROFILE, CarbonProfile, carbon_kg
from appliance.hardware.visible import job_gpus, load_nvml
from appliance.monitor.events import finite, read_events_backwards

# Carbon facts (profiles, defaults, carbon_kg) are site facts: they live with the hardware facts.

# CPU power when RAPL cannot be read: Intel Xeon Gold 6248 (Jean Zay's CPUs), 150 W TDP / 20 cores = 7.5 W per
# core at full load (Intel ARK), scaled by utilization. Idle power is left out, so this is a floor, not a bound.
CPU_WATTS_PER_CORE = 7.5
CPU_ESTIMATE_BASIS = "cores x 7.5 W/core (Xeon Gold 6248: 150 W TDP / 20 cores) x utilization"

JOULES_PER_KWH = 3.6e6
_RAPL_PACKAGE = re.compile(r"intel-rapl:\d+$")  # packages only; intel-rapl:0:0 (core, dram) are inside them


@dataclass(frozen=True)
class EnergyTotals:
    """What a node had used in the run before this sampler started."""

    gpu_kwh: float = 0.0
    cpu_kwh: float = 0.0


def previous_totals(metrics: Path, node: str) -> EnergyTotals:
    """The totals of `node`'s newest energy event in metrics.jsonl; zero when it has none (a first attempt, or a
    node new to the run: then the whole file is read, once per sampler start)."""
    for event in read_events_backwards(metrics):
        if event.get("kind") == "energy" and str(event.get("node") or "local") == node:
            cpu = finite(event.get("cpu_kwh")) or 0.0
            gpu = finite(event.get("gpu_kwh"))
            return EnergyTotals(gpu if gpu is not None else max(0.0, (finite(event.get("kwh")) or 0.0) - cpu), cpu)
    return EnergyTotals()


class _GpuEnergy:
    """Joules used by one GPU since the meter started: from the counter, or integrated power."""

    def __init__(self, nvml: Any, handle: Any) -> None:
        self.nvml, self.handle, self.joules = nvml, handle, 0.0
        self.counter_mj: float | None = self._counter()
        self.power_w: float | None = None if self.counter_mj is not None else self._power()

    def _counter(self) -> float | None:
        try:
            return float(self.nvml.nvmlDeviceGetTotalEnergyConsumption(self.handle))
        except Exception:  # NVMLError_NotSupported before Volta, or any driver hiccup
            return None

    def _power(self) -> float | None:
        try:
            return float(self.nvml.nvmlDeviceGetPowerUsage(self.handle)) / 1000.0  # mW -> W
        except Exception:
            return None

    @property
    def source(self) -> str:
        return "nvml_energy_counter" if self.counter_mj is not None else "nvml_power_integrated"

    def sample(self, dt: float) -> None:
        if self.counter_mj is not None:
            now = self._counter()
            if now is not None:
                # A driver reload restarts the counter at zero: then all of `now` is new energy.
                self.joules += (now - self.counter_mj if now >= self.counter_mj else now) / 1000.0
                self.counter_mj = now
                return
            self.counter_mj = None  # the counter stopped answering: integrate power from here on
        watts = self._power()
        if watts is not None and self.power_w is not None:
            self.joules += (self.power_w + watts) / 2.0 * dt  # trapezoid between two readings
        self.power_w = watts


class _RaplZone:
    def __init__(self, path: Path) -> None:
        self.path = path
        self.max_uj = int((path / "max_energy_range_uj").read_text())
        self.last_uj = self.read()

    def read(self) -> int:
        return int((self.path / "energy_uj").read_text())

    def joules_since_last(self) -> float:
        now = self.read()
        # The counter wraps at max_energy_range_uj (every few minutes to hours on a busy package).
        delta = now - self.last_uj if now >= self.last_uj else now + self.max_uj - self.last_uj
        self.last_uj = now
        return delta / 1e6


class EnergyMeter:
    """Energy of this job's GPUs and this node's CPUs; `sample()` returns the `energy` event fields.

    The totals are `before` (what earlier attempts of the run used on this node, see previous_totals) plus what
    this meter measured since construction. `nvml` is an initialised pynvml-like module (None: load pynvml if it
    works; a fake in tests), `sysfs_root` the powercap directory (a temp tree in tests).
    """

    def __init__(
        self,
        *,
        nvml: Any = None,
        sysfs_root: Path = Path("/sys/class/powercap"),
        profile: CarbonProfile = DEFAULT_PROFILE,
        cpu_cores: int | None = None,
        cpu_utilization: Callable[[], float] | None = None,
        clock: Callable[[], float] = time.monotonic,
        before: EnergyTotals | None = None,
    ) -> None:
        if nvml is None:
            nvml = load_nvml()
        self.profile, self.clock, self.before = profile, clock, before or EnergyTotals()
        self.gpus = [_GpuEnergy(nvml, gpu.handle) for gpu in job_gpus(nvml)]
        self.rapl = _open_rapl(Path(sysfs_root))
        self.cpu_cores = cpu_cores or psutil.cpu_count(logical=False) or psutil.cpu_count() or 1
        # psutil.cpu_percent(None) is the system-wide utilization since its previous call: one call per sample.
        self.cpu_utilization = cpu_utilization or (lambda: psutil.cpu_percent(interval=None))
        if self.rapl is None:
            self.cpu_utilization()  # prime it, so the first sample covers the first interval
        self.gpu_joules = self.cpu_joules = 0.0
        self._last = clock()

    @property
    def gpu_source(self) -> str | None:
        if not self.gpus:
            return None
        sources = {g.source for g in self.gpus}
        return "nvml_energy_counter" if sources == {"nvml_energy_counter"} else "nvml_power_integrated"

    @property
    def cpu_source(self) -> str:
        return "rapl" if self.rapl is not None else "estimate"

    def sample(self) -> dict[str, Any]:
        now = self.clock()
        dt, self._last = max(0.0, now - self._last), now
        for gpu in self.gpus:
            gpu.sample(dt)
        self.gpu_joules = sum(g.joules for g in self.gpus)
        if self.rapl is not None:
            self.cpu_joules += sum(zone.joules_since_last() for zone in self.rapl)
        else:
            watts = self.cpu_cores * CPU_WATTS_PER_CORE * min(100.0, max(0.0, self.cpu_utilization())) / 100.0
            self.cpu_joules += watts * dt
        return self.fields()

    def fields(self) -> dict[str, Any]:
        attempt_gpu_kwh, attempt_cpu_kwh = self.gpu_joules / JOULES_PER_KWH, self.cpu_joules / JOULES_PER_KWH
        gpu_kwh, cpu_kwh = self.before.gpu_kwh + attempt_gpu_kwh, self.before.cpu_kwh + attempt_cpu_kwh
        kwh = gpu_kwh + cpu_kwh
        fields: dict[str, Any] = {
            "kwh": kwh,
            "attempt_kwh": attempt_gpu_kwh + attempt_cpu_kwh,
            "co2_kg": carbon_kg(kwh, self.profile.grid_g_per_kwh, self.profile.pue),
            "gpu_kwh": gpu_kwh,
            "cpu_kwh": cpu_kwh,
            # GPUs draw most of a training node's power: their source when there are any, the CPU's otherwise.
            "source": self.gpu_source or self.cpu_source,
            "gpu_source": self.gpu_source,
            "cpu_source": self.cpu_source,
            "pue": self.profile.pue,
            "grid_g_per_kwh": self.profile.grid_g_per_kwh,
            "profile": self.profile.name,
        }
        if self.rapl is None:
            fields["cpu_estimate"] = CPU_ESTIMATE_BASIS.replace("cores", f"{self.cpu_cores} cores", 1)
        return fields


def _open_rapl(root: Path) -> list[_RaplZone] | None:
    """The package zones, or None when there are none or any cannot be read (then the CPU is estimated)."""
    try:
        paths = sorted(p for p in root.glob("intel-rapl:*") if _RAPL_PACKAGE.fullmatch(p.name))
        # psys (platform) already contains the packages: counting both would count the CPU twice.
        zones = [_RaplZone(p) for p in paths if _read_name(p) != "psys"]
    except (OSError, ValueError):
        return None
    return zones or None


def _read_name(zone: Path) -> str:
    try:
        return (zone / "name").read_text().strip()
    except OSError:
        return ""
