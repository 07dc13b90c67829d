"""Hardware detection (with faked NVML, /sys and SLURM), profiles and the specs table."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from fake_nvml import FakeGpu, PatchedNvml, node_of

from appliance.errors import BadInput
from appliance.hardware import GPU_SPECS, Hardware, detect, format_hardware, load_hardware, match_nvml_name
from appliance.hardware.specs import gpu_spec

GIB = 2**30


def no_cuda() -> None:
    """torch's device count where torch sees no CUDA: the fakes decide alone, whatever machine runs the tests."""
    return None


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
    hw = detect(sys_root=fake_sys, env=env, nvml=nvml, cuda_count=no_cuda)
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
    hw = detect(sys_root=tmp_path, env={"SLURM_JOB_ID": "1"}, nvml=NoPowerNvml(count=2, links=0), cuda_count=no_cuda)
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


# ---- the GPUs the job may use, not all the node's ---------------------------------------------------------------
UUIDS = [gpu.uuid for gpu in node_of(8)]


@pytest.mark.parametrize(
    ("env", "indices", "limited_by"),
    [
        ({}, [0, 1, 2, 3, 4, 5, 6, 7], ()),
        ({"CUDA_VISIBLE_DEVICES": "3"}, [3], ("CUDA_VISIBLE_DEVICES",)),
        ({"CUDA_VISIBLE_DEVICES": "0,2"}, [0, 2], ("CUDA_VISIBLE_DEVICES",)),
        ({"CUDA_VISIBLE_DEVICES": "6, 1"}, [6, 1], ("CUDA_VISIBLE_DEVICES",)),  # CUDA's order, which may differ
        ({"CUDA_VISIBLE_DEVICES": f"{UUIDS[5]},{UUIDS[2][:12]}"}, [5, 2], ("CUDA_VISIBLE_DEVICES",)),  # a prefix too
        ({"CUDA_VISIBLE_DEVICES": ""}, [], ("CUDA_VISIBLE_DEVICES",)),
        ({"CUDA_VISIBLE_DEVICES": "-1"}, [], ("CUDA_VISIBLE_DEVICES",)),
        ({"CUDA_VISIBLE_DEVICES": "4,-1,5"}, [4], ("CUDA_VISIBLE_DEVICES",)),  # CUDA stops at -1
        ({"SLURM_GPUS_ON_NODE": "2"}, [0, 1], ("SLURM_GPUS_ON_NODE",)),
        ({"SLURM_JOB_GPUS": "4,5"}, [4, 5], ("SLURM_JOB_GPUS",)),
        ({"SLURM_JOB_GPUS": "1-3"}, [1, 2, 3], ("SLURM_JOB_GPUS",)),
        ({"SLURM_GPUS_ON_NODE": "16"}, [0, 1, 2, 3, 4, 5, 6, 7], ()),  # never more than NVML sees
        (
            {"CUDA_VISIBLE_DEVICES": "4,5,6", "SLURM_JOB_GPUS": "0", "SLURM_GPUS_ON_NODE": "2"},
            [4, 5],
            ("CUDA_VISIBLE_DEVICES", "SLURM_GPUS_ON_NODE"),
        ),
    ],
)
def test_detect_counts_the_gpus_the_job_may_use(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, env: dict[str, str], indices: list[int], limited_by: tuple[str]
) -> None:
    PatchedNvml(monkeypatch, node_of(8))
    hw = detect(sys_root=tmp_path, env=env, cuda_count=no_cuda)
    assert [g.index for g in hw.gpus] == indices and hw.gpus_per_node == len(indices)
    assert hw.gpus_limited_by == limited_by
    if indices:
        assert hw.gpus[0].p2p == tuple(indices[1:])  # peers among the job's GPUs only
    else:
        assert (hw.gpu, hw.intra_node) == ("none", "loopback")
    notes = " | ".join(hw.notes)
    if limited_by:
        assert f"this job may use {len(indices)} of the 8 GPUs NVML sees here (limited by" in notes
        assert ", ".join(limited_by) in format_hardware(hw)
    assert json.loads(json.dumps(hw.to_dict()))["gpus_limited_by"] == list(limited_by)


