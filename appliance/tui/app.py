"""The dashboard: one screen that shows a run at a glance, live or finished, from any machine that sees its
run directory.

Reading: a timer starts a thread worker every `poll_interval`; the worker reads only the new bytes of
metrics.jsonl (EventTail), folds them into the RunState under a lock and posts StateChanged naming the sections
that changed; the handler redraws only those panels. The first read starts from metrics.snapshot when it is valid
(monitor/snapshot.py: the state as of a byte offset, saved by the head's follower), so attaching to a long run
folds only the events after that offset (a snapshot it refuses is named in a warning, and the whole file is read);
the dashboard keeps the snapshot too, when it can write the run directory. Keys write control files the trainer
polls, so the dashboard never talks to the training processes and quitting it leaves the run alone.
"""

from __future__ import annotations

import json
import math
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, ClassVar

from textual import work
from textual.app import App, ComposeResult
from textual.binding import Binding, BindingType
from textual.containers import Horizontal, Vertical, VerticalScroll
from textual.message import Message
from textual.widgets import Footer, Static

from appliance.monitor.closing import COMMAND, closing_summary, live_facts
from appliance.monitor.events import EventTail
from appliance.monitor.headless import fmt_loss_scale
from appliance.monitor.snapshot import SnapshotSaver, attach
from appliance.monitor.state import RunState, reduce
from appliance.monitor.state_fields import SECTIONS, TERMINAL_RUN_STATES
from appliance.rundir import RunDir
from appliance.tui.screens.confirm import ConfirmScreen
from appliance.tui.screens.help import HelpScreen
from appliance.tui.widgets.checkpoints import CheckpointPanel
from appliance.tui.widgets.energy import EnergyPanel
from appliance.tui.widgets.eval_languages import LanguageScores
from appliance.tui.widgets.eval_tasks import TaskScores
from appliance.tui.widgets.experts import ExpertsPanel
from appliance.tui.widgets.gpus import GpuTable
from appliance.tui.widgets.header import RunHeader
from appliance.tui.widgets.panel import Panel
from appliance.tui.widgets.plot import LinePlot
from appliance.tui.widgets.preflight import PreflightPanel
from appliance.tui.widgets.stages import StagesPanel
from appliance.tui.widgets.throughput import ThroughputPanel
from appliance.tui.widgets.timeline import TimelinePanel

REDUCE_BATCH = 20_000  # events folded per lock hold when catching up on a long run: the UI thread never waits long
# Least seconds between two redraws of a section. GPU and energy figures change once per sampling interval (5 s),
# node after node, so redrawing them at every poll would cost CPU (a 48-row table) and show nothing new; the
# header changes with every event. Everything else redraws as soon as it changes.
REDRAW_EVERY = {"gpus": 5.0, "energy": 5.0, "run": 1.0}


class StateChanged(Message):
    """The reader folded new events (or files) into the state; `sections` says which panels to redraw."""

    def __init__(self, sections: frozenset[str], metrics_exists: bool) -> None:
        super().__init__()
        self.sections, self.metrics_exists = sections, metrics_exists


class ReadFailed(Message):
    """The run directory could not be read (permissions, a vanished mount); shown once per distinct reason."""

    def __init__(self, reason: str) -> None:
        super().__init__()
        self.reason = reason


