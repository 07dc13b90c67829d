"""`bench`'s sizing: what --micro-batch, --steps, --micro-batches and --quick make of the plan, on CPU and (with the
hardware profile and the device chosen for it) on one H100, without a GPU."""

from __future__ import annotations

import pytest
import torch

import appliance.hardware
from appliance.benchmark import workload
from appliance.benchmark.hf_peers import compile_backend
from appliance.benchmark.workload import BenchSize, plan_workload
from appliance.errors import BadInput
from appliance.hardware import load_hardware


@pytest.fixture
def on_machine(monkeypatch: pytest.MonkeyPatch):
    """on_machine(preset, cuda): plan_workload sees this hardware profile and bench device."""

    def use(preset: str, cuda: bool) -> None:
        monkeypatch.setattr(appliance.hardware, "detect", lambda: load_hardware(preset))
        device = torch.device("cuda", 0) if cuda else torch.device("cpu")
        monkeypatch.setattr(workload, "bench_device", lambda gpus_per_node: device)

    return use


def test_quick_on_cpu_is_the_micro_model_smoke_run(on_machine) -> None:
    on_machine("cpu-laptop-2core", cuda=False)
    work = plan_workload(None, quick=True)
    assert work.spec.model.name == "bloom-micro-test"
    assert (work.warmup_steps, work.steps, work.interleaved) == (1, 3, True)
    assert compile_backend(work) == "eager"  # graph capture only: no C++ build of generated kernels


def test_quick_on_a_gpu_is_bloom_560m_at_micro_batch_2(on_machine) -> None:
    on_machine("h100-sxm5-x1", cuda=True)
    work = plan_workload(None, quick=True)
    assert work.spec.model.name == "bloom-560m"
    assert (work.spec.train.micro_batch_size, work.micro_batches) == (2, 1)
    assert work.spec.layout.micro_batch_size == 2 and work.spec.layout.global_batch_size == 2
    assert work.tokens_per_step == 2 * 2048
    assert (work.warmup_steps, work.steps, work.interleaved) == (2, 5, False)
    assert compile_backend(work) == "inductor"  # the peer worth measuring on a GPU (CPU --quick: graph capture)


def test_micro_batch_replaces_the_plans_and_a_step_is_one_micro_batch(on_machine) -> None:
    on_machine("h100-sxm5-x1", cuda=True)
    planned = plan_workload("bloom-1b7")
    assert planned.micro_batches > 1  # the plan's accumulation: one data-parallel rank's share of a real step
    sized = plan_workload("bloom-1b7", size=BenchSize(micro_batch=4, steps=7))
    assert (sized.spec.train.micro_batch_size, sized.micro_batches, sized.steps) == (4, 1, 7)
    assert sized.spec.train.global_batch_size == sized.spec.layout.global_batch_size == 4
    assert sized.warmup_steps == planned.warmup_steps == 3  # the warm-up stays


def test_micro_batches_ask_for_gradient_accumulation(on_machine) -> None:
    on_machine("h100-sxm5-x1", cuda=True)
    work = plan_workload("bloom-560m", size=BenchSize(micro_batch=2, micro_batches=3))
    assert (work.spec.train.micro_batch_size, work.micro_batches) == (2, 3)
    assert work.spec.train.global_batch_size == 6 and work.tokens_per_step == 3 * 2 * 2048
    assert [len(step) for step in work.batches()[:2]] == [3, 3]


@pytest.mark.parametrize("flag", ["micro_batch", "steps", "micro_batches"])
@pytest.mark.parametrize("value", [0, -2])
def test_a_size_below_one_names_its_flag(flag: str, value: int) -> None:
    with pytest.raises(BadInput, match=f"--{flag.replace('_', '-')} {value}: must be a whole number of at least 1"):
        BenchSize(**{flag: value})
