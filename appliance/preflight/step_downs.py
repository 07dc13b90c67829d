"""The layouts a GPU run steps down to after losing nodes (planner/shrink.py step_downs), as run specs preflight can
build: the planner fits each world's layout with its memory model; preflight builds that layout's roles and says
whether the ranks really fit, before a loss makes the run step into it."""

from __future__ import annotations

from dataclasses import dataclass, replace

from appliance.planner.layout import parse_layout_fields
from appliance.planner.runspec import RunSpec
from appliance.planner.shrink import StepDown, step_downs


@dataclass(frozen=True)
class StepDownSpec:
    step_down: StepDown
    spec: RunSpec  # the plan as make_plan evaluates the step-down's layout on its nodes


def step_down_specs(spec: RunSpec, count: int) -> list[StepDownSpec]:
    """The first ``count`` step-downs of ``spec`` (the most nodes first: those a run meets first), each as the plan of
    its layout on its node count. Empty for CPU plans, which only refit dp."""
    from appliance.planner import make_plan

    nodes = spec.hardware.nodes
    found = []
    for down in step_downs(spec, nodes)[:count]:
        hardware = replace(spec.hardware, nodes=down.nodes)
        plan = make_plan(
            hardware,
            spec.model,
            seq_len=spec.train.seq_len,
            precision=spec.train.dtype,
            fixed=parse_layout_fields(down.layout.describe()),
        )
        found.append(StepDownSpec(down, plan.spec()))
    return found
