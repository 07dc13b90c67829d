"""`run` and `tui`: the whole run, headless or under the dashboard, and the dashboard on a run directory."""

from __future__ import annotations

import argparse
import contextlib
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from appliance.cli_parser import nodes_from_args
from appliance.errors import EXIT_OK, EXIT_PREEMPTED, BadInput
from appliance.output_dirs import listing, make_run_dir
from appliance.rundir import RunDir
from appliance.train.runlock import refuse_if_live

if TYPE_CHECKING:
    from appliance.monitor.headless import HeadlessPrinter
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
        preflight=args.preflight,
    )
    headless = args.headless or not sys.stdout.isatty() or (req.nodes is not None and not req.nodes.is_head)
    if not headless:
        # Validate in the foreground (exit 2 here on bad input), then run headless in the background and attach
        # the dashboard: quitting the dashboard leaves the run going, as on a head node.
        from appliance.head_run import check_resumed_settings, folders_to_make
        from appliance.run_request import check_inputs, existing_plan

        check_inputs(req.corpus)
        check_resumed_settings(req)
        spec = existing_plan(req) or make_run_plan(req)
        run_dir = req.run_dir or default_run_dir(spec.model.name)
        refuse_if_live(RunDir(run_dir))  # here, not in the background child, whose refusal nobody would see
        made = folders_to_make(run_dir)
        make_run_dir(run_dir, inputs={"--corpus": req.corpus})  # marked before head.log is written into it
        return _run_with_dashboard(run_dir, made)
    return _run_headless(req, args.log_format, run)


def _run_headless(req: RunRequest, log_format: str, run: Callable[..., int]) -> int:
    from appliance.monitor.closing import closing_lines
    from appliance.monitor.headless import HeadlessPrinter

    printer = HeadlessPrinter(stream=sys.stdout, log_format=log_format, closing=closing_lines)
    return run(req, follow=lambda run_dir: _printing_new_events(run_dir, printer))


@contextlib.contextmanager
def _printing_new_events(run_dir: RunDir, printer: HeadlessPrinter) -> Iterator[None]:
    """Print the events of this launch while the block runs, and the last ones as it ends. A rerun's earlier events
    (every step line of the launches before) are folded into the printer's state, not printed again."""
    from appliance.monitor.headless import follow_run

    done, attached = threading.Event(), threading.Event()

    def stop() -> bool:
        attached.set()  # follow_run asks once it has folded in the earlier events, before it prints a new one
        return done.is_set()

    follower = threading.Thread(
        target=follow_run, args=(run_dir.root, printer), kwargs={"stop": stop, "skip_existing": True}, daemon=True
    )
    follower.start()
    # Until it asks, an event of this launch would be taken for an earlier one: wait as long as the history takes.
    while not attached.wait(timeout=0.1) and follower.is_alive():
        pass
    try:
        yield
    finally:
        done.set()
        follower.join(timeout=5)


def _run_with_dashboard(run_dir: Path, made: list[Path]) -> int:
    """The run headless in a child process, its output in head.log; the dashboard here. `made`: the folders this
    command made for the run directory, removed again when the run fails before a data stage completes. Once the
    user leaves the dashboard: the closing summary, of a run that ended or of one that goes on in the background."""
    from appliance.head_run import discard_if_unprepared
    from appliance.monitor.closing import HEAD_LOG, closing_summary
    from appliance.tui.app import show_dashboard

    run_dir.mkdir(parents=True, exist_ok=True)
    argv = [a for a in sys.argv[1:] if a != "run"]
    child_args = ["run", "--headless", "--run-dir", str(run_dir), *_strip_run_dir(argv)]
    log_path = run_dir / HEAD_LOG
    log = open(log_path, "ab")  # noqa: SIM115 - handed to the detached child
    child = subprocess.Popen(
        [sys.executable, str(Path(__file__).resolve().parents[1] / "bloom_appliance.py"), *child_args],
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    app = show_dashboard(run_dir)
    if child.poll() is None:
        print("\n".join(app.closing()))
        print(f"It runs in the background (pid {child.pid}); its log: {log_path}")
        return app.return_code or 0
    if child.returncode != 0:
        print(*log_path.read_text(errors="replace").strip().splitlines()[-1:], file=sys.stderr)  # the error line
        if discard_if_unprepared(RunDir(run_dir), made):
            return child.returncode
    # The child has ended: its outcome is its exit code (summary.json may be an earlier launch's when it crashed).
    outcome = {EXIT_OK: None, EXIT_PREEMPTED: "preempted"}.get(child.returncode, "failed")
    print("\n".join(closing_summary(RunDir(run_dir), state=outcome)))
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
    if not args.wait:
        _need_a_run(args.run_dir)
    from appliance.tui.app import run_tui

    return run_tui(args.run_dir)


def _run_files(path: Path) -> list[Path]:
    """What a run directory holds from its first second on, whichever command started it: events, plan, stages."""
    run = RunDir(path)
    return [run.metrics, run.plan, run.manifest]


def _need_a_run(path: Path) -> None:
    """BadInput unless `path` holds a run (`tui --wait` waits for one instead), naming the runs inside it when it is
    the folder of runs (`--run-dir runs` for `runs/latest`)."""
    wait = "; `tui --wait` waits for a run to start there"
    if not path.is_dir():
        raise BadInput(f"--run-dir {path}: no such directory{wait}")
    if any(f.is_file() for f in _run_files(path)):
        return
    entries = sorted(path.iterdir(), reverse=True)  # runs/<time>-<model>: the newest first
    entries.sort(key=lambda p: p.name != "latest")  # and runs/latest before them
    runs = [str(p) for p in entries if any(f.is_file() for f in _run_files(p))]
    inside = f"; it holds runs: {listing(runs)}" if runs else ""
    names = [f.name for f in _run_files(path)]
    raise BadInput(f"--run-dir {path}: holds no run (no {', '.join(names[:-1])} or {names[-1]}){inside}{wait}")
