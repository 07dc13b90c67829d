"""`plan --layout` refuses every layout the training ranks refuse, in the same words.

Each case is a layout the engine's own check (parallel/step/build.py ``check_engine_layout``: experts, the 2D mesh's
precision and ZeRO, the expert store) refuses on the ranks today. It goes through the `plan` command and through that
rank-side check; both must fail, naming the same broken rules in the same text. The expert store's rules depend on
run settings `plan` has no flag for (train.expert_*_budget_mb): they go through ``Layout.validate``, which `plan`,
the head reading plan.json and every rank call, and through the rank-side check.
"""

from __future__ import annotations

import re

import pytest

from appliance import cli
from appliance.errors import BadInput
from appliance.model.config import config_for_shape
from appliance.parallel.step.build import check_engine_layout
from appliance.parallel.topology import ParallelTopology
from appliance.planner import load_model_shape, parse_layout
from appliance.planner.layout import Layout

DENSE, MOE = "bloom-micro-test", "bloom-moe-tiny-cpu"
HARDWARE = "cpu-laptop-2core"  # on CPU the world is the layout's own rank count: any layout can be asked for
# (model, --layout, --precision, the broken rule's words): every refusal check_engine_layout makes but the heads
# (tp and tp2d over the heads: Layout.validate has checked those since before the engine did).
PLAN_CASES = {
    "ep over a dense model": (DENSE, "tp=1,pp=1,dp=2,ep=2", "fp32", "ep(2) > 1 needs an MoE model"),
    "experts not divisible by ep": (MOE, "tp=1,pp=1,dp=3,ep=3", "fp32", "moe_num_experts(4) is not divisible by ep(3)"),
    "sequence parallelism with experts": (MOE, "tp=2,pp=1,dp=2,ep=2,sp=1", "fp32", "sequence_parallel with tp(2)"),
    "tp2d with experts": (MOE, "tp=1,tp2d=2,pp=1,dp=1,mbs=2", "fp32", "tp2d(2) > 1 with experts"),
    "tp2d in fp16": (DENSE, "tp=1,tp2d=2,pp=1,dp=1,mbs=2,zero=1", "fp16", "tp2d(2) trains in fp32 or bf16"),
    "tp2d at ZeRO 2": (DENSE, "tp=1,tp2d=2,pp=1,dp=1,mbs=2,zero=2", "fp32", "got dtype fp32 and zero 2"),
}
MB = 2**20
# (model, layout, dtype, device budget MB, host budget MB, the broken rule's words)
STORE_CASES = {
    "store in fp16": (MOE, "tp=1,pp=1,dp=2,ep=2,zero=1", "fp16", 1, 0, "train.dtype is fp16"),
    "store over cp": (MOE, "tp=1,pp=1,dp=2,ep=2,cp=2,zero=1", "fp32", 1, 0, "layout cp is 2"),
    "store over tp": (MOE, "tp=2,pp=1,dp=2,ep=2,zero=1", "fp32", 1, 0, "layout tp is 2"),
    "store at ZeRO 2": (MOE, "tp=1,pp=1,dp=2,ep=2,zero=2", "fp32", 1, 0, "layout.zero_stage is 2"),
    "store without experts": (DENSE, "tp=1,pp=1,dp=2,zero=1", "fp32", 1, 0, "the model has no experts"),
    "host budget without a device one": (MOE, "tp=1,pp=1,dp=2,ep=2", "fp32", 0, 1, "needs train.expert_device_budget"),
}


def problems(message: str) -> str:
    """The broken rules of a refusal, without the layout it names first (the planner writes the layout in --layout's
    syntax, the ranks as their topology's factors)."""
    return re.sub(r"^(error: )?(parallel )?layout [^:]*: ", "", message.strip())


def rank_refusal(model: str, layout: Layout, dtype: str, device_mb: int = 0, host_mb: int = 0) -> str:
    """What the rank-side check says of this layout (no process group needed: it runs before any collective)."""
    config = config_for_shape(load_model_shape(model), 512 * layout.tp_ranks)
    topology = ParallelTopology.from_layout(layout, world_size=layout.world_size)
    with pytest.raises(BadInput) as refused:
        check_engine_layout(
            config,
            topology,
            dtype=dtype,
            zero_stage=layout.zero_stage,
            sequence_parallel=layout.sequence_parallel,
            expert_device_budget_bytes=device_mb * MB,
            expert_host_budget_bytes=host_mb * MB,
        )
    return str(refused.value)


@pytest.mark.parametrize("case", list(PLAN_CASES))
def test_plan_refuses_what_the_ranks_refuse_in_the_same_words(case: str, capsys: pytest.CaptureFixture[str]) -> None:
    model, layout, precision, words = PLAN_CASES[case]
    argv = ["plan", "--hardware", HARDWARE, "--model", model, "--layout", layout, "--precision", precision]
    assert cli.main(argv) == cli.EXIT_BAD_INPUT
    planned = capsys.readouterr().err
    ranked = rank_refusal(model, parse_layout(layout), precision)
    assert words in ranked, ranked
    assert problems(planned) == problems(ranked), (planned, ranked)


@pytest.mark.parametrize("case", list(STORE_CASES))
def test_layout_validate_refuses_what_the_store_refuses_in_the_same_words(case: str) -> None:
    model, text, dtype, device_mb, host_mb, words = STORE_CASES[case]
    layout, shape = parse_layout(text), load_model_shape(model)
    with pytest.raises(BadInput) as validated:
        layout.validate(
            layout.world_size,
            shape.heads,
            shape.layers,
            shape.seq_len,
            moe_num_experts=shape.moe_num_experts,
            dtype=dtype,
            expert_device_budget_mb=device_mb,
            expert_host_budget_mb=host_mb,
        )
    ranked = rank_refusal(model, layout, dtype, device_mb, host_mb)
    assert words in ranked, ranked
    assert problems(str(validated.value)) == problems(ranked), (str(validated.value), ranked)


def test_the_layouts_pass_without_the_broken_setting() -> None:
    """The cases fail for the rule they name: the same layouts with the setting put right pass both sides."""
    for model, text, dtype in [
        (MOE, "tp=2,pp=1,dp=2,ep=2", "fp32"),  # experts over tp without sequence parallelism
        (DENSE, "tp=1,tp2d=2,pp=1,dp=1,mbs=2,zero=1", "bf16"),  # the 2D mesh in bf16 at ZeRO 1
    ]:
        layout, shape = parse_layout(text), load_model_shape(model)
        layout.validate(
            layout.world_size, shape.heads, shape.layers, moe_num_experts=shape.moe_num_experts, dtype=dtype
        )
        config = config_for_shape(shape, 512 * layout.tp_ranks)
        topology = ParallelTopology.from_layout(layout, world_size=layout.world_size)
        check_engine_layout(config, topology, dtype=dtype, zero_stage=layout.zero_stage, sequence_parallel=False)
