"""Headless output for batch logs: readable lines, or the events as JSON lines."""

from __future__ import annotations

import io
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from appliance.errors import BadInput
from appliance.monitor.events import make_event
from appliance.monitor.headless import HeadlessPrinter, fmt_bytes, fmt_duration, fmt_loss_scale, fmt_pct, fmt_si

T0 = 1_000_000.0


def step(n: int) -> dict[str, object]:
    return make_event(
        "step",
        t=T0 + n,
        step=n,
        loss=2.5,
        lr=3e-4,
        grad_norm=1.0,
        tokens_per_s=41_200.0,
        tflops_per_gpu=150.2,
        mfu=0.481,
        consumed_samples=n,
        total_steps=100,
    )


def text_lines(events: list[dict[str, object]], every_steps: int = 10) -> list[str]:
    out = io.StringIO()
    printer = HeadlessPrinter(out, every_steps=every_steps)
    for event in events:
        printer.handle(event)
    # drop the "[mm-dd hh:mm:ss] " stamp, which is local time
    return [x.split("] ", 1)[1] for x in out.getvalue().splitlines()]


def test_a_background_save_line_names_what_the_steps_waited() -> None:
    event = make_event("checkpoint", t=T0, step=25, path="c/25", seconds=12.0, bytes=2.5e9, stall_s=0.4)
    assert text_lines([event]) == ["checkpoint step 25 saved in 12s (2.5 GB, steps waited 0.4s) -> c/25"]


def test_text_mode_lines() -> None:
    events = [
        make_event("stage", t=T0, name="training", state="started", progress=0.0),
        make_event("stage", t=T0 + 1, name="training", state="running", progress=0.1),
        make_event("stage", t=T0 + 2, name="training", state="running", progress=0.2),
        *[step(n) for n in range(1, 26)],
        make_event("checkpoint", t=T0 + 26, step=25, path="checkpoints/step-00000025", seconds=12.0, bytes=2.5e9),
        make_event("gpu", t=T0 + 26, node="a", devices=[]),
        make_event("failure", t=T0 + 30, rank=3, reason="killed by signal 9"),
        make_event("recovery", t=T0 + 90, restart=1, resumed_step=25, lost_seconds=65.0),
        make_event("eval", t=T0 + 99, perplexity=11.5),
        make_event("stage", t=T0 + 100, name="training", state="done", progress=1.0),
        make_event("run", t=T0 + 100, state="done"),
    ]
    lines = text_lines(events)
    assert lines[:3] == ["stage training started", "stage training running", lines[2]]
    steps = [x for x in lines if x.startswith("step ")]
    assert [x.split()[1] for x in steps] == ["1/100", "11/100", "21/100"]
    # 79 steps left at 1 s a step
    assert steps[-1] == "step 21/100 (21.0%) loss 2.5 lr 3.00e-04 tok/s 41.2k TFLOPs/GPU 150.2 MFU 48.1% ETA 1m19s"
    assert "checkpoint step 25 saved in 12s (2.5 GB) -> checkpoints/step-00000025" in lines
    assert "FAILURE rank 3: killed by signal 9" in lines
    assert "recovery: restart 1, resumed at step 25, lost 1m05s" in lines
    assert "eval perplexity 11.5" in lines
    assert lines[-2:] == ["stage training done after 1m40s", "run done"]
    assert not any("gpu" in x for x in lines)


def test_fp16_step_lines_show_the_loss_scale_and_the_overflow_steps() -> None:
    fp16 = [{**step(n), "loss_scale": 2.0**16 if n < 3 else 2.0**15, "skipped_steps": min(n, 2)} for n in range(1, 12)]
    steps = [x for x in text_lines(fp16) if x.startswith("step ")]
    assert steps[0].endswith("ETA - loss scale 2^16, 1 skipped")  # one step: no rate for an ETA yet
    assert steps[1].endswith("ETA 1m29s loss scale 2^15, 2 skipped")
    assert all("loss scale" not in x for x in text_lines([step(n) for n in range(1, 12)]))  # bf16 and fp32 runs


