"""The closing summary (appliance/monitor/closing.py): what a run leaves the user with, in the headless log (text and
JSON) and when the user leaves the dashboard, of a finished CPU run, a failed one and one that goes on."""

from __future__ import annotations

import asyncio
import io
import json
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from finished_runs import CHECKPOINT_STEPS, FINAL_BITS_PER_BYTE, finished_cpu_run

from appliance import cli_run, head_run
from appliance.monitor.closing import closing_facts, closing_lines, closing_summary
from appliance.monitor.events import read_events
from appliance.monitor.headless import HeadlessPrinter
from appliance.rundir import RunDir
from appliance.tui.app import DashboardApp, make_app

COMMAND = "./bloom_appliance.py"


@pytest.fixture
def cpu_done(tmp_path: Path) -> RunDir:
    return finished_cpu_run(tmp_path / "run")


def run_headless(run_dir: RunDir, log_format: str, outcome: str | Callable[..., str]) -> int:
    """`run --headless` as cli_run runs it, with the head's own end of the run (head_run._run_owned: summary.json,
    the last `run` event), on a run directory whose stages are done; `outcome`: the stages' result, or a function
    that raises their failure."""
    stages = outcome if callable(outcome) else (lambda *_: outcome)

    def run(req: object, *, follow: Callable) -> int:
        with follow(run_dir):
            return head_run._run_owned(req, None, run_dir, [])  # type: ignore[arg-type]

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(head_run, "_run_stages", stages)
        return cli_run._run_headless(None, log_format, run)  # type: ignore[arg-type]


def test_a_finished_cpu_run_ends_its_headless_log_with_the_closing_summary(cpu_done: RunDir, capsys) -> None:
    assert run_headless(cpu_done, "text", "done") == 0
    out = capsys.readouterr().out
    assert out.count("] run done\n") == 1  # the log line, then the block under it
    block = out.split("] run done\n")[1]
    root = cpu_done.root
    assert block.startswith("Run done in ") and block.splitlines()[0].endswith(f": {root}")
    expected = [
        f"loss 6.189 (before training 6.244), {FINAL_BITS_PER_BYTE:.4g} bits per byte",
        f"{cpu_done.export} (transformers loads it",
        f"{len(CHECKPOINT_STEPS)} kept, newest step {CHECKPOINT_STEPS[-1]}",
        "32 of 40 documents kept",
        "512 entries",
        "60.5k tokens in 2 languages",
        "cloze_sample acc 1.000, lambada_sample exact match 0.000, xlang_choice acc 0.000 (first 1 document each)",
        "tokens/s (plan 10.8k); CPU ranks: no MFU",
        "kWh",
        f"{COMMAND} tui --run-dir {root}",
        f"{COMMAND} eval --run-dir {root} --tasks ",
        f"{COMMAND} export --run-dir {root} --out DIR",
        f"{COMMAND} import --hf-dir {cpu_done.export} --run-dir NEW",
    ]
    for text in expected:
        assert text in block, text
    assert "MFU " not in block  # a CPU run shows none, as the dashboard


def test_in_json_the_last_event_carries_the_same_facts(cpu_done: RunDir, capsys) -> None:
    assert run_headless(cpu_done, "json", "done") == 0
    last = json.loads(capsys.readouterr().out.splitlines()[-1])
    assert (last["kind"], last["state"]) == ("run", "done")
    assert last["closing"] == closing_facts(cpu_done, state="done")
    assert last["closing"]["valid_bits_per_byte"] == FINAL_BITS_PER_BYTE
    assert list(read_events(cpu_done.metrics))[-1] == last  # metrics.jsonl holds it too


def test_a_printer_without_the_closing_prints_the_run_line_alone(cpu_done: RunDir) -> None:
    """Control: the block comes from the closing, not from the run line."""
    stream = io.StringIO()
    facts = closing_facts(cpu_done, state="done")
    HeadlessPrinter(stream=stream).handle({"t": time.time(), "kind": "run", "state": "done", "closing": facts})
    assert stream.getvalue().count("\n") == 1 and stream.getvalue().endswith("] run done\n")
    stream = io.StringIO()
    HeadlessPrinter(stream=stream, closing=closing_lines).handle(
        {"t": time.time(), "kind": "run", "state": "done", "closing": {"corpus": {"documents": "many"}}}
    )  # facts of another version: the log line stays, nothing breaks
    assert stream.getvalue().endswith("] run done\n")


