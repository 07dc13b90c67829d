"""Snapshots of the dashboard at a fixed terminal size (160 x 50): a finished 384-GPU run, its help screen, a run
that has not started, the finished run trained in fp16 (the loss scale beside the grad norm), the recorded runs of
fixtures/ (a CPU run: no GPU panel, estimated energy; a finished 8-GPU run: its evaluation as tables), and a live
run after three failures and recoveries. Regenerate after an intended change with
`pytest tests/tui --snapshot-update` and review the SVGs under __snapshots__/."""

from __future__ import annotations

from pathlib import Path

from textual.pilot import Pilot

from appliance.rundir import RunDir
from appliance.tui.app import DashboardApp, make_app

SIZE = (160, 50)


async def loaded(pilot: Pilot[int]) -> None:
    app = pilot.app
    assert isinstance(app, DashboardApp)
    while app.reads_done < 1:
        await pilot.pause(0.02)
    await pilot.pause()


def test_finished_run(snap_compare, finished_run: RunDir) -> None:  # type: ignore[no-untyped-def]
    assert snap_compare(make_app(finished_run.root, follow=False), terminal_size=SIZE, run_before=loaded)


def test_finished_fp16_run(snap_compare, fp16_run: RunDir) -> None:  # type: ignore[no-untyped-def]
    assert snap_compare(make_app(fp16_run.root, follow=False), terminal_size=SIZE, run_before=loaded)


def test_help_screen(snap_compare, finished_run: RunDir) -> None:  # type: ignore[no-untyped-def]
    app = make_app(finished_run.root, follow=False)
    assert snap_compare(app, press=["question_mark"], terminal_size=SIZE, run_before=loaded)


def test_run_not_started(snap_compare) -> None:  # type: ignore[no-untyped-def]
    # A fixed path that does not exist, so the waiting message reads the same on every machine.
    app = make_app(Path("/nonexistent/runs/bloom-1b7"), follow=False)
    assert snap_compare(app, terminal_size=SIZE, run_before=loaded)


def test_cpu_run(snap_compare, cpu_run: RunDir) -> None:  # type: ignore[no-untyped-def]
    assert snap_compare(make_app(cpu_run.root, follow=False), terminal_size=SIZE, run_before=loaded)


def test_finished_gpu_run(snap_compare, gpu_run: RunDir) -> None:  # type: ignore[no-untyped-def]
    assert snap_compare(make_app(gpu_run.root, follow=False), terminal_size=SIZE, run_before=loaded)


def test_run_with_failures_and_recoveries(snap_compare, troubled_run: RunDir) -> None:  # type: ignore[no-untyped-def]
    assert snap_compare(make_app(troubled_run.root, follow=False), terminal_size=SIZE, run_before=loaded)
