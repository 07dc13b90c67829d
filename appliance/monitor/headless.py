"""Headless progress for batch schedulers: readable lines (`--log-format text`) or the events as JSON lines
(`--log-format json`). No terminal assumptions and no Textual: this is what a SLURM log file shows.

The number formats here are shared with the dashboard, so a figure reads the same in both.
"""

from __future__ import annotations

import json
import math
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TextIO

from appliance.errors import BadInput
from appliance.monitor.event_kinds import EVENT_KINDS
from appliance.monitor.events import EventTail, finite
from appliance.monitor.snapshot import SAVE_EVERY_S, SAVE_MIN_NEW_BYTES, SnapshotSaver, attach
from appliance.monitor.state import RunState, reduce
from appliance.rundir import RunDir

LOG_FORMATS = ("text", "json")
MISSING = "-"


# ---- number formats -----------------------------------------------------------------------------------------
def fmt_duration(seconds: float | None) -> str:
    """0.325s, 45s, 12m03s, 3h02m, 2d04h."""
    if seconds is None or not math.isfinite(seconds):
        return MISSING
    if seconds < 9.995:  # a CPU smoke run's steps take fractions of a second
        return f"{max(0.0, seconds):.3g}s"
    s = round(seconds)
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    if s < 86400:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    return f"{s // 86400}d{s % 86400 // 3600:02d}h"


def fmt_si(value: float | None, digits: int = 3) -> str:
    """12.3k, 1.20M, 950: `digits` significant figures with an SI prefix."""
    if value is None or not math.isfinite(value):
        return MISSING
    for factor, prefix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(value) >= factor:
            return f"{value / factor:.{digits}g}{prefix}"
    return f"{value:.{digits}g}"


def fmt_bytes(count: float | None) -> str:
    if count is None:
        return MISSING
    for factor, unit in ((1e12, "TB"), (1e9, "GB"), (1e6, "MB"), (1e3, "kB")):
        if count >= factor:
            return f"{count / factor:.1f} {unit}"
    return f"{int(count)} B"


def fmt_pct(fraction: float | None) -> str:
    """MFU and progress are fractions; a value above 1.5 was already sent as a percentage."""
    if fraction is None or not math.isfinite(fraction):
        return MISSING
    return f"{fraction if fraction > 1.5 else fraction * 100:.1f}%"


def fmt_float(value: float | None, spec: str = ".4g") -> str:
    return MISSING if value is None or not math.isfinite(value) else format(value, spec)


def fmt_loss_scale(scale: float | None, skipped_steps: int | None) -> str:
    """fp16's dynamic loss scale and the overflow steps it cost: "2^12, 3 skipped". DeepSpeed's scales are
    powers of two (a power of two to start, halved or doubled since), written as such."""
    if scale is None or not math.isfinite(scale) or scale <= 0:
        return MISSING
    exponent = math.log2(scale)
    text = f"2^{exponent:.0f}" if exponent == round(exponent) else fmt_si(scale)
    return text if skipped_steps is None else f"{text}, {skipped_steps} skipped"


def fmt_clock(t: float | None) -> str:
    return MISSING if t is None else time.strftime("%m-%d %H:%M:%S", time.localtime(t))


def flops_per_device(state: RunState, tflops: float | None) -> tuple[str, str]:
    """The label and value of a FLOP rate the step events send as TFLOP/s per device: on GPUs "TFLOPs/GPU" and
    "150.2"; on CPU ranks (the plan says so, or no node lists a GPU) "FLOP/s/rank" and "190M", as a CPU rank does
    far below a TFLOP/s."""
    if state.has_gpus is False:
        return "FLOP/s/rank", fmt_si(None if tflops is None else tflops * 1e12)
    return "TFLOPs/GPU", fmt_float(tflops, ".4g")


def shows_mfu(state: RunState) -> bool:
    """MFU is against the GPU's dense peak; a CPU rank's peak is an assumed figure, not a measured one (hardware/
    specs.py CPU_SPEC), so CPU runs show none."""
    return state.has_gpus is not False