def test_torch_sees_fewer_devices_than_nvml(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    PatchedNvml(monkeypatch, node_of(8))
    hw = detect(sys_root=tmp_path, env={}, cuda_count=lambda: 2)
    assert hw.gpus_per_node == 2 and hw.gpus_limited_by == ("torch.cuda.device_count()",)


def test_slurm_job_gpus_under_a_device_cgroup(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """The cgroup hides the node's other GPUs: NVML numbers the two allocated ones 0 and 1, SLURM calls them 4, 5."""
    PatchedNvml(monkeypatch, node_of(2))
    hw = detect(sys_root=tmp_path, env={"SLURM_JOB_GPUS": "4,5"}, cuda_count=no_cuda)
    assert [g.index for g in hw.gpus] == [0, 1] and hw.gpus_limited_by == ()


def test_detect_describes_the_visible_gpus_not_the_node(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    gpus = node_of(8)
    for gpu in gpus[4:]:
        gpu.name, gpu.memory_gb = "NVIDIA H100 80GB HBM3", 79.6
    PatchedNvml(monkeypatch, gpus)
    hw = detect(sys_root=tmp_path, env={"CUDA_VISIBLE_DEVICES": "5,4"}, cuda_count=no_cuda)
    assert (hw.gpu, hw.gpu_memory_gb, hw.gpus_per_node) == ("H100-SXM5-80GB", 79.6, 2)
    assert not any("mixed GPU models" in note for note in hw.notes)


def test_a_mig_instance_named_by_uuid(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    gpus = node_of(2)
    slices = [FakeGpu(uuid=f"MIG-7d3f0c2a-1111-5222-8333-00000000000{i}", memory_gb=9.5) for i in range(2)]
    for mig in slices:
        mig.name = "NVIDIA A100-SXM4-80GB MIG 1g.10gb"
    gpus[1].mig = slices
    PatchedNvml(monkeypatch, gpus)
    hw = detect(sys_root=tmp_path, env={"CUDA_VISIBLE_DEVICES": slices[1].uuid}, cuda_count=no_cuda)
    (gpu,) = hw.gpus
    assert (gpu.index, gpu.name, gpu.memory_gb) == (1, "NVIDIA A100-SXM4-80GB MIG 1g.10gb", 9.5)
    assert any("MIG instances" in note for note in hw.notes)


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"CUDA_VISIBLE_DEVICES": "9"}, "CUDA_VISIBLE_DEVICES='9': entry '9' is unusable: there is no GPU 9 here"),
        ({"CUDA_VISIBLE_DEVICES": "0,gpu1"}, "entry 'gpu1' is unusable: an entry must be a GPU index, a GPU-<uuid>"),
        ({"CUDA_VISIBLE_DEVICES": "0,,1"}, "entry '' is unusable"),
        ({"CUDA_VISIBLE_DEVICES": "GPU-ffff"}, "entry 'GPU-ffff' is unusable: it matches no device here"),
        ({"CUDA_VISIBLE_DEVICES": "GPU-0"}, "entry 'GPU-0' is unusable: it matches 8 devices here"),
        ({"CUDA_VISIBLE_DEVICES": f"1,{UUIDS[1]}"}, "names a device already listed"),
        ({"CUDA_VISIBLE_DEVICES": "MIG-GPU-x/1/0"}, "MIG-GPU-<uuid>/<gi>/<ci> form"),
        ({"SLURM_GPUS_ON_NODE": "two"}, "SLURM_GPUS_ON_NODE='two': expected a GPU count"),
        ({"SLURM_JOB_GPUS": "0,a100"}, "SLURM_JOB_GPUS='0,a100': 'a100' is not a GPU index"),
    ],
)
def test_a_bad_gpu_variable_is_refused_with_a_clear_message(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, env: dict[str, str], message: str
) -> None:
    PatchedNvml(monkeypatch, node_of(8))
    with pytest.raises(BadInput) as err:
        detect(sys_root=tmp_path, env=env, cuda_count=no_cuda)
    assert message in str(err.value)
