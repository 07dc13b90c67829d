"""Hardware detection (with faked NVML, /sys and SLURM), profiles and the specs table."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from appliance.errors import BadInput
from appliance.hardware import GPU_SPECS, Hardware, detect, format_hardware, load_hardware, match_nvml_name
from appliance.hardware.specs import gpu_spec

GIB = 2**30


class FakeNvml:
    """The slice of pynvml that detect() uses: 8 A100s on NVSwitch, all peers reachable."""

    NVML_NVLINK_MAX_LINKS = 18
    NVML_FEATURE_ENABLED = 1
    NVML_P2P_CAPS_INDEX_READ = (0,)  # as some pynvml releases define it
    NVML_P2P_STATUS_OK = 0

    def __init__(self, count: int = 8, name: str = "NVIDIA A100-SXM4-80GB", links: int = 12) -> None:
        self.count, self.name, self.links = count, name, links
        self.shut_down = False

    def nvmlInit(self) -> None:
        pass

    def nvmlShutdown(self) -> None:
        self.shut_down = True

    def nvmlDeviceGetCount(self) -> int:
        return self.count

    def nvmlDeviceGetHandleByIndex(self, i: int) -> int:
        return i

    def nvmlDeviceGetName(self, h: int) -> bytes:
        return self.name.encode()  # older pynvml returns bytes

    def nvmlDeviceGetMemoryInfo(self, h: int) -> object:
        return type("Mem", (), {"total": 80 * GIB})()

    def nvmlDeviceGetNvLinkState(self, h: int, link: int) -> int:
        if link >= self.links:
            raise RuntimeError("NVML_ERROR_INVALID_ARGUMENT")
        return 1

    def nvmlDeviceGetP2PStatus(self, a: int, b: int, cap: int) -> int:
        assert isinstance(cap, int)
        return 0

    def nvmlDeviceGetPowerManagementLimit(self, h: int) -> int:
        return 400_000  # mW


class BrokenNvml(FakeNvml):
    def nvmlInit(self) -> None:
        raise RuntimeError("NVML Shared Library Not Found")


class NoPowerNvml(FakeNvml):
    def nvmlDeviceGetPowerManagementLimit(self, h: int) -> int:
        raise RuntimeError("NVML_ERROR_NOT_SUPPORTED")


def write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text + "\n")


@pytest.fixture
def fake_sys(tmp_path: Path) -> Path:
    """A /sys tree with one InfiniBand HDR port, two Omni-Path ports, a 100 GbE NIC and a virtual bridge."""
    ib = tmp_path / "class/infiniband/mlx5_0/ports/1"
    write(ib / "state", "4: ACTIVE")
    write(ib / "rate", "200 Gb/sec (4X HDR)")
    write(ib / "link_layer", "InfiniBand")
    for dev in ("hfi1_0", "hfi1_1"):
        port = tmp_path / f"class/infiniband/{dev}/ports/1"
        write(port / "state", "4: ACTIVE")
        write(port / "rate", "100 Gb/sec (4X EDR)")
    eth = tmp_path / "class/net/enp1s0"
    write(eth / "speed", "100000")
    write(eth / "operstate", "up")
    write(eth / "type", "1")
    (eth / "device").mkdir()
    virtual = tmp_path / "class/net/docker0"
    write(virtual / "speed", "-1")
    write(virtual / "operstate", "down")
    write(virtual / "type", "1")
    write(tmp_path / "class/net/lo/type", "772")
    return tmp_path


def test_detect_here_never_crashes() -> None:
    hw = detect()
    assert isinstance(hw, Hardware)
    assert hw.cpu_cores >= 1 and hw.ram_gb > 0
    json.dumps(hw.to_dict())
    assert format_hardware(hw)


def test_detect_without_nvml_slurm_or_fabric(tmp_path: Path) -> None:
    hw = detect(sys_root=tmp_path, env={}, nvml=BrokenNvml())
    assert (hw.gpus_per_node, hw.gpu, hw.nodes) == (0, "none", 1)
    assert (hw.intra_node, hw.inter_node) == ("loopback", "none")
    assert hw.slurm is None
    notes = " | ".join(hw.notes)
    assert "NVML did not start" in notes and "SLURM" in notes and "infiniband" in notes


def test_detect_with_fake_nvml_sys_and_slurm(fake_sys: Path) -> None:
    env = {
        "SLURM_JOB_ID": "4242",
        "SLURM_JOB_NUM_NODES": "48",
        "SLURM_JOB_NODELIST": "jean-zay-iam[01-48]",
        "SLURM_NTASKS": "48",
        "SLURM_NTASKS_PER_NODE": "1(x48)",
        "SLURM_GPUS_PER_NODE": "a100:8",
        "SLURM_CPUS_PER_TASK": "64",
    }
    nvml = FakeNvml()
    hw = detect(sys_root=fake_sys, env=env, nvml=nvml)
    assert nvml.shut_down
    assert (hw.nodes, hw.gpus_per_node, hw.gpu, hw.gpu_memory_gb) == (48, 8, "A100-SXM4-80GB", 80.0)
    assert (hw.intra_node, hw.intra_node_gbps) == ("nvlink", 2400.0)
    assert (hw.inter_node, hw.inter_node_gbps) == ("omnipath", 200.0)  # Omni-Path wins over the IB port
    g0 = hw.gpus[0]
    assert (g0.nvlink_links, g0.nvlink_active, g0.p2p, g0.power_limit_w) == (12, 12, (1, 2, 3, 4, 5, 6, 7), 400.0)
    assert [p.rate_gbps for p in hw.infiniband] == [200.0] and len(hw.omnipath) == 2
    assert {e.interface: (e.speed_gbps, e.virtual) for e in hw.ethernet} == {
        "enp1s0": (100.0, False),
        "docker0": (None, True),
    }
    s = hw.slurm
    assert s is not None
    assert (s.job_id, s.nodes, s.tasks, s.tasks_per_node, s.gpus_per_node, s.cpus_per_task) == (
        "4242",
        48,
        48,
        1,
        8,
        64,
    )
    assert s.node_list == "jean-zay-iam[01-48]"
    text = format_hardware(hw)
    assert "slurm     job 4242" in text and "NVLink 12/12 up" in text
    json.dumps(hw.to_dict())


def test_detect_infiniband_only_and_probe_failures(tmp_path: Path) -> None:
    port = tmp_path / "class/infiniband/mlx5_0/ports/1"
    write(port / "state", "4: ACTIVE")
    write(port / "rate", "garbage")
    write(port / "link_layer", "InfiniBand")
    hw = detect(sys_root=tmp_path, env={"SLURM_JOB_ID": "1"}, nvml=NoPowerNvml(count=2, links=0))
    assert hw.intra_node == "pcie" and hw.gpus[0].power_limit_w is None
    assert hw.inter_node == "infiniband" and hw.inter_node_gbps == 0.0
    notes = " | ".join(hw.notes)
    assert "power limit unknown" in notes and "rate unreadable" in notes and "SLURM_JOB_NUM_NODES" in notes


def test_detect_multi_node_without_fabric_assumes_ethernet(tmp_path: Path) -> None:
    hw = detect(sys_root=tmp_path, env={"SLURM_JOB_ID": "7", "SLURM_NNODES": "2"}, nvml=BrokenNvml())
    assert hw.nodes == 2 and hw.inter_node == "ethernet" and hw.inter_node_gbps > 0


def test_gpu_names_from_nvml() -> None:
    cases = {
        "NVIDIA A100-SXM4-80GB": "A100-SXM4-80GB",
        "NVIDIA A100-SXM4-40GB": "A100-SXM4-40GB",
        "NVIDIA A100 80GB PCIe": "A100-PCIe-80GB",
        "NVIDIA A100-PCIE-40GB": "A100-PCIe-40GB",
        "NVIDIA H100 80GB HBM3": "H100-SXM5-80GB",
        "NVIDIA H100 PCIe": "H100-PCIe",
        "NVIDIA H200": "H200",
        "NVIDIA L40S": "L40S",
        "NVIDIA A10": "A10",
        "Tesla V100-SXM2-32GB": "V100-SXM2-32GB",
        "NVIDIA GeForce RTX 4090": "RTX-4090",
    }
    for nvml_name, canonical in cases.items():
        spec = match_nvml_name(nvml_name)
        assert spec is not None and spec.name == canonical, nvml_name
    assert match_nvml_name("Some Future GPU") is None


def test_specs_table_is_sane() -> None:
    for spec in GPU_SPECS.values():
        assert spec.peak_tflops > 0 and spec.memory_gb > 0 and spec.memory_bw_gbs > 0 and spec.tdp_w > 0
        assert gpu_spec(spec.name.lower()) is spec
    assert GPU_SPECS["A100-SXM4-80GB"].intra_node_gbps_nvlink == 2400.0
    assert not GPU_SPECS["V100-SXM2-32GB"].bf16


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ("nodes = 1", "missing key 'gpus_per_node'"),
        ("speed = 3\n", "unknown key 'speed'"),
        ('nodes = "two"\n', "key 'nodes' must be an integer"),
        ('gpu = "TPU-v4"\n', "gpu 'TPU-v4' is not in the specs table"),
        ('intra_node = "carrier-pigeon"\n', "intra_node must be one of"),
        ("nodes = 2\n", "2 nodes need an inter_node link"),
    ],
)
def test_load_hardware_bad_input_names_file_and_key(tmp_path: Path, body: str, message: str) -> None:
    base = {
        "nodes": "1",
        "gpus_per_node": "8",
        "gpu": '"A100-SXM4-80GB"',
        "gpu_memory_gb": "80",
        "intra_node": '"nvlink"',
        "intra_node_gbps": "2400",
        "inter_node": '"none"',
        "inter_node_gbps": "0",
        "cpu_cores": "64",
        "ram_gb": "512",
    }
    if body == "nodes = 1":
        lines = ["nodes = 1"]
    else:
        key = body.split("=")[0].strip()
        base[key] = body.split("=", 1)[1].strip()
        lines = [f"{k} = {v}" for k, v in base.items()]
    path = tmp_path / "box.toml"
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(BadInput) as err:
        load_hardware(str(path))
    assert str(path) in str(err.value) and message in str(err.value)


def test_load_hardware_by_name_and_unknown_name() -> None:
    hw = load_hardware("jean-zay-a100-48n")
    assert (hw.nodes, hw.gpus_per_node, hw.world_gpus, hw.inter_node, hw.inter_node_gbps) == (
        48,
        8,
        384,
        "omnipath",
        400.0,
    )
    with pytest.raises(BadInput, match="unknown hardware preset 'nope'"):
        load_hardware("nope")
    with pytest.raises(BadInput, match="no such file"):
        load_hardware("/nonexistent/box.toml")
