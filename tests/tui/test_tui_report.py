"""The dashboard as a report: evaluation tables (per language, per task with standard errors), the GPU panel
leaving its row on CPU runs, and the energy panel saying how each figure was obtained. On the recorded runs of
fixtures/ (a 2-core CPU run, a finished 8-GPU run) and the synthetic run with three failures."""

from __future__ import annotations

from pathlib import Path

from test_tui_panels import drive, text
from textual.pilot import Pilot
from tui_support import TROUBLES, on_screen, synthetic_events, write_run

from appliance.monitor.events import make_event
from appliance.rundir import RunDir
from appliance.tui.app import DashboardApp
from appliance.tui.widgets.gpus import GpuTable


def test_cpu_run_gives_the_gpu_row_to_energy_and_failures(cpu_run: RunDir, gpu_run: RunDir) -> None:
    widths: dict[str, int] = {}

    async def cpu(app: DashboardApp, pilot: Pilot[int]) -> None:
        assert app.state.has_gpus is False
        assert not app.query_one(GpuTable).display
        widths["cpu"] = app.query_one("#energy").size.width
        energy = text(app, "#energy")
        # The recorded run has no meter: the CPU figure is cores x W/core x utilization, and says so.
        assert "so far 0.0886  0.0665 estimated" in energy and "CPU 0.0886 Wh estimated: TDP x util" in energy
        assert "CPU estimate: 2 cores x 7.5 W/core" in energy and "GPU" not in energy

    async def gpu(app: DashboardApp, pilot: Pilot[int]) -> None:
        assert app.state.has_gpus is True
        table = app.query_one(GpuTable)
        assert table.display and table.row_count == 8 and table.get_row_at(0)[2] == "A100-SXM4-80GB"
        widths["gpu"] = app.query_one("#energy").size.width
        energy = text(app, "#energy")
        assert "GPU 17.8 kWh measured: NVML counter" in energy and "CPU 2.00 kWh measured: RAPL" in energy

    drive(cpu_run.root, cpu)
    drive(gpu_run.root, gpu)
    assert widths["cpu"] > 1.5 * widths["gpu"], widths  # the GPU table's width went to the other panels


def test_finished_gpu_run_reads_its_evaluation_as_tables(gpu_run: RunDir) -> None:
    async def check(app: DashboardApp, pilot: Pilot[int]) -> None:
        languages_panel = app.query_one("#eval-languages")
        assert languages_panel.border_title == "validation by language · step 2000 · from 11.09"
        languages = text(app, "#eval-languages")
        # eval.json's 13 validation sets, each with its loss and perplexity, and the overall figure first
        for row in ("all  3.010 20.3", "code 1.620 5.05", "eu   3.480 32.5", "zh   3.370 29.1"):
            assert row in languages, row
        assert "per_source" not in languages and "more" not in languages
        tasks = text(app, "#eval-tasks")
        assert app.query_one("#eval-tasks").border_title == "tasks · value ± standard error"
        # stderr = sqrt(p (1 - p) / (n - 1)): hellaswag 0.298 of 10,042 -> 0.0046; piqa 0.641 of 1,838 -> 0.0112
        assert "hellaswag           0  10,042  0.298 ±0.005  0.331 ±0.005" in tasks
        assert "piqa                0   1,838  0.641 ±0.011" in tasks
        assert "48.2" in tasks and "sample: The command line tool" in tasks
        # At 160 x 50 every language fits on screen: two column groups of seven rows
        shown = on_screen(app.query_one("#eval-languages"))
        assert "more" not in shown and "code 1.620 5.05   pt   2.860 17.5" in shown, shown

    drive(gpu_run.root, check)


def test_languages_that_do_not_fit_are_counted(tmp_path: Path) -> None:
    many = {f"l{i:02d}": 2.0 + i / 100 for i in range(40)}
    events = [*synthetic_events(last_step=100, finished=False)]
    events.append(make_event("eval", t=events[-1]["t"] + 1, step=100, valid_loss=2.2, per_source=many))
    run_dir = write_run(tmp_path / "many", events)

    async def check(app: DashboardApp, pilot: Pilot[int]) -> None:
        # 41 rows (all + 40 languages), 7 a column group under the header; two groups fit the panel's width,
        # so 13 are shown and the 14th cell counts the other 28 (eval.json has them all)
        shown = on_screen(app.query_one("#eval-languages"))
        assert "+28 more" in shown and "all      2.200 9.03" in shown and "l11" in shown and "l12" not in shown, shown

    drive(run_dir.root, check)


def test_bits_per_byte_gets_its_column_when_the_evaluation_has_it(tmp_path: Path) -> None:
    events = [*synthetic_events(last_step=100, finished=False)]
    bpb = {"valid_bits_per_byte": 1.25, "per_source_bits_per_byte": {"en": 1.125, "zh": 1.5}}
    per_source = {"en": 2.0, "zh": 2.5}
    events.append(make_event("eval", t=events[-1]["t"] + 1, step=100, valid_loss=2.2, per_source=per_source, **bpb))
    run_dir = write_run(tmp_path / "bpb", events)

    async def check(app: DashboardApp, pilot: Pilot[int]) -> None:
        shown = on_screen(app.query_one("#eval-languages"))
        assert "bpb" in shown, shown
        # exp(2.2) = 9.03, exp(2.0) = 7.39, exp(2.5) = 12.2
        for row in ("all  2.200 9.03 1.250", "en   2.000 7.39 1.125", "zh   2.500 12.2 1.500"):
            assert row in shown, (row, shown)

    drive(run_dir.root, check)


def test_three_failures_and_recoveries_are_all_listed(troubled_run: RunDir) -> None:
    async def check(app: DashboardApp, pilot: Pilot[int]) -> None:
        timeline = text(app, "#timeline")
        for restart, (_, resumed, _, rank, reason) in enumerate(TROUBLES, start=1):
            assert f"rank {rank}: {reason}" in timeline
            assert f"restart {restart} from step {resumed}, lost" in timeline
        # lost = down + redone steps x 105 s: (600 + 55 x 105) + (1500 + 40 x 105) + (900 + 12 x 105) = 14,235 s
        assert app.query_one("#timeline").border_title == "failures 3 · restarts 3 · lost 3h57m"
        assert "running" in text(app, "#header") and "step 900/1000" in text(app, "#header")

    drive(troubled_run.root, check)
