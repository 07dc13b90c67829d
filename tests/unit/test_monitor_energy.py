"""Energy and carbon (NVML counters, integrated power, RAPL with wraparound, the stated CPU estimate) and the
GPU sampler, against a fake NVML and a fake /sys/class/powercap: only the job's GPUs, failing NVML calls survived,
and totals that carry over restarts into summary.json."""

from __future__ import annotations

import json
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from fake_nvml import PatchedNvml, node_of

import appliance.hardware.visible as visible_module
import appliance.monitor.energy as energy_module
from appliance.errors import BadInput
from appliance.hardware.carbon import BLOOM_JEAN_ZAY, DEFAULT_PROFILE, carbon_kg, resolve_profile
from appliance.monitor.energy import CPU_WATTS_PER_CORE, EnergyMeter, previous_totals
from appliance.monitor.events import EventWriter, read_events
from appliance.monitor.gpu import GpuSampler, read_devices
from appliance.monitor.state import RunState, reduce
from appliance.monitor.summary import energy_summary, summarize
from appliance.rundir import RunDir


@pytest.fixture(autouse=True)
def whole_node_visible(monkeypatch: pytest.MonkeyPatch) -> None:
    """No job limits from the machine running the tests: each test sets the ones it is about."""
    for name in ("CUDA_VISIBLE_DEVICES", "SLURM_JOB_GPUS", "SLURM_GPUS_ON_NODE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(visible_module, "_torch_cuda_count", lambda: None)


class FakeNvmlError(Exception):
    pass


class FakeNvml:
    """The part of pynvml the monitor uses. Energy counters in mJ, power in mW, memory in bytes."""

    NVML_TEMPERATURE_GPU = 0

    def __init__(self, devices: int = 2, counter: bool = True) -> None:
        self.energy_mj = [1_000_000.0] * devices
        self.power_mw = [300_000.0] * devices
        self.counter = counter
        self.devices = devices

    def nvmlDeviceGetCount(self) -> int:
        return self.devices

    def nvmlDeviceGetHandleByIndex(self, index: int) -> int:
        return index

    def nvmlDeviceGetName(self, handle: int) -> bytes:
        return b"NVIDIA A100-SXM4-80GB"

    def nvmlDeviceGetUtilizationRates(self, handle: int) -> Any:
        return SimpleNamespace(gpu=97, memory=40)

    def nvmlDeviceGetMemoryInfo(self, handle: int) -> Any:
        return SimpleNamespace(used=70 * 2**30, total=80 * 2**30)

    def nvmlDeviceGetTemperature(self, handle: int, sensor: int) -> int:
        return 65

    def nvmlDeviceGetPowerUsage(self, handle: int) -> float:
        return self.power_mw[handle]

    def nvmlDeviceGetTotalEnergyConsumption(self, handle: int) -> float:
        if not self.counter:
            raise FakeNvmlError("Not Supported")
        return self.energy_mj[handle]


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def powercap(root: Path, zones: dict[str, tuple[int, int, str]]) -> Path:
    """zones: directory name -> (energy_uj, max_energy_range_uj, name)."""
    for zone, (energy, top, name) in zones.items():
        d = root / zone
        d.mkdir(parents=True)
        (d / "energy_uj").write_text(f"{energy}\n")
        (d / "max_energy_range_uj").write_text(f"{top}\n")
        (d / "name").write_text(f"{name}\n")
    return root


def test_carbon_and_profiles() -> None:
    # BLOOM's cluster: 1000 kWh of IT energy x PUE 1.2 x 57 g/kWh = 68.4 kg
    assert carbon_kg(1000.0, BLOOM_JEAN_ZAY.grid_g_per_kwh, BLOOM_JEAN_ZAY.pue) == pytest.approx(68.4)
    assert resolve_profile() is DEFAULT_PROFILE and resolve_profile("bloom-jean-zay") is BLOOM_JEAN_ZAY
    custom = resolve_profile("bloom-jean-zay", pue=1.1)
    assert (custom.grid_g_per_kwh, custom.pue) == (57.0, 1.1)
    with pytest.raises(BadInput, match="unknown"):
        resolve_profile("mars")
    with pytest.raises(BadInput, match="PUE"):
        resolve_profile(pue=0.9)


def test_gpu_energy_from_the_nvml_counter_and_cpu_from_rapl_with_wraparound(tmp_path: Path) -> None:
    root = powercap(
        tmp_path / "powercap",
        {
            "intel-rapl:0": (900_000_000, 1_000_000_000, "package-0"),
            "intel-rapl:0:0": (5, 1_000_000_000, "core"),  # inside package 0: not counted again
            "intel-rapl:1": (10, 1_000_000_000, "psys"),  # the whole platform: would double count
        },
    )
    nvml, clock = FakeNvml(devices=2), Clock()
    meter = EnergyMeter(nvml=nvml, sysfs_root=root, profile=BLOOM_JEAN_ZAY, clock=clock)
    # 10 s later: each GPU used 3.6 MJ (1 kWh... / 1000) -> 3_600_000 J = 1 kWh each
    nvml.energy_mj = [e + 3.6e9 for e in nvml.energy_mj]
    # package 0 wrapped: 900 M -> 1000 M (max) -> 260 M uJ = 360 J; 3.6 MJ is 1 kWh
    (root / "intel-rapl:0" / "energy_uj").write_text("260000000\n")
    clock.now = 10.0
    fields = meter.sample()
    assert fields["gpu_kwh"] == pytest.approx(2.0)
    assert fields["cpu_kwh"] == pytest.approx(360 / 3.6e6)
    assert fields["kwh"] == pytest.approx(2.0 + 1e-4)
    assert fields["co2_kg"] == pytest.approx(fields["kwh"] * 1.2 * 57 / 1000)
    assert (fields["source"], fields["gpu_source"], fields["cpu_source"]) == ("nvml_energy_counter",) * 2 + ("rapl",)
    assert (fields["pue"], fields["grid_g_per_kwh"]) == (1.2, 57.0) and "cpu_estimate" not in fields
    # a driver reload restarts the counter: the new reading is all new energy
    nvml.energy_mj = [3.6e6, 3.6e6]
    assert meter.sample()["gpu_kwh"] == pytest.approx(2.0 + 2 * 3.6e3 / 3.6e6)


def test_integrated_power_and_the_stated_cpu_estimate(tmp_path: Path) -> None:
    unreadable = tmp_path / "powercap"
    (unreadable / "intel-rapl:0").mkdir(parents=True)  # no energy_uj readable (root-only on real machines)
    nvml, clock = FakeNvml(devices=1, counter=False), Clock()
    meter = EnergyMeter(nvml=nvml, sysfs_root=unreadable, cpu_cores=4, cpu_utilization=lambda: 50.0, clock=clock)
    nvml.power_mw = [500_000.0]  # 300 W -> 500 W over 3600 s: trapezoid 400 W x 1 h = 0.4 kWh
    clock.now = 3600.0
    fields = meter.sample()
    assert fields["gpu_kwh"] == pytest.approx(0.4) and fields["gpu_source"] == "nvml_power_integrated"
    # 4 cores x 7.5 W x 50% for one hour
    assert fields["cpu_kwh"] == pytest.approx(4 * CPU_WATTS_PER_CORE * 0.5 / 1000)
    assert fields["cpu_source"] == "estimate" and "4 cores x 7.5 W/core" in fields["cpu_estimate"]


def test_no_nvml_means_no_devices_and_cpu_only_energy(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(energy_module, "load_nvml", lambda: None)
    assert read_devices(None) == []
    meter = EnergyMeter(sysfs_root=tmp_path, cpu_cores=2, cpu_utilization=lambda: 0.0)
    fields = meter.sample()
    assert fields["gpu_kwh"] == 0.0 and fields["source"] == "estimate" and fields["gpu_source"] is None


def test_gpu_sampler_writes_gpu_and_energy_events(tmp_path: Path) -> None:
    metrics = tmp_path / "metrics.jsonl"
    nvml = FakeNvml(devices=8)
    with EventWriter(metrics) as writer:
        meter = EnergyMeter(nvml=nvml, sysfs_root=tmp_path / "none", cpu_cores=2, cpu_utilization=lambda: 10.0)
        sampler = GpuSampler(writer, node="node07", interval_s=0.02, energy=meter, nvml=nvml)
        sampler.start()
        deadline = time.monotonic() + 5
        while len(list(read_events(metrics))) < 4 and time.monotonic() < deadline:
            time.sleep(0.01)
        sampler.stop()
    events = list(read_events(metrics))
    gpu = [e for e in events if e["kind"] == "gpu"]
    energy = [e for e in events if e["kind"] == "energy"]
    assert len(gpu) >= 3 and len(gpu) == len(energy)  # every tick, plus the final one at stop()
    device = gpu[0]["devices"][3]
    assert gpu[0]["node"] == "node07" and len(gpu[0]["devices"]) == 8
    assert device == {
        "index": 3,
        "name": "NVIDIA A100-SXM4-80GB",
        "util": 97.0,
        "memory_used_gb": 70.0,
        "memory_total_gb": 80.0,
        "temperature_c": 65.0,
        "power_w": 300.0,
    }
    assert {"kwh", "co2_kg", "gpu_kwh", "cpu_kwh", "source", "pue", "grid_g_per_kwh"} <= set(energy[-1])
    state = RunState()
    for event in events:
        reduce(state, event)
    summary = energy_summary(state)
    assert summary["energy_kwh"] == energy[-1]["kwh"] and summary["energy_source"] == "nvml_energy_counter"
    json.dumps(summary)


def test_a_failing_tick_becomes_one_warning_and_the_thread_goes_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    metrics = tmp_path / "metrics.jsonl"
    with EventWriter(metrics) as writer:
        emit = writer.emit

        def emit_failing_gpu(kind: str, **fields: Any) -> dict[str, Any]:
            if kind == "gpu":
                raise OSError("disk full")
            return emit(kind, **fields)

        monkeypatch.setattr(writer, "emit", emit_failing_gpu)
        sampler = GpuSampler(writer, node="n", interval_s=10.0, nvml=FakeNvml())
        sampler.tick_safely()
        sampler.tick_safely()
    warnings = [e for e in read_events(metrics) if e["kind"] == "warning"]
    assert len(warnings) == 1 and "disk full" in warnings[0]["message"]


# ---- the job's GPUs only, failing NVML calls, restarts ------------------------------------------------------
KWH_MJ = 3.6e9  # 1 kWh = 3.6 MJ = 3.6e9 mJ, NVML's energy unit


def test_only_the_jobs_gpus_are_sampled(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A job given GPUs 1 and 3 of 8: its gpu events list those two, its energy counts those two, and no other GPU
    is read at all (another job's draw is not this run's)."""
    nvml = PatchedNvml(monkeypatch, node_of(8))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1,3")
    clock = Clock()
    meter = EnergyMeter(sysfs_root=tmp_path / "none", cpu_cores=2, cpu_utilization=lambda: 0.0, clock=clock)
    with EventWriter(tmp_path / "metrics.jsonl") as writer:
        sampler = GpuSampler(writer, node="n", energy=meter)
        for gpu in nvml.gpus:
            gpu.energy_mj += KWH_MJ
        clock.now = 60.0
        sampler.tick()
    gpu_event, energy = list(read_events(tmp_path / "metrics.jsonl"))
    assert [d["index"] for d in gpu_event["devices"]] == [1, 3]
    assert energy["gpu_kwh"] == pytest.approx(2.0)
    job = {nvml.gpus[1].uuid, nvml.gpus[3].uuid}
    for function in ("nvmlDeviceGetTotalEnergyConsumption", "nvmlDeviceGetPowerUsage", "nvmlDeviceGetTemperature"):
        assert set(nvml.read_uuids(function)) == job, function


def test_a_failing_nvml_call_is_survived_and_the_rest_still_sampled(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """NOT_SUPPORTED where boards and MIG instances give it: no power or temperature on GPU 0, no utilization and
    no energy counter on GPU 1 (its energy is integrated power instead). Every tick still writes both events."""
    gpus = node_of(2)
    gpus[0].failing = {"nvmlDeviceGetPowerUsage", "nvmlDeviceGetTemperature"}
    gpus[1].failing = {"nvmlDeviceGetUtilizationRates", "nvmlDeviceGetTotalEnergyConsumption"}
    nvml = PatchedNvml(monkeypatch, gpus)
    clock = Clock()
    meter = EnergyMeter(sysfs_root=tmp_path / "none", cpu_cores=2, cpu_utilization=lambda: 0.0, clock=clock)
    with EventWriter(tmp_path / "metrics.jsonl") as writer:
        sampler = GpuSampler(writer, node="n", energy=meter)
        gpus[0].energy_mj += KWH_MJ
        clock.now = 3600.0  # GPU 1 at a steady 300 W for an hour: 0.3 kWh
        sampler.tick_safely()
        gpus[0].failing.add("nvmlDeviceGetTotalEnergyConsumption")  # the counter stops answering mid-run
        clock.now = 7200.0
        sampler.tick_safely()
    events = list(read_events(tmp_path / "metrics.jsonl"))
    assert [e["kind"] for e in events] == ["gpu", "energy", "gpu", "energy"]  # no warning: nothing stopped
    first = events[0]["devices"]
    assert (first[0]["power_w"], first[0]["temperature_c"], first[0]["util"]) == (None, None, 90.0)
    assert (first[1]["power_w"], first[1]["temperature_c"], first[1]["util"]) == (300.0, 60.0, None)
    assert events[1]["gpu_kwh"] == pytest.approx(1.0 + 0.3) and events[1]["gpu_source"] == "nvml_power_integrated"
    # GPU 0 now has neither counter nor power: it adds nothing more; GPU 1 adds another 0.3 kWh.
    assert events[3]["gpu_kwh"] == pytest.approx(1.0 + 0.6)
    assert nvml.read_uuids("nvmlDeviceGetTemperature").count(gpus[1].uuid) == 2


def test_two_attempts_energy_add_up_in_summary_json(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The agent restarts the workers: attempt 2's sampler carries on from attempt 1's last total on this node, so
    summary.json reports both attempts, not the last one."""
    run_dir = RunDir(tmp_path)
    clock = Clock()

    def attempt(gpu_kwh_each: float) -> None:
        nvml = PatchedNvml(monkeypatch, node_of(2))  # a new process: the counters read wherever they are
        before = previous_totals(run_dir.metrics, "node07")
        meter = EnergyMeter(
            sysfs_root=tmp_path / "none", cpu_cores=2, cpu_utilization=lambda: 50.0, clock=clock, before=before
        )
        with EventWriter(run_dir.metrics) as writer:
            sampler = GpuSampler(writer, node="node07", energy=meter)
            for gpu in nvml.gpus:
                gpu.energy_mj += gpu_kwh_each * KWH_MJ
            clock.now += 3600.0
            sampler.tick()
            writer.emit("warning", message="another event after the node's last energy event")

    assert previous_totals(run_dir.metrics, "node07") == energy_module.EnergyTotals()
    attempt(1.0)
    attempt(0.5)
    cpu_kwh_per_attempt = 2 * CPU_WATTS_PER_CORE * 0.5 / 1000  # 2 cores x 7.5 W x 50% for one hour
    energies = [e for e in read_events(run_dir.metrics) if e["kind"] == "energy"]
    assert energies[1]["attempt_kwh"] == pytest.approx(2 * 0.5 + cpu_kwh_per_attempt)
    summary = summarize(run_dir, state="done", wall_seconds=7200.0, stage_seconds={})
    (run_dir.root / "summary.json").write_text(json.dumps(summary))
    written = json.loads((run_dir.root / "summary.json").read_text())
    assert written["gpu_kwh"] == pytest.approx(2 * 1.0 + 2 * 0.5)
    assert written["energy_kwh"] == pytest.approx(3.0 + 2 * cpu_kwh_per_attempt)
    assert written["co2_kg"] == pytest.approx(
        carbon_kg(written["energy_kwh"], DEFAULT_PROFILE.grid_g_per_kwh, DEFAULT_PROFILE.pue)
    )
