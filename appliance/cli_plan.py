"""`detect`, `plan` and `bench`: the hardware, the layout the cost model picks for it, the speed reached."""

from __future__ import annotations

import argparse
import json

from appliance.errors import BadInput


def cmd_detect(args: argparse.Namespace) -> int:
    from appliance.hardware import detect, format_hardware

    hw = detect()
    print(json.dumps(hw.to_dict(), indent=1) if args.json else format_hardware(hw))
    return 0


def cmd_plan(args: argparse.Namespace) -> int:
    from appliance.hardware.scaled import hardware_for
    from appliance.planner import Budget, format_plan, load_model_shape, make_plan, parse_duration
    from appliance.planner.layout import parse_layout_fields

    if args.corpus_tokens is not None and args.corpus_tokens < 1:
        raise BadInput(f"--corpus-tokens {args.corpus_tokens}: must be a positive token count")
    if args.spares < 0:
        raise BadInput(f"--spares {args.spares}: must be 0 or more")
    hw = hardware_for(args.hardware, args.nodes)
    shape = load_model_shape(args.model) if args.model else None
    fixed = parse_layout_fields(args.layout) if args.layout else None
    budget = Budget(seconds=parse_duration(args.budget) if args.budget else None, corpus_tokens=args.corpus_tokens)
    plan = make_plan(
        hw,
        shape,
        global_batch_size=args.global_batch_size,
        seq_len=args.seq_len,
        fixed=fixed,
        budget=budget,
        precision=args.precision,
    )
    if not plan.feasible and not args.allow_infeasible:
        what = f"--layout {args.layout}" if args.layout else f"{plan.model.name} on {hw.name or 'this machine'}"
        raise BadInput(f"{what}: NOT FEASIBLE: {'; '.join(plan.reasons)} (--allow-infeasible prints the plan anyway)")
    checked = None
    if args.preflight:  # every role built and stepped here; its figures in place of the model's, side by side
        from appliance.preflight import run_preflight

        checked = run_preflight(plan.spec())
    if args.json:
        from appliance.planner.failures import plan_failure_cost

        failures = plan_failure_cost(plan, args.spares)
        record = {**plan.to_json(), "failures": failures and failures.to_json()}
        print(json.dumps(record | ({"preflight": checked.to_json()} if checked else {}), indent=1))
    else:
        print(format_plan(plan, spares=args.spares, verbose=args.verbose))
    if checked is not None:
        from appliance.preflight.report import format_preflight, refuse_what_does_not_fit

        if not args.json:
            print(f"\nPreflight (built on {checked.device}):\n{format_preflight(checked)}")
        refuse_what_does_not_fit((checked, ""))
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    from appliance.benchmark.command import CONTENDER_KEYS, run_bench
    from appliance.benchmark.workload import BenchSize

    size = BenchSize(micro_batch=args.micro_batch, steps=args.steps, micro_batches=args.micro_batches)
    chosen = CONTENDER_KEYS
    if args.contenders is not None:
        chosen = tuple(name.strip() for name in args.contenders.split(",") if name.strip())
        unknown = [name for name in chosen if name not in CONTENDER_KEYS]
        if unknown or not chosen:
            raise BadInput(f"--contenders {args.contenders!r}: name one or more of {', '.join(CONTENDER_KEYS)}")
    run_bench(args.model, args.out, quick=args.quick, size=size, profile=args.profile, contenders=chosen,
              kernel_table=not args.no_kernel_table)  # fmt: skip
    return 0