def step_line(state: RunState) -> str:
    """step 120/1000 (12.0%) loss 3.214 lr 2.00e-04 tok/s 12.3k TFLOPs/GPU 150 MFU 48.1% ETA 1h02m
    (CPU ranks: FLOP/s/rank 190M, no MFU) and, in fp16 runs, loss scale 2^12, 3 skipped"""
    total = f"/{state.total_steps}" if state.total_steps else ""
    share = f" ({fmt_pct(state.step / state.total_steps)})" if state.total_steps and state.step is not None else ""
    scale = f" loss scale {fmt_loss_scale(state.loss_scale, state.skipped_steps)}" if state.loss_scale else ""
    label, rate = flops_per_device(state, state.tflops_per_gpu)
    mfu = f"MFU {fmt_pct(state.mfu)} " if shows_mfu(state) else ""
    return (
        f"step {state.step}{total}{share} loss {fmt_float(state.loss)} lr {fmt_float(state.lr, '.2e')} "
        f"tok/s {fmt_si(state.tokens_per_s)} {label} {rate} {mfu}ETA {fmt_duration(state.training_eta_s)}{scale}"
    )


# ---- the printer --------------------------------------------------------------------------------------------
class HeadlessPrinter:
    """Turns events into log lines. Text: a line per stage change, every `every_steps` steps, and per
    checkpoint, failure, recovery, eval, warning and run state. JSON: every event, one object per line.

    `closing(facts)`: the lines of the closing summary (monitor/closing.py) the run's last `run` event carries, printed
    as a block under its line in text mode (`run` gives it; a printer without it prints the run line alone)."""

    def __init__(
        self,
        stream: TextIO = sys.stdout,
        log_format: str = "text",
        every_steps: int = 10,
        closing: Callable[[dict[str, Any]], list[str]] | None = None,
    ) -> None:
        if log_format not in LOG_FORMATS:
            raise BadInput(f"--log-format must be one of {', '.join(LOG_FORMATS)}, got {log_format!r}")
        if every_steps < 1:
            raise BadInput(f"the step print interval must be >= 1, got {every_steps}")
        self.stream, self.log_format, self.every_steps = stream, log_format, every_steps
        self.closing = closing
        self.state = RunState()
        self._printed_step: int | None = None
        self._stage_states: dict[str, str] = {}

    def absorb(self, event: dict[str, Any]) -> None:
        """Fold an event into the printer's state without printing it (history before a resume)."""
        reduce(self.state, event)
        if event.get("kind") == "step" and isinstance(event.get("step"), int):
            self._printed_step = event["step"]
        if event.get("kind") == "stage":
            self._stage_states[str(event.get("name"))] = str(event.get("state"))

    def adopt(self, state: RunState) -> None:
        """Start from a saved state (monitor/snapshot.py), as if every event it covers had been absorbed."""
        self.state = state
        self._printed_step = state.step
        self._stage_states = {name: info.state for name, info in state.stages.items()}

    def handle(self, event: dict[str, Any]) -> None:
        reduce(self.state, event)
        if not isinstance(event, dict):
            return  # not an event (RunState counted it as bad)
        if self.log_format == "json":
            self._write(json.dumps(event, separators=(",", ":")))
            return
        text = self._text(event)
        if text:
            # Several lines: the log line, then a block printed as it is (the closing summary, under `run done`).
            first, *block = [text] if isinstance(text, str) else text
            self._write(f"[{fmt_clock(event.get('t'))}] {first}")
            for line in block:
                self._write(line)

    def _write(self, line: str) -> None:
        self.stream.write(line + "\n")
        self.stream.flush()  # a batch log is read while the job runs

    def _text(self, e: dict[str, Any]) -> str | list[str] | None:
        kind = e.get("kind")
        declared = EVENT_KINDS.get(kind) if isinstance(kind, str) else None
        if declared is None or declared.line is None:
            return None  # gpu and energy events are dashboard material; json mode carries them
        text: str | list[str] | None = getattr(self, declared.line)(e)
        return text

    # ---- each kind's line, named by its declaration (event_kinds.py) --------------------------------------------
    def text_step(self, e: dict[str, Any]) -> str | None:
        step = self.state.step
        if step is None or (self._printed_step is not None and 0 <= step - self._printed_step < self.every_steps):
            return None
        self._printed_step = step
        return step_line(self.state)

    def text_checkpoint(self, e: dict[str, Any]) -> str:
        waited = f", steps waited {fmt_duration(e['stall_s'])}" if finite(e.get("stall_s")) is not None else ""
        return (
            f"checkpoint step {e.get('step')} saved in {fmt_duration(e.get('seconds'))} "
            f"({fmt_bytes(e.get('bytes'))}{waited}) -> {e.get('path')}"
        )

    def text_failure(self, e: dict[str, Any]) -> str:
        where = f"node {e.get('node')}" if e.get("rank") is None and e.get("node") else f"rank {e.get('rank')}"
        return f"FAILURE {where}: {e.get('reason')}"

    def text_recovery(self, e: dict[str, Any]) -> str:
        nodes = f"; {e.get('reason')}" if e.get("lost_nodes") or e.get("joined_nodes") else ""
        return (
            f"recovery: restart {e.get('restart')}, resumed at step {e.get('resumed_step')}, "
            f"lost {fmt_duration(e.get('lost_seconds'))}{nodes}"
        )

    def text_nodes(self, e: dict[str, Any]) -> str:
        spares = len(e.get("spares", []))
        change, node = e.get("change"), e.get("node")
        if change == "spare_lost":
            return f"nodes: spare {node} stopped beating; {spares} spares left"
        if change == "spare_joined":
            return f"nodes: {node} stands by as a spare; {spares} spares"
        if change == "taking_over":
            return f"nodes: spare {node} takes the place of {e.get('replaces')}; {spares} spares left"
        if change == "joining":
            return f"nodes: {node} joins the training nodes; {spares} spares left"
        left = f", {e['restarts_left']} restarts left" if e.get("restarts_left") is not None else ""
        return f"nodes: {len(e.get('nodes', []))} training, {spares} standing by as spares{left}"

    def text_eval(self, e: dict[str, Any]) -> str:
        return eval_line(e)

    def text_warning(self, e: dict[str, Any]) -> str:
        return f"warning: {e.get('message')}"

    def text_run(self, e: dict[str, Any]) -> str | list[str]:
        line = f"run {e.get('state')}"
        facts = e.get("closing")
        if self.closing is None or not isinstance(facts, dict):
            return line
        try:
            return [line, *self.closing(facts)]
        except (TypeError, ValueError, KeyError, AttributeError):
            return line  # facts of another version or a hand-edited file: the log goes on without them

    def text_plan(self, e: dict[str, Any]) -> str:
        return plan_line(e)

    def text_settings(self, e: dict[str, Any]) -> str:
        """--set on a started run (train/live_settings.py)."""
        changed = ", ".join(f"{c.get('key')} {c.get('old')} -> {c.get('new')}" for c in e.get("changes") or [])
        return f"settings changed after step {e.get('step')}: {changed}"

    def text_kernels(self, e: dict[str, Any]) -> str:
        """The fused ops' implementations this launch runs (parallel/step/kernel_choice.py)."""
        return f"kernels {kernels_text(e)}"

    def text_startup(self, e: dict[str, Any]) -> str:
        """Where the launch's start went (train/startup.py)."""
        return startup_text(e)

    def text_preflight(self, e: dict[str, Any]) -> list[str]:
        """Node 0's preflight of the plan (train/preflight_check.py): a line, then one per role."""
        return preflight_lines(e)

    def text_stage(self, e: dict[str, Any]) -> str | None:
        name, state = str(e.get("name")), str(e.get("state"))
        if state == "skipped":  # a rerun's: when the stage was done, not the time since an earlier launch began it
            self._stage_states[name] = state
            done = finite(e.get("done_t"))
            when = "earlier" if done is None else time.strftime("%Y-%m-%d %H:%M", time.localtime(done))
            return f"{name}: done {when}, skipped"
        if self._stage_states.get(name) == state:
            return None  # progress within a state is not a change
        self._stage_states[name] = state
        info = self.state.stages[name]
        if state in ("done", "failed", "skipped", "stopped") and info.finished_t is not None:
            return f"stage {name} {state} after {fmt_duration(info.finished_t - info.started_t)}"
        return f"stage {name} {state}"