def test_eval_lines_stay_one_readable_line() -> None:
    event = make_event(
        "eval",
        t=T0,
        step=200,
        valid_loss=7.3429,
        per_source={"en": 7.2, "fr": 7.5},
        sample={"prompt": "The capital of France is", "text": " Paris.\nIt lies on the Seine."},
    )
    assert text_lines([event]) == [
        'eval step 200 valid_loss 7.343 (+2 per_source) sample "The capital of France is Paris. It lies on the Seine."'
    ]


def test_eval_lines_give_the_bits_per_byte() -> None:
    bpb = {"valid_bits_per_byte": 2.3456, "per_source_bits_per_byte": {"en": 2.2, "fr": 2.5}}
    event = make_event("eval", t=T0, step=200, valid_loss=7.3429, per_source={"en": 7.2, "fr": 7.5}, **bpb)
    assert text_lines([event]) == [
        "eval step 200 valid_loss 7.343 valid_bits_per_byte 2.346 (+2 per_source, +2 per_source_bits_per_byte)"
    ]


def test_json_mode_prints_every_event_as_one_line() -> None:
    out = io.StringIO()
    printer = HeadlessPrinter(out, log_format="json")
    events = [step(1), make_event("gpu", t=T0, node="a", devices=[])]
    for event in events:
        printer.handle(event)
    assert [json.loads(x) for x in out.getvalue().splitlines()] == events


def test_bad_settings_name_the_flag() -> None:
    with pytest.raises(BadInput, match="--log-format"):
        HeadlessPrinter(io.StringIO(), log_format="yaml")
    with pytest.raises(BadInput, match=">= 1"):
        HeadlessPrinter(io.StringIO(), every_steps=0)


def test_number_formats() -> None:
    assert [fmt_duration(s) for s in (None, 0.325, 5, 65, 3725, 180000)] == [
        "-",
        "0.325s",
        "5s",
        "1m05s",
        "1h02m",
        "2d02h",
    ]
    assert [fmt_si(v) for v in (950, 41_234, 1.2e6, None)] == ["950", "41.2k", "1.2M", "-"]
    assert fmt_bytes(2.3e12) == "2.3 TB" and fmt_pct(0.481) == "48.1%" and fmt_pct(48.1) == "48.1%"
    assert [fmt_loss_scale(s, None) for s in (4096.0, 2.0**24, 0.25, 3000.0, None, math.inf)] == [
        "2^12",
        "2^24",
        "2^-2",
        "3k",
        "-",
        "-",
    ]
    assert fmt_loss_scale(4096, 7) == "2^12, 7 skipped"


def test_a_headless_run_never_imports_textual(tmp_path: Path) -> None:
    """Follow a run, print it both ways and sample GPUs/energy in a fresh interpreter: no textual module loads."""
    run = tmp_path / "run"
    code = f"""
import io, sys
from pathlib import Path
from appliance.monitor.events import EventWriter
from appliance.monitor.energy import EnergyMeter
from appliance.monitor.gpu import GpuSampler
from appliance.monitor.headless import HeadlessPrinter, follow_run
from appliance.rundir import RunDir
run = RunDir(Path({str(run)!r})).make()
with EventWriter(run.metrics) as writer:
    writer.emit("stage", name="train", state="started", progress=0.0)
    GpuSampler(writer, node="n", energy=EnergyMeter()).tick()
for log_format in ("text", "json"):
    follow_run(run.root, HeadlessPrinter(io.StringIO(), log_format=log_format), stop=lambda: True)
loaded = sorted(m for m in sys.modules if m.split(".")[0] == "textual")
assert not loaded, loaded
"""
    repo = Path(__file__).resolve().parents[2]
    result = subprocess.run([sys.executable, "-c", code], cwd=repo, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
