"""`preflight`: the plan `plan` prints (or a run directory's plan.json), each of its roles built and stepped in this
process (appliance/preflight/)."""

from __future__ import annotations

import argparse
import json
from typing import TYPE_CHECKING

from appliance.errors import BadInput

if TYPE_CHECKING:
    from appliance.planner.runspec import RunSpec


def cmd_preflight(args: argparse.Namespace) -> int:
    from appliance.atomic import write_atomic
    from appliance.preflight import run_preflight
    from appliance.preflight.report import format_preflight, refuse_what_does_not_fit
    from appliance.preflight.step_downs import step_down_specs

    if args.step_downs < 0:
        raise BadInput(f"--step-downs {args.step_downs}: must be 0 or more")
    spec = _spec(args)
    run_dir = None
    if args.run_dir is not None:  # before the build: a folder that is not a run's is refused, its files left alone
        from appliance.output_dirs import make_run_dir

        run_dir, _ = make_run_dir(args.run_dir)
    result = run_preflight(spec)
    downs = [(down, run_preflight(down.spec)) for down in step_down_specs(spec, args.step_downs)]
    record = {
        "model": spec.model.name,
        "hardware": spec.hardware.name,
        "layout": spec.layout.describe(),
        "plan_feasible": spec.report.feasible,
        **result.to_json(),
        "step_downs": [
            {"nodes": down.step_down.nodes, "layout": down.spec.layout.describe(), **checked.to_json()}
            for down, checked in downs
        ],
    }
    if run_dir is not None:
        write_atomic(run_dir.preflight, json.dumps(record, indent=1).encode())
    where = f"on {spec.hardware.name or 'this machine'}, built on {result.device}"
    lines = [f"Preflight: {spec.model.name} at {spec.layout.describe()} {where}", format_preflight(result)]
    for down, checked in downs:
        lines += [f"\nStep-down after a loss: {down.spec.layout.describe()} on {down.step_down.nodes} nodes",
                  format_preflight(checked)]  # fmt: skip
    print(json.dumps(record, indent=1) if args.json else "\n".join(lines))
    refuse_what_does_not_fit(
        (result, ""), *((checked, f"the step-down to {down.step_down.nodes} nodes: ") for down, checked in downs)
    )
    return 0


def _spec(args: argparse.Namespace) -> RunSpec:
    """The run directory's plan.json when --run-dir holds one and no --hardware, --model or --layout is given (the
    plan that run trains: sbatch's job preflights it); else the plan `plan` makes of them. Built whatever the plan's
    verdict: preflight measures what the planner predicts, infeasible plans included."""
    from appliance.hardware.scaled import hardware_for
    from appliance.planner import load_model_shape, make_plan
    from appliance.planner.layout import parse_layout_fields
    from appliance.planner.runspec import load_spec
    from appliance.rundir import RunDir

    planned = RunDir(args.run_dir).plan if args.run_dir is not None else None
    if planned is not None and planned.is_file() and not (args.hardware or args.model or args.layout):
        return load_spec(planned)
    shape = load_model_shape(args.model) if args.model else None
    fixed = parse_layout_fields(args.layout) if args.layout else None
    return make_plan(hardware_for(args.hardware), shape, fixed=fixed).spec()