# The fused ops by the names a reader knows them by.
KERNEL_OP_NAMES = {
    "flash_alibi_attention": "attention",
    "layer_norm": "LayerNorm",
    "bias_gelu": "bias+GeLU",
    "vocab_cross_entropy": "loss",
}


def kernels_text(e: dict[str, Any]) -> str:
    """A measured (or cached) selection as `measured: attention sdpa 3.1 ms, LayerNorm compiled 0.21 ms, ...`;
    without one, `forced: triton (BLOOM_KERNELS=triton)` or `default: reference (BLOOM_KERNELS=auto)`."""
    choices, times = e.get("choices") or {}, e.get("times_ms") or {}
    if not choices:
        return f"{e.get('source')}: {e.get('backend')} ({e.get('backend_env')})"
    parts = []
    for op, backend in choices.items():
        ms = finite((times.get(op) or {}).get(backend))
        parts.append(f"{KERNEL_OP_NAMES.get(op, op)} {backend}" + (f" {ms:.3g} ms" if ms is not None else ""))
    return f"{e.get('source')}: " + ", ".join(parts)


def startup_text(e: dict[str, Any]) -> str:
    """`startup 17.3s to the end of step 1 (from the launch): agent 1.96s, imports 8.38s, ...`."""
    phases = e.get("phases") or {}
    parts = ", ".join(f"{name.replace('_', ' ')} {fmt_duration(finite(s))}" for name, s in phases.items())
    origin = "the launch" if e.get("from") == "launch" else "the rank's process start"
    return (
        f"startup {fmt_duration(finite(e.get('total_s')))} to the end of step {e.get('step')} (from {origin}): {parts}"
    )


