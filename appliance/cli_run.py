"""`run` and `tui`: the whole run, headless or under the dashboard, and the dashboard on a run directory."""

from __future__ import annotations

import argparse
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from appliance.cli_parser import nodes_from_args
from appliance.errors import BadInput
from appliance.output_dirs import make_run_dir
from appliance.rundir import RunDir
from appliance.train.runlock import refuse_if_live

if TYPE_CHECKING:
    from appliance.run_request import RunRequest


def cmd_run(args: argparse.Namespace) -> int:
    from appliance.data.sample_corpus import SAMPLE_CORPUS_DIR
    from appliance.head_run import run
    from appliance.overrides import parse_overrides
    from appliance.planner.sizing import parse_duration
    from appliance.run_request import RunRequest, default_run_dir, make_run_plan

    req = RunRequest(
        corpus=args.corpus or [SAMPLE_CORPUS_DIR],
        run_dir=args.run_dir,
        model=args.model,
        hardware=args.hardware,
        hardware_nodes=args.nodes,
        max_steps=args.max_steps,
        overrides=parse_overrides(args.overrides),
        prepare_only=args.prepare_only,
        budget_s=parse_duration(args.budget) if args.budget else None,
        nodes=nodes_from_args(args),
        layout=args.layout,
    )
    headless = args.headless or not sys.stdout.isatty() or (req.nodes is not None and not req.nodes.is_head)
    if not headless:
        # Validate in the foreground (exit 2 here on bad input), then run headless in the background and attach
        # the dashboard: quitting the dashboard leaves the run going, as on a head node.
        from appliance.head_run import check_resumed_settings
        from appliance.run_request import check_inputs, existing_plan

        check_inputs(req.corpus)
        check_resumed_settings(req)
        spec = existing_plan(req) or make_run_plan(req)
        run_dir = req.run_dir or default_run_dir(spec.model.name)
        refuse_if_live(RunDir(run_dir))  # here, not in the background child, whose refusal nobody would see
        make_run_dir(run_dir, inputs={"--corpus": req.corpus})  # marked before head.log is written into it
        return _run_with_dashboard(run_dir)
    return _run_headless(req, args.log_format, run)


def _run_headless(req: RunRequest, log_format: str, run: Callable[..., int]) -> int:
    from appliance.monitor.headless import HeadlessPrinter, follow_run

    printer = HeadlessPrinter(stream=sys.stdout, log_format=log_format)
    done = threading.Event()
    followers: list[threading.Thread] = []

    def start_following(run_dir: RunDir) -> None:
        t = threading.Thread(
            target=follow_run,
            args=(run_dir.root, printer),
            kwargs={"stop": done.is_set},
            daemon=True,
        )
        t.start()
        followers.append(t)

    try:
        return run(req, on_event_writer=start_following)
    finally:
        done.set()
        for t in followers:
            t.join(timeout=5)


def _run_with_dashboard(run_dir: Path) -> int:
    from appliance.tui.app import run_tui

    run_dir.mkdir(parents=True, exist_ok=True)
    argv = [a for a in sys.argv[1:] if a != "run"]
    child_args = ["run", "--headless", "--run-dir", str(run_dir), *_strip_run_dir(argv)]
    log = open(run_dir / "head.log", "ab")  # noqa: SIM115 - handed to the detached child
    child = subprocess.Popen(
        [sys.executable, str(Path(__file__).resolve().parents[1] / "bloom_appliance.py"), *child_args],
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    code = run_tui(run_dir)
    if child.poll() is None:
        print(
            f"The run goes on in the background (pid {child.pid}); log: {run_dir / 'head.log'}.\n"
            f"Attach again with: ./bloom_appliance.py tui --run-dir {run_dir}"
        )
        return code
    return child.returncode


def _strip_run_dir(argv: list[str]) -> list[str]:
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a == "--run-dir":
            skip = True
        elif not a.startswith("--run-dir="):
            out.append(a)
    return out


def cmd_tui(args: argparse.Namespace) -> int:
    from appliance.tui.app import run_tui

    if not args.run_dir.is_dir():
        raise BadInput(f"--run-dir {args.run_dir}: no such directory")
    return run_tui(args.run_dir)
