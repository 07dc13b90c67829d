"""Folds metrics.jsonl events into one RunState that the dashboard and the headless printer both render.

Pure: no I/O and no wall clock. Every time-derived figure (rates, ETAs, "elapsed") is measured on the events' own
"t", so a finished run reads the same today as tomorrow, and replaying hours of a 384-GPU run costs only the
JSON parsing (bench/tui_tail.py measures it).

Optional keys this reader understands beyond the required ones of events.py (all "extend, never rename"):
  step:        total_steps, step_time_s, samples_per_s; fp16 runs: loss_scale, skipped_steps (steps the loss
               scaler skipped for an overflow, over the run) and overflow (this step was one of them: its gradient
               norm is the overflow's inf, not a model figure, so the grad norm curve leaves it out)
  stage:       error (of a failed stage)
  checkpoint:  every_steps (the configured interval), stall_s (what the training loop waited for the save; its
               files were written in the background: seconds is the write, emitted when the save committed)
  gpu/energy:  node (one sampler per node; the totals sum the latest event of each node)
  energy:      gpu_kwh, cpu_kwh, attempt_kwh, source, gpu_source, cpu_source, pue, grid_g_per_kwh (kwh and the
               split are the node's totals for the whole run, restarts included: monitor/energy.py)
  eval:        any numeric metric, nested dicts of them (per_source, per_source_bits_per_byte, tasks), sample /
               prompt (a generated text); per_source, valid_bits_per_byte, per_source_bits_per_byte and tasks are
               also read as a report (monitor/eval_report.py: a row per language with its loss, perplexity and
               bits per byte, a row per task with its standard errors)
  plan:        the plan.json object (or {"plan": {...}}): estimate.*, train.steps, train.save_interval,
               run.energy_kwh / run.co2_kg (the pre-run estimate for the whole run)
  run:         state (started, done, failed, preempted), name, reason
  kernels:     source, choices, times_ms (and backend when nothing was chosen per op): the newest is kept
  startup:     phases ({phase: seconds}), total_s, from, restart, step: the newest launch's start is kept
  step (MoE):  moe_aux_loss (the load-balancing loss), expert_load (per MoE layer, each expert's fraction of the
               tokens), expert_tier (the tiered expert store's counters: parallel/experts/store.py
               expert_tier_event); any of them makes `experts` non-None and shows the experts panel
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any

from appliance.monitor.eval_report import EvalReport, eval_report
from appliance.monitor.events import finite
from appliance.monitor.gpu import NodeGpus, parse_devices

# Panels refresh only when their section changed; reduce() records which ones an event touched.
SECTIONS = (
    "run", "throughput", "curves", "gpus", "stages", "checkpoints", "timeline", "energy", "eval", "plan", "experts",
)  # fmt: skip
TERMINAL_RUN_STATES = ("done", "failed", "preempted")
TRAINING_STAGES = ("training", "train")
STEP_WINDOW = 100  # step events kept for rates: with BLOOM's ~100 s steps, the last few hours
EVAL_BOOKKEEPING = ("t", "kind", "step", "consumed_samples", "final")  # when, not what was measured
TIMELINE_KEEP = 200  # failures/recoveries kept for display (the counters cover all of them)


def _first(mapping: dict[str, Any], *keys: str) -> Any:
    for key in keys:
        if mapping.get(key) is not None:
            return mapping[key]
    return None


class Series:
    """A metric against step, kept as at most `capacity` min/max buckets so a 100k-step curve stays cheap.

    Each bucket covers `span` consecutive points. When the buckets fill, neighbours merge in pairs and `span`
    doubles, so adding is O(1) amortized, memory is bounded, and the spikes survive (a bucket keeps its extremes).
    """

    __slots__ = ("_open", "capacity", "count", "hi", "last", "lo", "nonfinite", "span", "x0", "x1")

    def __init__(self, capacity: int = 1024) -> None:
        self.capacity = capacity + capacity % 2  # even, so the bucket added on overflow always stays alone
        self.x0: list[float] = []
        self.x1: list[float] = []
        self.lo: list[float] = []
        self.hi: list[float] = []
        self.span, self._open, self.count, self.nonfinite = 1, 0, 0, 0
        self.last: float | None = None

    def add(self, x: float, y: Any) -> None:
        value = finite(y)
        if value is None:
            self.nonfinite += y is not None  # a NaN/inf loss is worth counting; a missing value is not
            return
        self.count += 1
        self.last = value
        if not self.x0 or self._open >= self.span:
            self.x0.append(x)
            self.x1.append(x)
            self.lo.append(value)
            self.hi.append(value)
            self._open = 1
            if len(self.x0) > self.capacity:
                self._merge_pairs()
            return
        self.x1[-1] = x
        self.lo[-1] = min(self.lo[-1], value)
        self.hi[-1] = max(self.hi[-1], value)
        self._open += 1

    def _merge_pairs(self) -> None:
        n = len(self.x0) - 1  # even; the newest bucket (one point) stays on its own
        self.x0 = self.x0[0:n:2] + self.x0[n:]
        self.x1 = self.x1[1:n:2] + self.x1[n:]
        self.lo = [min(a, b) for a, b in zip(self.lo[0:n:2], self.lo[1:n:2], strict=True)] + self.lo[n:]
        self.hi = [max(a, b) for a, b in zip(self.hi[0:n:2], self.hi[1:n:2], strict=True)] + self.hi[n:]
        self.span *= 2

    def copy(self) -> Series:
        """A snapshot for a reader on another thread (the writer keeps appending to and merging this one)."""
        other = Series(self.capacity)
        for name in Series.__slots__:
            value = getattr(self, name)
            setattr(other, name, list(value) if isinstance(value, list) else value)
        return other

    def downsample(self, columns: int) -> tuple[list[tuple[float, float] | None], tuple[float, float, float, float]]:
        """Min/max of the points falling in each of `columns` equal x ranges (None where a column is empty),
        and the (x_min, x_max, y_min, y_max) the columns span. Cost: O(buckets), whatever the point count."""
        if not self.x0 or columns <= 0:
            return [], (0.0, 0.0, 0.0, 0.0)
        x_min, x_max = min(self.x0), max(self.x1)
        width = (x_max - x_min) or 1.0
        cells: list[tuple[float, float] | None] = [None] * columns
        for a, b, lo, hi in zip(self.x0, self.x1, self.lo, self.hi, strict=True):
            col = min(columns - 1, int((a + b - 2 * x_min) / (2 * width) * columns))  # the bucket's middle
            cell = cells[col]
            cells[col] = (lo, hi) if cell is None else (min(cell[0], lo), max(cell[1], hi))
        return cells, (x_min, x_max, min(self.lo), max(self.hi))


@dataclass
class StageInfo:
    name: str
    state: str
    progress: float
    started_t: float
    updated_t: float
    finished_t: float | None = None


@dataclass
class CheckpointInfo:
    step: int
    t: float
    seconds: float  # the write
    bytes: int
    path: str
    stall_s: float | None = None  # what the steps waited for it (None: an event from before asynchronous saves)


@dataclass
class TimelineEntry:
    t: float
    kind: str  # "failure" or "recovery"
    where: str = ""  # "rank 17", "stage prep", "run"
    rank: Any = None
    reason: str = ""
    restart: int | None = None
    resumed_step: int | None = None
    lost_seconds: float | None = None
    nodes: bool = False  # a recovery after a change of nodes (its reason names them)


@dataclass
class ExpertsInfo:
    """The MoE figures of the newest step events that carried them (a field an event leaves out keeps its value)."""

    step: int | None = None
    aux_loss: float | None = None
    aux_series: Series = field(default_factory=Series)
    load: list[list[float]] = field(default_factory=list)  # per MoE layer, each expert's fraction of the tokens
    tier: dict[str, Any] = field(default_factory=dict)  # expert_tier as sent: cumulative counters

    def imbalance(self) -> list[float | None]:
        """max / mean load per layer: 1.0 is perfect balance, E means one expert took every token."""
        out: list[float | None] = []
        for loads in self.load:
            mean = sum(loads) / len(loads) if loads else 0.0
            out.append(max(loads) / mean if mean > 0 else None)
        return out

    @property
    def hit_rate(self) -> float | None:
        """Uses that found the expert on the device / all uses (hits + fetches to the device)."""
        hits, fetches = finite(self.tier.get("hits")), finite(self.tier.get("fetches"))
        if hits is None or fetches is None or hits + fetches <= 0:
            return None
        return hits / (hits + fetches)


MOE_STEP_KEYS = ("moe_aux_loss", "expert_load", "expert_tier")


@dataclass
class RunState:
    """Everything the dashboard shows, as of the newest event read."""

    first_t: float | None = None
    last_t: float | None = None
    events: int = 0
    bad_events: int = 0
    run_name: str | None = None
    run_state: str | None = None  # None until a "run" event: the run has not said anything yet
    # throughput, from the newest step event and a short window of them
    step: int | None = None
    total_steps: int | None = None
    loss: float | None = None
    lr: float | None = None
    grad_norm: float | None = None
    loss_scale: float | None = None  # fp16 runs only
    skipped_steps: int | None = None  # fp16: overflow steps so far
    tokens_per_s: float | None = None
    samples_per_s: float | None = None
    tflops_per_gpu: float | None = None
    mfu: float | None = None
    step_time_s: float | None = None  # the trainer's own figure for a step, when it sends one
    wall_s_per_step: float | None = None  # wall time between step events / steps: evals and saves included
    consumed_samples: int | None = None
    loss_series: Series = field(default_factory=Series)
    lr_series: Series = field(default_factory=Series)
    grad_norm_series: Series = field(default_factory=Series)
    tokens_series: Series = field(default_factory=Series)
    _steps: deque[tuple[float, int, float | None]] = field(default_factory=lambda: deque(maxlen=STEP_WINDOW))
    stages: dict[str, StageInfo] = field(default_factory=dict)
    _gpu_raw: dict[str, tuple[float, Any]] = field(default_factory=dict)  # node -> (t, devices as sent)
    _nodes: dict[str, NodeGpus] = field(default_factory=dict)  # parsed from _gpu_raw on demand
    checkpoints: deque[CheckpointInfo] = field(default_factory=lambda: deque(maxlen=50))
    checkpoint_count: int = 0
    checkpoint_every_steps: int | None = None
    timeline: deque[TimelineEntry] = field(default_factory=lambda: deque(maxlen=TIMELINE_KEEP))
    failures: int = 0
    restarts: int = 0
    lost_seconds: float = 0.0
    # Elastic launches (--nnodes MIN:MAX, --spares K): the newest start's nodes that train and those standing by.
    training_nodes: list[str] = field(default_factory=list)
    spare_nodes: list[str] | None = None  # None: no `nodes` event, a launch without spares or elasticity
    warnings: deque[tuple[float, str]] = field(default_factory=lambda: deque(maxlen=20))
    energy_by_node: dict[str, dict[str, Any]] = field(default_factory=dict)
    _energy_marks: dict[str, deque[tuple[float, float]]] = field(default_factory=dict)  # node -> (t, kWh)
    eval_results: dict[str, Any] = field(default_factory=dict)  # flattened: "per_source.en.loss" -> 2.31
    eval_report: EvalReport | None = None  # the same evaluation, as tables
    sample_prompt: str | None = None
    sample_text: str | None = None
    plan: dict[str, Any] = field(default_factory=dict)
    budget: dict[str, Any] | None = None  # the newest budget warning's object (appliance/train/budget_watch.py)
    kernels: dict[str, Any] | None = None  # the newest `kernels` event: what the fused ops run, and measured ms
    startup: dict[str, Any] | None = None  # the newest `startup` event: where the launch's start went, by phase
    experts: ExpertsInfo | None = None  # None until a step event carries an MoE field
    # Control requests still waiting for the trainer (the file exists); set by the reader, not by events.
    checkpoint_requested: bool = False
    stop_requested: bool = False
    changed: set[str] = field(default_factory=lambda: set(SECTIONS))

    # ---- folding events -------------------------------------------------------------------------------------
    def apply(self, event: dict[str, Any]) -> None:
        if not isinstance(event, dict):  # a line of valid JSON that is not an object
            self.bad_events += 1
            return
        t = finite(event.get("t"))
        if t is not None:
            self.first_t = t if self.first_t is None else min(self.first_t, t)
            self.last_t = t if self.last_t is None else max(self.last_t, t)
        self.events += 1
        handler = getattr(self, f"_on_{event.get('kind')}", None)
        if handler is not None:
            try:
                handler(event, t if t is not None else (self.last_t or 0.0))
            except (TypeError, ValueError, AttributeError):
                # A malformed event (a hand-edited file, a writer from another version) must not stop the
                # dashboard or the headless log: count it and read on.
                self.bad_events += 1
        self.changed.add("run")

    def _on_run(self, e: dict[str, Any], t: float) -> None:
        self.run_state = str(e.get("state"))
        self.run_name = e.get("name") or self.run_name
        if self.run_state == "failed" and not any(x.where.startswith("stage") for x in self.timeline):
            self._fail(t, "run", str(e.get("reason", "")))  # a failure no stage has reported already

    def _on_step(self, e: dict[str, Any], t: float) -> None:
        step = finite(e.get("step"))
        if step is None:
            return
        self.step = int(step)
        self.total_steps = int(e["total_steps"]) if finite(e.get("total_steps")) else self.total_steps
        self.loss, self.lr, self.grad_norm = finite(e.get("loss")), finite(e.get("lr")), finite(e.get("grad_norm"))
        self.tokens_per_s, self.tflops_per_gpu = finite(e.get("tokens_per_s")), finite(e.get("tflops_per_gpu"))
        self.mfu = finite(e.get("mfu"))
        consumed = finite(e.get("consumed_samples"))
        self.consumed_samples = int(consumed) if consumed is not None else self.consumed_samples
        self.loss_scale = finite(e.get("loss_scale"))
        skipped = finite(e.get("skipped_steps"))
        self.skipped_steps = int(skipped) if skipped is not None else None
        norm = None if e.get("overflow") is True else e.get("grad_norm")
        for series, value in (
            (self.loss_series, e.get("loss")),
            (self.lr_series, e.get("lr")),
            (self.grad_norm_series, norm),
        ):
            series.add(step, value)
        self.tokens_series.add(step, e.get("tokens_per_s"))
        if self._steps and step < self._steps[-1][1]:
            self._steps.clear()  # a restart rewound the step counter: old rates no longer apply
        self._steps.append((t, int(step), consumed))
        # Step time and samples/s: the trainer's own figures when it sends them, else from the window:
        # (t_new - t_old) / (step_new - step_old), since step events may be logged every N steps.
        first_t, first_step, first_consumed = self._steps[0]
        span_t, span_steps = t - first_t, step - first_step
        if span_steps > 0 and span_t > 0:
            self.wall_s_per_step = span_t / span_steps
        self.step_time_s = finite(e.get("step_time_s")) or self.wall_s_per_step
        window_rate = None
        if consumed is not None and first_consumed is not None and span_t > 0:
            window_rate = (consumed - first_consumed) / span_t
        self.samples_per_s = finite(e.get("samples_per_s")) or window_rate or self.samples_per_s
        self.changed.update(("throughput", "curves", "stages", "checkpoints", "energy"))
        if any(key in e for key in MOE_STEP_KEYS):
            self._on_moe_step(e, int(step))

    def _on_moe_step(self, e: dict[str, Any], step: int) -> None:
        experts = self.experts = self.experts or ExpertsInfo()
        experts.step = step
        if "moe_aux_loss" in e:
            experts.aux_loss = finite(e["moe_aux_loss"])
            experts.aux_series.add(step, e["moe_aux_loss"])
        load = e.get("expert_load")
        if isinstance(load, list):
            experts.load = [[finite(x) or 0.0 for x in layer] for layer in load if isinstance(layer, list)]
        if isinstance(e.get("expert_tier"), dict):
            experts.tier = dict(e["expert_tier"])
        self.changed.add("experts")

    def _on_stage(self, e: dict[str, Any], t: float) -> None:
        name, state = str(e.get("name")), str(e.get("state"))
        progress = min(1.0, max(0.0, finite(e.get("progress")) or 0.0))
        info = self.stages.get(name)
        if info is None or (state == "started" and info.state in ("done", "failed", "skipped", "stopped")):
            info = self.stages[name] = StageInfo(name, state, progress, t, t)
        info.state, info.progress, info.updated_t = state, progress, t
        if state in ("done", "skipped"):
            info.progress = 1.0
        info.finished_t = t if state in ("done", "skipped", "failed", "stopped") else None
        if state == "failed":
            self._fail(t, f"stage {name}", str(e.get("error") or e.get("reason") or ""))
        self.changed.add("stages")

    def _on_checkpoint(self, e: dict[str, Any], t: float) -> None:
        step = finite(e.get("step"))
        self.checkpoints.append(
            CheckpointInfo(
                step=int(step or 0),
                t=t,
                seconds=finite(e.get("seconds")) or 0.0,
                bytes=int(finite(e.get("bytes")) or 0),
                path=str(e.get("path", "")),
                stall_s=finite(e.get("stall_s")),
            )
        )
        self.checkpoint_count += 1
        every = finite(e.get("every_steps"))
        self.checkpoint_every_steps = int(every) if every else self.checkpoint_every_steps
        self.changed.add("checkpoints")

    def _on_gpu(self, e: dict[str, Any], t: float) -> None:
        # Kept raw: most gpu events are superseded by the node's next one before anyone looks (replaying a long
        # run), so the devices are parsed only when `nodes` is read.
        node = str(e.get("node") or "local")
        self._gpu_raw[node] = (t, e.get("devices"))
        self._nodes.pop(node, None)
        self.changed.add("gpus")

    @property
    def nodes(self) -> dict[str, NodeGpus]:
        """The latest gpu event of each node, by node name."""
        for node, (t, raw) in self._gpu_raw.items():
            if node not in self._nodes:
                self._nodes[node] = NodeGpus(node, t, parse_devices(raw))
        return self._nodes

    def _on_energy(self, e: dict[str, Any], t: float) -> None:
        node = str(e.get("node") or "local")
        self.energy_by_node[node] = e
        kwh = finite(e.get("kwh"))
        marks = self._energy_marks.setdefault(node, deque(maxlen=32))
        if kwh is not None and (not marks or t - marks[-1][0] >= 60.0):
            marks.append((t, kwh))  # one mark a minute per node: the projection's rate over the last ~30 min
        self.changed.add("energy")

    def _on_failure(self, e: dict[str, Any], t: float) -> None:
        self._fail(t, f"rank {e.get('rank')}", str(e.get("reason", "")), rank=e.get("rank"))

    def _fail(self, t: float, where: str, reason: str, rank: Any = None) -> None:
        self.failures += 1
        self.timeline.append(TimelineEntry(t, "failure", where=where, rank=rank, reason=reason))
        self.changed.add("timeline")

    def _on_nodes(self, e: dict[str, Any], t: float) -> None:
        self.training_nodes = [str(n) for n in e.get("nodes", [])]
        self.spare_nodes = [str(n) for n in e.get("spares", [])]
        self.changed.add("timeline")

    def _on_recovery(self, e: dict[str, Any], t: float) -> None:
        self.restarts += 1
        lost = finite(e.get("lost_seconds")) or 0.0
        self.lost_seconds += lost
        restart, resumed = finite(e.get("restart")), finite(e.get("resumed_step"))
        self.timeline.append(
            TimelineEntry(
                t,
                "recovery",
                restart=int(restart) if restart is not None else None,
                resumed_step=int(resumed) if resumed is not None else None,
                lost_seconds=lost,
                reason=str(e.get("reason", "")),
                nodes=bool(e.get("lost_nodes") or e.get("joined_nodes")),
            )
        )
        self._steps.clear()  # the time spent down is not step time
        self.changed.add("timeline")

    def _on_warning(self, e: dict[str, Any], t: float) -> None:
        self.warnings.append((t, str(e.get("message", ""))))
        self.changed.add("timeline")
        if isinstance(e.get("budget"), dict):
            self.budget = dict(e["budget"])
            self.changed.add("throughput")

    def _on_kernels(self, e: dict[str, Any], t: float) -> None:
        self.kernels = {k: v for k, v in e.items() if k not in ("t", "kind")}
        self.changed.add("throughput")

    def _on_startup(self, e: dict[str, Any], t: float) -> None:
        phases = {str(k): float(v) for k, v in dict(e["phases"]).items()}
        self.startup = {k: v for k, v in e.items() if k not in ("t", "kind")} | {"phases": phases}
        self.changed.add("throughput")

    def _on_eval(self, e: dict[str, Any], t: float) -> None:
        results: dict[str, Any] = {}
        for key, value in e.items():
            if key in EVAL_BOOKKEEPING:
                continue
            if key in ("sample", "generated", "generation", "samples"):
                self._take_sample(value)
            elif key == "prompt" and isinstance(value, str):
                self.sample_prompt = value
            elif isinstance(value, dict):
                results.update(_flatten(value, key))
            elif finite(value) is not None or isinstance(value, str):
                results[key] = value
        if results:  # the newest evaluation replaces the previous one (an event with only a sample keeps it)
            self.eval_results = results
            report = eval_report(e)
            self.eval_report = None if report.empty else report
        self.changed.add("eval")

    def _take_sample(self, value: Any) -> None:
        if isinstance(value, list) and value:
            value = value[0]
        if isinstance(value, dict):
            self.sample_prompt = value.get("prompt", self.sample_prompt)
            value = _first(value, "text", "completion", "output", "generated")
        if isinstance(value, str):
            self.sample_text = value

    def _on_plan(self, e: dict[str, Any], t: float) -> None:
        nested = e.get("plan")
        plan: dict[str, Any] = nested if isinstance(nested, dict) else e
        self.plan.update({k: v for k, v in plan.items() if k not in ("t", "kind")})
        places = [self.plan, *(self.plan.get(k) for k in ("train", "run", "estimate"))]
        for place in (p for p in places if isinstance(p, dict)):
            # plan.json's train and run sections call the total "steps"; at the top level that name is too vague
            steps_keys = ("total_steps", "train_steps", "max_steps") + (("steps",) if place is not self.plan else ())
            total = finite(_first(place, *steps_keys))
            self.total_steps = int(total) if total else self.total_steps
            every = finite(_first(place, "checkpoint_every_steps", "save_interval"))
            self.checkpoint_every_steps = int(every) if every else self.checkpoint_every_steps
        self.changed.update(("plan", "throughput", "energy", "checkpoints"))

    def set_control(self, checkpoint_requested: bool, stop_requested: bool) -> None:
        if (checkpoint_requested, stop_requested) != (self.checkpoint_requested, self.stop_requested):
            self.checkpoint_requested, self.stop_requested = checkpoint_requested, stop_requested
            self.changed.update(("checkpoints", "run"))

    def take_changed(self) -> set[str]:
        changed, self.changed = self.changed, set()
        return changed

    # ---- derived figures ------------------------------------------------------------------------------------
    @property
    def started(self) -> bool:
        """An event from the run itself (with a time) arrived; plan.json alone does not start a run."""
        return self.first_t is not None

    @property
    def finished(self) -> bool:
        return self.run_state in TERMINAL_RUN_STATES

    @property
    def elapsed_s(self) -> float:
        return (self.last_t - self.first_t) if self.first_t is not None and self.last_t is not None else 0.0

    @property
    def seconds_per_step(self) -> float | None:
        """What a step costs in wall time, for ETAs: measured between step events (so evaluations and saves
        count), else the trainer's own step time."""
        return self.wall_s_per_step or self.step_time_s

    @property
    def training_eta_s(self) -> float | None:
        """Remaining steps x wall seconds per step; else the training stage's own progress."""
        if self.total_steps and self.step is not None and self.seconds_per_step:
            return max(0, self.total_steps - self.step) * self.seconds_per_step
        stage = next((self.stages[n] for n in TRAINING_STAGES if n in self.stages), None)
        return self._progress_eta(stage) if stage else None

    def stage_eta_s(self, name: str) -> float | None:
        stage = self.stages[name]
        if stage.state not in ("started", "running"):
            return None
        if name in TRAINING_STAGES and self.total_steps and self.seconds_per_step:
            return self.training_eta_s
        return self._progress_eta(stage)

    def stage_progress(self, name: str) -> float:
        stage = self.stages[name]
        if name in TRAINING_STAGES and stage.state in ("started", "running") and self.total_steps and self.step:
            return min(1.0, self.step / self.total_steps)
        return stage.progress

    def _progress_eta(self, stage: StageInfo) -> float | None:
        # elapsed / progress is the time the whole stage takes at the rate so far; the rest of it is still to come
        if stage.state not in ("started", "running") or not 0.0 < stage.progress < 1.0:
            return None
        elapsed = (self.last_t or stage.updated_t) - stage.started_t
        return elapsed * (1.0 - stage.progress) / stage.progress if elapsed > 0 else None

    @property
    def last_checkpoint(self) -> CheckpointInfo | None:
        return self.checkpoints[-1] if self.checkpoints else None

    @property
    def checkpoint_interval(self) -> tuple[int | None, float | None]:
        """(steps, seconds) between saves: the configured step interval if known, else the last observed one."""
        steps, seconds = self.checkpoint_every_steps, None
        if len(self.checkpoints) >= 2:
            a, b = self.checkpoints[-2], self.checkpoints[-1]
            steps = steps or (b.step - a.step if b.step > a.step else None)
            seconds = b.t - a.t
        if steps and self.seconds_per_step:
            seconds = steps * self.seconds_per_step
        return steps, seconds

    @property
    def next_checkpoint(self) -> tuple[int | None, float | None]:
        """(step, seconds from now) of the next periodic save."""
        steps, _ = self.checkpoint_interval
        last = self.last_checkpoint
        if not steps:
            return None, None
        due = (last.step if last else 0) + steps
        if self.step is not None and due <= self.step:
            due = (self.step // steps + 1) * steps
        eta = (due - self.step) * self.seconds_per_step if self.step is not None and self.seconds_per_step else None
        return due, eta

    @property
    def gpu_count(self) -> int:
        return sum(len(n.devices) for n in self.nodes.values())

    @property
    def has_gpus(self) -> bool | None:
        """Whether the run trains on GPUs: True once a gpu event lists a device; False when the plan says CPU
        ranks (device.kind "cpu", or hardware with 0 GPUs per node) or every node reported an empty device list;
        None while nothing says either way."""
        if any(raw for _, raw in self._gpu_raw.values()):
            return True
        device, hardware = self.plan.get("device"), self.plan.get("hardware")
        if isinstance(device, dict) and device.get("kind") in ("cpu", "gpu"):
            return device["kind"] == "gpu"
        if isinstance(hardware, dict) and finite(hardware.get("gpus_per_node")) is not None:
            return bool(hardware["gpus_per_node"])
        return False if self._gpu_raw else None

    @property
    def energy_kwh(self) -> float | None:
        values = [v for e in self.energy_by_node.values() if (v := finite(e.get("kwh"))) is not None]
        return sum(values) if values else None

    def energy_sum(self, key: str) -> float | None:
        values = [v for e in self.energy_by_node.values() if (v := finite(e.get(key))) is not None]
        return sum(values) if values else None

    def energy_field(self, key: str) -> Any:
        """A setting every node reports the same way (pue, grid intensity, source): the newest node's."""
        return next((e[key] for e in reversed(self.energy_by_node.values()) if e.get(key) is not None), None)

    def energy_sources(self, key: str) -> list[str]:
        """The distinct values of `key` (source, gpu_source, cpu_source) over the nodes' newest events, sorted:
        one value when every node measures the same way, several when some cannot (a node without RAPL)."""
        return sorted({str(e[key]) for e in self.energy_by_node.values() if e.get(key) is not None})

    @property
    def projected_kwh(self) -> float | None:
        """kWh so far + the recent draw x training ETA. The draw is summed over nodes, each measured from its
        oldest mark (~30 min back) to its newest event: nodes report seconds apart, so a total taken at any one
        event would miss the nodes that had not reported yet."""
        total, eta = self.energy_kwh, self.training_eta_s
        if total is None:
            return None
        if self.finished or (self.total_steps and self.step is not None and self.step >= self.total_steps):
            return total
        if eta is None:
            return None
        kwh_per_s, measured = 0.0, False
        for node, marks in self._energy_marks.items():
            newest = self.energy_by_node[node]
            t1, kwh1 = finite(newest.get("t")), finite(newest.get("kwh"))
            if marks and t1 is not None and kwh1 is not None and t1 > marks[0][0]:
                kwh_per_s += (kwh1 - marks[0][1]) / (t1 - marks[0][0])
                measured = True
        return total + kwh_per_s * eta if measured else None

    @property
    def plan_estimate(self) -> dict[str, Any]:
        estimate = self.plan.get("estimate")
        return estimate if isinstance(estimate, dict) else {}

    @property
    def plan_energy(self) -> tuple[float | None, float | None]:
        """The plan's pre-run (kWh, kg CO2eq) for the whole run: from its run section, else its estimate."""
        for name in ("run", "estimate"):
            section = self.plan.get(name)
            if isinstance(section, dict) and _first(section, "energy_kwh", "kwh", "co2_kg") is not None:
                return finite(_first(section, "energy_kwh", "kwh")), finite(section.get("co2_kg"))
        return None, None


def _flatten(mapping: dict[str, Any], prefix: str) -> list[tuple[str, Any]]:
    out: list[tuple[str, Any]] = []
    for key, value in mapping.items():
        name = f"{prefix}.{key}"
        if isinstance(value, dict):
            out.extend(_flatten(value, name))
        elif finite(value) is not None:
            out.append((name, value))
    return out


def reduce(state: RunState, event: dict[str, Any]) -> None:
    """Fold one event into the state (the reducer both the dashboard and the headless printer use)."""
    state.apply(event)