class DashboardApp(App[int]):
    CSS_PATH = "app.tcss"
    TITLE = "BLOOM appliance"
    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("q", "quit_dashboard", "quit (run goes on)"),
        Binding("s", "request_checkpoint", "checkpoint now"),
        Binding("x", "request_stop", "save & exit"),
        Binding("question_mark", "help", "help", key_display="?"),
    ]

    def __init__(self, run_dir: Path, *, follow: bool = True, poll_interval: float = 0.5) -> None:
        super().__init__()
        self.run_dir = RunDir(Path(run_dir))
        self.follow, self.poll_interval = follow, poll_interval
        self.state = RunState()
        self.state_lock = threading.Lock()  # the reader thread folds events, the UI thread draws from them
        self._read_lock = threading.Lock()  # one read at a time: a slow read makes the next tick skip
        self._tail = EventTail(self.run_dir.metrics)
        self._attached = False  # the first read loads the snapshot, in the reader thread
        self.attach_note = ""  # why the snapshot was not used ("" when it was, or before the first read)
        self._saver = SnapshotSaver(self.run_dir.metrics, every_s=600.0)
        self._file_mtimes: dict[Path, float] = {}
        self.reads_done = 0  # reads whose result the UI has drawn (tests wait on it)
        self._pending: set[str] = set()  # changed sections waiting for their REDRAW_EVERY
        self._drawn_at: dict[str, float] = {}
        self._last_error: str | None = None

    def compose(self) -> ComposeResult:
        yield RunHeader(self.run_dir.root, id="header")
        yield Static(id="waiting")
        with VerticalScroll(id="body"):
            with Horizontal(id="row-top"):
                yield ThroughputPanel(id="throughput")
                yield StagesPanel(id="stages")
                yield CheckpointPanel(id="checkpoints")
            with Horizontal(id="row-curves"):
                yield LinePlot("loss", style="bright_cyan", id="loss")
                with Vertical(id="curves-side"):
                    yield LinePlot("learning rate", style="magenta", id="lr")
                    yield LinePlot("grad norm", style="yellow", id="grad-norm")
            with Horizontal(id="row-bottom"):
                yield GpuTable(id="gpus")
                yield EnergyPanel(id="energy")
                yield TimelinePanel(id="timeline")
            yield ExpertsPanel(id="experts")  # MoE runs only (hidden until a step event carries MoE fields)
            yield PreflightPanel(id="preflight")  # hidden until the run directory has a preflight.json
            with Horizontal(id="eval"):
                yield LanguageScores(id="eval-languages")
                yield TaskScores(id="eval-tasks")
        yield Footer()

    def on_mount(self) -> None:
        # References, not queries, from here on: app.query_one() searches the active screen, which is the help
        # or confirm screen while one is open.
        self._panels: list[Panel | GpuTable] = [*self.query(Panel), self.query_one(GpuTable)]
        self._header = self.query_one(RunHeader)
        self._waiting = self.query_one("#waiting", Static)
        self._body = self.query_one("#body", VerticalScroll)
        self._plots: list[tuple[LinePlot, str, Callable[[RunState], str] | None]] = [
            (self.query_one("#loss", LinePlot), "loss_series", None),
            (self.query_one("#lr", LinePlot), "lr_series", None),
            (self.query_one("#grad-norm", LinePlot), "grad_norm_series", loss_scale_note),
        ]
        self._draw(frozenset(SECTIONS), metrics_exists=self.run_dir.metrics.exists())
        self.read_run()
        if self.follow:
            self.set_interval(self.poll_interval, self.read_run)
            self.set_interval(1.0, self._tick_header)

    # ---- reading (thread worker) ----------------------------------------------------------------------------
    @work(thread=True, group="reader", exit_on_error=False)
    def read_run(self) -> None:
        if not self._read_lock.acquire(blocking=False):
            return
        try:
            sections = self._read_once()
        except OSError as exc:
            self.post_message(ReadFailed(f"{type(exc).__name__}: {exc}"))
            return
        finally:
            self._read_lock.release()
        self.post_message(StateChanged(frozenset(sections), self.run_dir.metrics.exists()))

    def _read_once(self) -> set[str]:
        read = (("plan", self.run_dir.plan), ("eval", self.run_dir.eval), ("preflight", self.run_dir.preflight))
        files = [e for e in (self._json_event(path, kind) for kind, path in read) if e]
        if not self._attached:
            state, self._tail, loaded = attach(self.run_dir.metrics)
            self.attach_note = loaded.reason
            if loaded.refused:  # damaged, crafted or from another version: say why the first read takes long
                self.notify(f"{loaded.reason}; reading all of metrics.jsonl instead", severity="warning")
            self._saver.saved_offset = loaded.offset
            with self.state_lock:
                self.state = state
            self._attached = True
        events = files + self._tail.read_new()
        control = (self.run_dir.request_checkpoint.exists(), self.run_dir.request_stop.exists())
        changed: set[str] = set()
        for start in range(0, max(1, len(events)), REDUCE_BATCH):
            with self.state_lock:
                for event in events[start : start + REDUCE_BATCH]:
                    reduce(self.state, event)
                if start + REDUCE_BATCH >= len(events):
                    self.state.set_control(*control)
                changed |= self.state.take_changed()
        if self.follow:
            with self.state_lock:
                self._saver.maybe_save(self.state, self._tail)
        return changed

    def _json_event(self, path: Path, kind: str) -> dict[str, Any] | None:
        """plan.json / eval.json / preflight.json as a plan / eval / preflight event, when the file is new or changed
        since the last read."""
        try:
            mtime = path.stat().st_mtime
        except FileNotFoundError:
            return None
        if self._file_mtimes.get(path) == mtime:
            return None
        try:
            content = json.loads(path.read_text(encoding="utf-8"))
        except (json.JSONDecodeError, UnicodeDecodeError):
            return None  # being written: the next tick reads it whole
        self._file_mtimes[path] = mtime
        return {"t": None, "kind": kind, **content} if isinstance(content, dict) else None

    # ---- drawing (UI thread) --------------------------------------------------------------------------------
    def on_state_changed(self, message: StateChanged) -> None:
        self._pending |= message.sections
        now = time.monotonic()
        due = {s for s in self._pending if now - self._drawn_at.get(s, -math.inf) >= REDRAW_EVERY.get(s, 0.0)}
        self._pending -= due
        self._drawn_at.update(dict.fromkeys(due, now))
        self._draw(frozenset(due), metrics_exists=message.metrics_exists)
        self.reads_done += 1

    def on_read_failed(self, message: ReadFailed) -> None:
        if message.reason != self._last_error:  # once per distinct problem, not every tick
            self._last_error = message.reason
            self.notify(f"cannot read the run: {message.reason}", severity="error")

    def _draw(self, sections: frozenset[str], *, metrics_exists: bool) -> None:
        with self.state_lock:
            started = self.state.started
            self._body.display = started
            self._waiting.display = not started
            if not started:
                file_state = "is empty so far" if metrics_exists else "does not exist yet"
                self._waiting.update(f"Waiting for the run to start.\n\n{self.run_dir.metrics} {file_state}.")
            if "run" in sections or not started:
                self._header.show(self.state, live=self.follow)
            if not sections or not started:
                return
            if sections & {"gpus", "plan"}:
                # A CPU run has no GPU table: app.tcss gives its width to the energy and failures panels.
                self._body.set_class(self.state.has_gpus is False, "-no-gpus")
            for panel in self._panels:
                if panel.SECTIONS & sections:
                    panel.show(self.state)
            if "curves" in sections:
                for plot, series, note in self._plots:
                    plot.show(getattr(self.state, series), note(self.state) if note else "")

    def _tick_header(self) -> None:
        with self.state_lock:
            if self.state.started and not self.state.finished:
                self._header.show(self.state, live=True)

    # ---- leaving --------------------------------------------------------------------------------------------
    def closing(self) -> list[str]:
        """What the dashboard prints as the user leaves it: the run's closing summary from its files
        (monitor/closing.py) and, while the run goes on, what is still running and how to come back."""
        with self.state_lock:
            started, run_state = self.state.started, self.state.run_state
            live = None if run_state in TERMINAL_RUN_STATES else live_facts(self.state)
        if not started:
            return [f"No run has started in {self.run_dir.root} yet; wait for one with: {COMMAND} tui --run-dir "
                    f"{self.run_dir.root} --wait"]  # fmt: skip
        return closing_summary(self.run_dir, state=run_state, live=live)

    # ---- keys -----------------------------------------------------------------------------------------------
    def action_quit_dashboard(self) -> None:
        self.exit(0)

    def action_help(self) -> None:
        if not isinstance(self.screen, HelpScreen):
            self.push_screen(HelpScreen())

    def action_request_checkpoint(self) -> None:
        self._request(self.run_dir.request_checkpoint, "checkpoint")

    def action_request_stop(self) -> None:
        question = (
            "Save a checkpoint and stop the run?\n\n"
            'The trainer saves at its next step and exits with the "preempted" code; starting the run again '
            "resumes from that checkpoint."
        )

        def answered(yes: bool | None) -> None:
            if yes:
                self._request(self.run_dir.request_stop, "save-and-exit")

        self.push_screen(ConfirmScreen(question, yes_label="Save and exit"), answered)

    def _request(self, path: Path, what: str) -> None:
        if not self.run_dir.root.is_dir():
            self.notify(f"{self.run_dir.root} does not exist: no run to send a {what} request to", severity="error")
            return
        if self.state.finished:
            self.notify(
                f"the run has {self.state.run_state}: no trainer will read a {what} request", severity="warning"
            )
            return
        try:
            self.run_dir.make_control()
            path.touch()
        except OSError as exc:
            self.notify(f"cannot write {path}: {exc}", severity="error")
            return
        self.notify(f"{what} requested ({path.relative_to(self.run_dir.root)}); the trainer acts at its next step")
        self.read_run()