def test_a_failed_run_says_where_its_logs_are_and_how_to_resume(cpu_done: RunDir, capsys) -> None:
    def fail(*_: object) -> str:
        raise RuntimeError("training failed (agent exit code 1)")

    (cpu_done.logs / "attempt_0").mkdir(parents=True)
    records = json.loads(cpu_done.manifest.read_text())
    cpu_done.manifest.write_text(json.dumps({k: v for k, v in records.items() if k != "export"}))
    with pytest.raises(RuntimeError):
        run_headless(cpu_done, "text", fail)
    block = capsys.readouterr().out.split("] run failed\n")[1]
    assert block.splitlines()[0].startswith("Run failed in stage export")
    assert "logs" in block and str(cpu_done.logs) in block and str(cpu_done.metrics) in block
    assert f"{COMMAND} run --run-dir {cpu_done.root} --corpus en.jsonl fr.jsonl" in block
    assert f"training resumes from step {CHECKPOINT_STEPS[-1]}" in block


def test_a_failure_that_removes_the_run_directory_closes_with_no_summary(cpu_done: RunDir, capsys) -> None:
    """Control: a run directory this command made, with no data stage done, goes with the failure
    (head_run.discard_if_unprepared): no summary points into it."""
    cpu_done.manifest.write_text(json.dumps({}))

    def fail(*_: object) -> str:
        raise RuntimeError("prep failed")

    def run(req: object, *, follow: Callable) -> int:
        with follow(cpu_done):
            return head_run._run_owned(req, None, cpu_done, [cpu_done.root])  # type: ignore[arg-type]

    with pytest.MonkeyPatch.context() as patch, pytest.raises(RuntimeError):
        patch.setattr(head_run, "_run_stages", fail)
        cli_run._run_headless(None, "text", run)  # type: ignore[arg-type]
    assert capsys.readouterr().out.endswith("] run failed\n")
    assert "closing" not in list(read_events(cpu_done.metrics))[-1]


def leave_dashboard(run_dir: Path) -> DashboardApp:
    """The dashboard on `run_dir`, left with `q` once it has read the run."""

    async def main() -> DashboardApp:
        app = make_app(run_dir, follow=False, poll_interval=0.05)
        async with app.run_test(size=(160, 50)) as pilot:
            deadline = time.monotonic() + 10
            while app.reads_done < 1:
                assert time.monotonic() < deadline, "the dashboard read nothing"
                await pilot.pause(0.02)
            await pilot.press("q")
            await pilot.pause()
        return app

    return asyncio.run(main())


def test_leaving_the_dashboard_of_a_finished_cpu_run_prints_its_summary(cpu_done: RunDir) -> None:
    app = leave_dashboard(cpu_done.root)
    assert app.return_code == 0
    lines = app.closing()
    assert lines == closing_summary(cpu_done, state="done")  # the headless log's words
    text = "\n".join(lines)
    assert f"{FINAL_BITS_PER_BYTE:.4g} bits per byte" in text and str(cpu_done.export) in text
    assert f"{COMMAND} tui --run-dir {cpu_done.root}" in text and "save-and-exit" not in text


def test_leaving_the_dashboard_of_a_run_that_goes_on_says_what_runs_and_how_to_come_back(live_run: RunDir) -> None:
    app = leave_dashboard(live_run.root)
    text = "\n".join(app.closing())
    assert text.startswith(f"The run goes on in {live_run.root}")
    assert "step 600/1000, loss " in text and " left" in text  # the synthetic run trains at 105 s a step
    assert "prep, " not in text  # its stages are named prep/tokenizer/indexing/training: none of `run`'s done
    assert f"{COMMAND} tui --run-dir {live_run.root}" in text
    assert f"touch {live_run.request_stop}" in text


def test_leaving_the_dashboard_before_a_run_starts_says_how_to_wait_for_one(tmp_path: Path) -> None:
    app = leave_dashboard(tmp_path)
    assert app.closing() == [
        f"No run has started in {tmp_path} yet; wait for one with: {COMMAND} tui --run-dir {tmp_path} --wait"
    ]


def test_a_gpu_run_closes_with_its_mfu_against_the_plans(gpu_run: RunDir) -> None:
    """Control for the CPU run's "no MFU": the recorded 8-GPU run measured 42.0 % against the plan's 43.3 %."""
    from appliance.monitor.summary import summarize

    summary = summarize(gpu_run, state="done", wall_seconds=100.0, stage_seconds={})
    gpu_run.summary.write_text(json.dumps(summary))
    speed = next(line for line in closing_summary(gpu_run) if line.lstrip().startswith("speed"))
    assert speed.endswith("102k tokens/s (plan 105k), MFU 42.0% (plan 43.3%)")
