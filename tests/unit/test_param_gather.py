"""The optimizer's pieces that need no ranks: the AdamW kernel choice, the resumed step count where a fused kernel
reads it, the check that DeepSpeed still ends its step the way parallel/zero/param_gather.py was written against, and
the plan key that switches the overlap (the gather itself runs in tests/distributed/test_overlap_param_gather.py)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from appliance.data.sample_corpus import SAMPLE_CORPUS_DIR
from appliance.errors import BadInput
from appliance.parallel.checkpoint.optimizer_state import load_optimizer_state
from appliance.parallel.step.build import adamw_kernel
from appliance.parallel.zero import param_gather
from appliance.planner.runspec import load_spec
from appliance.run_request import RunRequest, make_run_plan


@pytest.mark.parametrize(
    ("device", "want"), [("cpu", "fused"), ("cuda", "fused"), ("xpu", "foreach"), ("meta", "foreach")]
)
def test_adamw_is_fused_where_torch_has_the_kernel(device: str, want: str) -> None:
    assert adamw_kernel(torch.device(device)) == {want: True}


def test_a_fused_adamw_built_by_the_engine_steps_with_the_fused_kernel() -> None:
    param = torch.nn.Parameter(torch.ones(4))
    optimizer = torch.optim.AdamW([param], lr=0.1, **adamw_kernel(param.device))
    param.grad = torch.ones(4)
    optimizer.step()
    assert optimizer.param_groups[0]["fused"] is True and optimizer.defaults["fused"] is True
    # torch keeps a fused AdamW's step count as fp32 on the parameter's device, where the kernel reads it.
    assert optimizer.state[param]["step"].dtype == torch.float32


@pytest.mark.parametrize("fused", [True, False])
def test_a_resumed_step_count_is_where_the_kernel_reads_it(fused: bool) -> None:
    """What parallel/checkpoint/optimizer_state.py loads is what torch itself would hold: for a fused AdamW fp32 on the
    parameter's device (a CPU scalar fails a CUDA fused kernel), else a CPU scalar. The parameter stands on the meta
    device (swapped in after construction, as DeepSpeed swaps in its master partitions), so that "on the parameter's
    device" and "on the CPU" differ on a machine without a GPU."""
    optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.ones(3))], lr=0.1, fused=fused or None)
    param = torch.nn.Parameter(torch.ones(3, device="meta"))
    optimizer.param_groups[0]["params"] = [param]
    state = {"w.exp_avg": torch.zeros(3), "w.exp_avg_sq": torch.zeros(3), "w.step": torch.tensor(7)}
    assert load_optimizer_state([("w", param)], optimizer, state.keys(), lambda k, _: state[k])
    step = optimizer.state[param]["step"]
    assert step.dtype == torch.float32
    assert step.device == (param.device if fused else torch.device("cpu"))


def test_a_resumed_fused_adamw_steps_on() -> None:
    param = torch.nn.Parameter(torch.ones(3))
    optimizer = torch.optim.AdamW([param], lr=0.1, fused=True)
    state = {"w.exp_avg": torch.zeros(3), "w.exp_avg_sq": torch.zeros(3), "w.step": torch.tensor(7)}
    assert load_optimizer_state([("w", param)], optimizer, state.keys(), lambda k, _: state[k])
    param.grad = torch.ones(3)
    optimizer.step()
    assert float(optimizer.state[param]["step"]) == 8.0


def test_deepspeed_still_ends_its_steps_with_the_gather_we_replace(monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib

    from deepspeed.runtime.bf16_optimizer import BF16_Optimizer
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    param_gather.check_deepspeed_structure()  # this DeepSpeed (0.19.8) is what the module was read from
    assert {cls.__name__ for cls in (BF16_Optimizer, DeepSpeedZeroOptimizer)} == set(param_gather.BUFFERS)
    for name in param_gather.PATCHED_MODULES:
        module = importlib.import_module(name)
        monkeypatch.setattr(module, "all_gather_dp_groups", lambda *args: None)
        with pytest.raises(param_gather.DeepSpeedStructureError, match=f"{name}.all_gather_dp_groups"):
            param_gather.check_deepspeed_structure()
        monkeypatch.undo()


def test_an_optimizer_without_the_flat_buffers_is_refused_by_name() -> None:
    class BF16_Optimizer:  # DeepSpeed's class name, which the check looks the buffers up by
        def __init__(self) -> None:
            self.bf16_groups_flat: list[Any] = []
            self.real_dp_process_group: list[Any] = []

    with pytest.raises(param_gather.DeepSpeedStructureError, match="bf16_partitioned_groups"):
        param_gather.check_deepspeed_structure(BF16_Optimizer())


def test_the_dispatcher_leaves_optimizers_it_does_not_know_to_deepspeed() -> None:
    calls = []
    dispatcher = param_gather._Dispatcher(lambda *args: calls.append(args))
    dispatcher([torch.zeros(2)], [[torch.zeros(1)]], ["group"], 2, 8)
    assert len(calls) == 1


@pytest.fixture(scope="module")
def default_plan() -> dict[str, Any]:
    return json.loads(make_run_plan(RunRequest(corpus=[SAMPLE_CORPUS_DIR], hardware="cpu-laptop-2core")).dumps())


def test_overlap_param_gather_is_an_optional_plan_key(tmp_path: Path, default_plan: dict[str, Any]) -> None:
    assert default_plan["train"]["overlap_param_gather"] is True  # written out
    plan = json.loads(json.dumps(default_plan))
    path = tmp_path / "plan.json"
    del plan["train"]["overlap_param_gather"]  # an older plan
    path.write_text(json.dumps(plan))
    assert load_spec(path).train.overlap_param_gather is True
    plan["train"]["overlap_param_gather"] = False
    path.write_text(json.dumps(plan))
    spec = load_spec(path)
    assert spec.train.overlap_param_gather is False and spec.to_json()["train"]["overlap_param_gather"] is False
    plan["train"]["overlap_param_gather"] = 1
    path.write_text(json.dumps(plan))
    with pytest.raises(BadInput, match=r"overlap_param_gather.*true or false"):
        load_spec(path)