def preflight_lines(e: dict[str, Any]) -> list[str]:
    """`preflight bloom-micro-test at tp1 pp1 dp2 ...: every role fits`, then per role
    `  whole (stages [0]): fits, 512.0 MB of 1.1 GB, 3.1 ms per micro-batch (planned 2.9 ms)`."""
    roles = [r for r in e.get("roles") or [] if isinstance(r, dict)]
    over = [str(r.get("role")) for r in roles if r.get("fits") is False]
    verdict = f"DOES NOT FIT: {', '.join(over)}" if over else "every role fits"
    lines = [f"preflight {e.get('model', 'the plan')} at {e.get('layout', '-')}: {verdict}"]
    for r in roles:
        ms = r.get("ms_per_micro_batch")
        ms = ms if isinstance(ms, dict) else {}
        measured, planned = finite(ms.get("measured")), finite(ms.get("planned"))
        lines.append(
            f"  {r.get('role')} (stages {r.get('stages')}): {'fits' if r.get('fits') else 'DOES NOT FIT'},"
            f" {fmt_bytes(finite(r.get('total_bytes')))} of {fmt_bytes(finite(r.get('capacity_bytes')))},"
            f" {fmt_float(measured, '.3g')} ms per micro-batch (planned {fmt_float(planned, '.3g')} ms)"
        )
    return lines