def loss_scale_note(state: RunState) -> str:
    """fp16's loss scale and its overflow steps, beside the grad norm (an overflow is a gradient event); "" when
    the run does not train in fp16."""
    if state.loss_scale is None:
        return ""
    return f"loss scale {fmt_loss_scale(state.loss_scale, state.skipped_steps)}"


def make_app(run_dir: Path, *, follow: bool = True, poll_interval: float = 0.5) -> DashboardApp:
    """The dashboard for `run_dir` (the one factory the CLI and the tests use). follow=False reads the run once."""
    if not poll_interval > 0:
        raise ValueError(f"poll_interval must be > 0, got {poll_interval}")
    return DashboardApp(Path(run_dir), follow=follow, poll_interval=poll_interval)


def show_dashboard(run_dir: Path) -> DashboardApp:
    """The dashboard in this terminal until the user quits; the run itself is not affected. Returns the app, which
    holds what it read last (its closing())."""
    app = make_app(run_dir)
    app.run()
    return app


def run_tui(run_dir: Path) -> int:
    """The dashboard until the user quits, then the closing summary: the run's results and the commands to run next,
    or, when it goes on, what is running and how to attach again."""
    app = show_dashboard(run_dir)
    print("\n".join(app.closing()))
    return app.return_code or 0
