"""`preflight`: the plan `plan` prints, each of its roles built and stepped in this process (appliance/preflight/)."""

from __future__ import annotations

import argparse
import json

PREFLIGHT_NAME = "preflight.json"


def cmd_preflight(args: argparse.Namespace) -> int:
    from appliance.atomic import make_dir, write_atomic
    from appliance.hardware.scaled import hardware_for
    from appliance.planner import load_model_shape, make_plan
    from appliance.planner.layout import parse_layout_fields
    from appliance.preflight.report import format_reports, refuse_what_does_not_fit
    from appliance.preflight.world import stdout_to_stderr

    with stdout_to_stderr():  # DeepSpeed announces its accelerator on stdout when it is imported
        from appliance.preflight.run import preflight

    hw = hardware_for(args.hardware)
    shape = load_model_shape(args.model) if args.model else None
    fixed = parse_layout_fields(args.layout) if args.layout else None
    # Built whatever the plan's verdict: preflight measures what the planner predicts, infeasible plans included.
    plan = make_plan(hw, shape, fixed=fixed)
    reports = preflight(plan)
    record = {
        "model": plan.model.name,
        "hardware": hw.name,
        "layout": plan.layout.describe(),
        "plan_feasible": plan.feasible,
        "roles": [report.to_json() for report in reports],
    }
    if args.run_dir is not None:
        if not args.run_dir.exists():
            make_dir(args.run_dir)
        write_atomic(args.run_dir / PREFLIGHT_NAME, json.dumps(record, indent=1).encode())
    print(json.dumps(record, indent=1) if args.json else f"Preflight: {plan.model.name} at {plan.layout.describe()}"
          f" on {hw.name or 'this machine'}\n{format_reports(reports)}")  # fmt: skip
    refuse_what_does_not_fit(reports)
    return 0