def plan_line(e: dict[str, Any]) -> str:
    """plan bloom-tiny-cpu (1.4M parameters), tp1 pp1 dp2 mbs8 gbs16 zero0 recompute none; estimated 200 steps in
    1m05s, 0.00045 kWh, 0.00018 kg CO2eq, $0.00 — the figures a user weighs before the run starts."""
    model, layout, run = e.get("model") or {}, e.get("layout") or {}, e.get("run") or {}
    params = model.get("parameters")
    size = f" ({fmt_si(params)} parameters)" if isinstance(params, int | float) else ""
    shape = (
        f"tp{layout.get('tp')} pp{layout.get('pp')} dp{layout.get('dp')} mbs{layout.get('micro_batch_size')} "
        f"gbs{layout.get('global_batch_size')} zero{layout.get('zero_stage')} recompute {layout.get('recompute')}"
    )
    line = f"plan {model.get('name', 'model')}{size}, {shape}"
    if run:
        line += (
            f"; estimated {run.get('steps')} steps in {fmt_duration(run.get('time_s'))}, "
            f"{fmt_float(run.get('energy_kwh'))} kWh, {fmt_float(run.get('co2_kg'))} kg CO2eq, "
            f"${run.get('cost_usd', 0.0):,.2f}"
        )
        if run.get("limit"):
            line += f"; limit {run['limit']}"
    return line


def eval_line(e: dict[str, Any]) -> str:
    """eval valid_loss 7.343 valid_ppl 1545 (+12 per_source) sample "The capital of France is Paris..."

    The top-level figures in full; nested groups (per source, per task) only counted, to keep one line readable.
    """
    parts, nested = ["eval"], []
    for key, value in e.items():
        if key in ("t", "kind", "final", "consumed_samples", "prompt", "sample", "samples"):
            continue
        if isinstance(value, dict):
            nested.append(f"+{len(value)} {key}")
        elif isinstance(value, float):
            parts.append(f"{key} {fmt_float(value)}")
        elif isinstance(value, int | str) and not isinstance(value, bool):
            parts.append(f"{key} {value}")
    if nested:
        parts.append(f"({', '.join(nested)})")
    sample = e.get("sample")
    text = (sample.get("completion") or sample.get("text")) if isinstance(sample, dict) else sample
    if isinstance(text, str):
        prompt = sample.get("prompt", "") if isinstance(sample, dict) else e.get("prompt", "")
        full = f"{prompt or ''}{text}".replace("\n", " ")
        parts.append(f'sample "{full[:80]}{"..." if len(full) > 80 else ""}"')
    return " ".join(parts)


def follow_run(
    run_dir: Path,
    printer: HeadlessPrinter,
    *,
    stop: Callable[[], bool],
    poll_interval: float = 0.5,
    skip_existing: bool = False,
    snapshot_every_s: float | None = SAVE_EVERY_S,
    snapshot_min_bytes: int = SAVE_MIN_NEW_BYTES,
) -> int:
    """Print the run's events as they arrive until stop() is true, then drain what is left. Returns the number
    of events handled. With skip_existing, events already in metrics.jsonl are absorbed silently (a resume),
    from metrics.snapshot on when it is valid.

    The follower also keeps metrics.snapshot (monitor/snapshot.py) every `snapshot_every_s` (None: never) once
    `snapshot_min_bytes` of new events arrived, and when it stops: it is the process that folds every event
    anyway, from byte 0, for the whole life of the run (the head runs it), so the snapshot costs it one JSON
    encoding every few minutes and saves every later attach the full read. A snapshot that attach refuses (damaged,
    crafted, another version) is logged as a warning and the whole file is absorbed instead."""
    metrics = RunDir(Path(run_dir)).metrics
    tail = EventTail(metrics)
    saver = SnapshotSaver(metrics, snapshot_every_s, snapshot_min_bytes) if snapshot_every_s is not None else None
    if skip_existing:
        state, tail, loaded = attach(metrics)  # the history from the snapshot when it is valid: a resume of a
        if loaded.state is not None:  # long run does not re-read its months of events
            printer.adopt(state)
            if saver is not None:
                saver.saved_offset = loaded.offset
        for event in tail.read_new():
            printer.absorb(event)
    handled = 0
    while True:
        done = stop()  # checked before reading, so the last read sees everything written before stop
        for event in tail.read_new():
            printer.handle(event)
            handled += 1
        if saver is not None:
            saver.maybe_save(printer.state, tail, force=done)
        if done:
            return handled
        time.sleep(poll_interval)
