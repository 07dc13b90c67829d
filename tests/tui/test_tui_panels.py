"""Pilot tests: the dashboard on the synthetic 384-GPU run, panel by panel, and its keys."""

from __future__ import annotations

import asyncio
import json
import re
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

from textual.pilot import Pilot
from tui_support import synthetic_events, widget_text, write_run

from appliance.monitor.state_fields import Series
from appliance.rundir import RunDir
from appliance.tui.app import DashboardApp, make_app
from appliance.tui.screens.confirm import ConfirmScreen
from appliance.tui.screens.help import HelpScreen
from appliance.tui.widgets.gpus import GpuTable
from appliance.tui.widgets.plot import LinePlot

Check = Callable[[DashboardApp, Pilot[int]], Awaitable[None]]


async def until(pilot: Pilot[int], condition: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out waiting for the dashboard"
        await pilot.pause(0.02)


def drive(run_dir: Path, check: Check, *, follow: bool = False) -> None:
    async def main() -> None:
        app = make_app(run_dir, follow=follow, poll_interval=0.05)
        async with app.run_test(size=(160, 50)) as pilot:
            await until(pilot, lambda: app.reads_done >= 1)
            await pilot.pause()
            await check(app, pilot)

    asyncio.run(main())


def text(app: DashboardApp, selector: str) -> str:
    return widget_text(app.query_one(selector))


def test_finished_run_shows_every_panel(finished_run: RunDir) -> None:
    async def check(app: DashboardApp, pilot: Pilot[int]) -> None:
        header = text(app, "#header")
        assert "done" in header and "step 1000/1000" in header and "tp4 pp12 dp8" in header and "384 GPUs" in header

        throughput = text(app, "#throughput")
        for expected in ("39.9k", "plan 40k", "19.5", "149.5", "47.9%", "plan 48.0%", "1m45s", "2.05M"):
            assert expected in throughput, expected

        loss = app.query_one("#loss", LinePlot)
        plot = widget_text(loss)
        assert loss.border_title and loss.border_title.startswith("loss 2.15")
        assert sum("\u2800" < ch <= "\u28ff" for ch in plot) > 50 and "step 10" in plot and "1000" in plot
        assert "learning rate" in str(app.query_one("#lr", LinePlot).border_title)

        gpus = app.query_one(GpuTable)
        assert gpus.row_count == 48  # 384 GPUs, one row per node
        assert "384 on 48 nodes" in str(gpus.border_title) and "153.6 kW" in str(gpus.border_title)
        rows = {gpus.get_row_at(i)[0]: gpus.get_row_at(i) for i in range(gpus.row_count)}
        assert rows["node17"] == ["node17", "8", "97", "95", "568/640", "84", "3.20"]

        stages = text(app, "#stages")
        for name in ("prep", "tokenizer", "indexing", "training", "eval"):
            assert name in stages
        assert "done in 1d06h" in stages and "100.0%" in stages

        checkpoints = text(app, "#checkpoints")
        assert "step 1000" in checkpoints and "2.3 TB" in checkpoints and "200 steps" in checkpoints
        assert "next due" not in checkpoints  # the run is over

        timeline = text(app, "#timeline")
        assert "rank 137: NCCL timeout" in timeline and "restart 1 from step 400, lost 1h46m" in timeline
        assert app.query_one("#timeline").border_title == "failures 1 · restarts 1 · lost 1h46m"
        assert "warning: loss spike at step 450" in timeline

        energy = text(app, "#energy")
        for expected in ("5,197.5", "355.5", "16,000.0", "1,094.4", "57 g/kWh", "PUE 1.20"):
            assert expected in energy, expected
        # The events' sources, in words: NVML's counter and RAPL are measurements, the plan an estimate.
        assert "so far  5,197.5    355.5 measured" in energy and "1,094.4 estimated" in energy
        assert "measured: NVML counter" in energy and "measured: RAPL" in energy

        languages = text(app, "#eval-languages")
        assert "all  2.513 12.3" in languages and "code 1.380 3.97" in languages and "per_source" not in languages
        tasks = text(app, "#eval-tasks")
        assert "0.612 ±0.007" in tasks and "0.551 ±0.005" in tasks and "4.21" in tasks and "10,042" in tasks
        assert "The capital of France is Paris, a city on the Seine." in tasks

    drive(finished_run.root, check)


def test_fp16_run_shows_the_loss_scale_beside_the_grad_norm(fp16_run: RunDir, finished_run: RunDir) -> None:
    async def fp16(app: DashboardApp, pilot: Pilot[int]) -> None:
        title = str(app.query_one("#grad-norm", LinePlot).border_title)
        # The two overflow steps' inf norms are left out of the curve: no "non-finite" count.
        assert title == "grad norm 0.9 · loss scale 2^10, 2 skipped", title

    async def bf16(app: DashboardApp, pilot: Pilot[int]) -> None:
        assert str(app.query_one("#grad-norm", LinePlot).border_title) == "grad norm 0.9"

    drive(fp16_run.root, fp16)
    drive(finished_run.root, bf16)


def test_live_run_eta_cadence_and_projection(live_run: RunDir) -> None:
    async def check(app: DashboardApp, pilot: Pilot[int]) -> None:
        assert "running" in text(app, "#header") and "ago)" in text(app, "#header")
        # 400 steps left x 105 s = 11h40m
        assert "60.0% started ETA 11h40m" in text(app, "#stages")
        checkpoints = text(app, "#checkpoints")
        assert "step 600" in checkpoints and "next due   step 800 in ~5h50m" in checkpoints
        energy = text(app, "#energy")
        assert "so far     3,237.5" in energy and "projected  5,197.5" in energy
        assert "waiting for evaluation results" in text(app, "#eval-languages")

    drive(live_run.root, check, follow=True)


def test_a_background_save_shows_its_write_and_what_the_steps_waited(tmp_path: Path) -> None:
    """Pass: a checkpoint event with stall_s shows the write (45 s) and the steps' wait (2 s, 4% of it) apart; the
    old single "took" row is for events without stall_s (test_live_run_eta_cadence_and_projection's run)."""
    events = synthetic_events(last_step=600, finished=False)
    for event in events:
        if event["kind"] == "checkpoint":
            event["stall_s"] = 2.0
    run_dir = write_run(tmp_path / "async", events)

    async def check(app: DashboardApp, pilot: Pilot[int]) -> None:
        checkpoints = text(app, "#checkpoints")
        assert re.search(r"write +45s 2\.3 TB", checkpoints), checkpoints
        assert re.search(r"steps waited +2s 4% of the write", checkpoints), checkpoints
        assert "took" not in checkpoints

    drive(run_dir.root, check, follow=True)


def test_keys_write_the_control_files(live_run: RunDir) -> None:
    async def check(app: DashboardApp, pilot: Pilot[int]) -> None:
        await pilot.press("s")
        assert live_run.request_checkpoint.exists()
        await until(pilot, lambda: "checkpoint requested" in text(app, "#checkpoints"))

        await pilot.press("x")
        assert isinstance(app.screen, ConfirmScreen)
        await pilot.press("n")
        assert not live_run.request_stop.exists() and not isinstance(app.screen, ConfirmScreen)
        await pilot.press("x", "y")
        assert live_run.request_stop.exists()
        await until(pilot, lambda: "save-and-exit requested" in text(app, "#checkpoints"))

        await pilot.press("question_mark")
        assert isinstance(app.screen, HelpScreen)
        await pilot.press("escape")
        assert not isinstance(app.screen, HelpScreen)

        await pilot.press("q")
        await until(pilot, lambda: not app.is_running)
        assert app.return_code == 0

    drive(live_run.root, check, follow=True)


def test_a_finished_run_takes_no_requests(finished_run: RunDir) -> None:
    async def check(app: DashboardApp, pilot: Pilot[int]) -> None:
        await pilot.press("s")
        assert not finished_run.request_checkpoint.exists()

    drive(finished_run.root, check)


def test_waits_for_a_run_that_has_not_started_then_follows_it(tmp_path: Path) -> None:
    run = RunDir(tmp_path / "new-run")

    async def check(app: DashboardApp, pilot: Pilot[int]) -> None:
        waiting = text(app, "#waiting")
        assert "Waiting for the run to start" in waiting and "does not exist yet" in waiting
        assert not app.query_one("#body").display and "waiting for the run" in text(app, "#header")
        run.make()
        with open(run.metrics, "w") as f:
            for event in synthetic_events(last_step=100, finished=False)[:30]:
                f.write(json.dumps(event) + "\n")
            f.write('{"t": 1700000000.0, "kind": "warn')  # half-written: ignored until its newline
        await until(pilot, lambda: bool(app.query_one("#body").display))
        assert not app.state.warnings and "step" in text(app, "#throughput")  # the half line is not an event yet
        with open(run.metrics, "a") as f:
            f.write('ing", "message": "late line"}\n')
        await until(pilot, lambda: "late line" in text(app, "#timeline"))

    drive(run.root, check, follow=True)


def test_plot_of_a_long_run_stays_fast(finished_run: RunDir) -> None:
    async def check(app: DashboardApp, pilot: Pilot[int]) -> None:
        series = Series()
        for i in range(200_000):
            series.add(i, 10.0 / (1 + i / 1000))
        plot = app.query_one("#loss", LinePlot)
        start = time.perf_counter()
        plot.show(series)
        rendered = widget_text(plot)
        assert time.perf_counter() - start < 0.25
        assert "step 0" in rendered and "199999" in rendered

    drive(finished_run.root, check)


def test_a_run_over_its_budget_says_so_in_the_throughput_panel(tmp_path: Path) -> None:
    from tui_support import write_run

    from appliance.monitor.events import make_event

    over = {
        "state": "over",
        "step": 600,
        "total_steps": 1000,
        "fits_steps": 812,
        "limit_s": 100_000.0,
        "has_budget": True,
        "projected_s": 123_000.0,
        "planned_s": 99_000.0,
        "measured_step_s": 123.0,
        "planned_step_s": 99.0,
    }
    events = synthetic_events(last_step=600, finished=False)
    events.append(make_event("warning", t=events[-1]["t"] + 1, message="over budget", budget=over))
    run_dir = write_run(tmp_path / "over", events)

    async def check(app: DashboardApp, pilot: Pilot[int]) -> None:
        throughput = text(app, "#throughput")
        assert "OVER budget" in throughput and "+23%" in throughput and "812" in throughput

    drive(run_dir.root, check)


def test_the_throughput_panel_names_the_kernels_the_run_measured(tmp_path: Path) -> None:
    from tui_support import write_run

    from appliance.monitor.events import make_event

    events = synthetic_events(last_step=600, finished=False)
    events.insert(1, make_event(
        "kernels", t=events[0]["t"], source="measured",
        choices={"flash_alibi_attention": "sdpa", "vocab_cross_entropy": "compiled"},
        times_ms={"flash_alibi_attention": {"sdpa": 3.25, "triton": 4.5}, "vocab_cross_entropy": {"compiled": 21.5}},
    ))  # fmt: skip
    run_dir = write_run(tmp_path / "kernels", events)

    async def check(app: DashboardApp, pilot: Pilot[int]) -> None:
        throughput = text(app, "#throughput")
        assert "kernels" in throughput and "measured" in throughput
        assert "attention sdpa 3.25 ms" in throughput and "loss compiled 21.5 ms" in throughput

    drive(run_dir.root, check)
