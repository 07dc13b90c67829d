"""The fields of the reducer state and the small records in them (curves, stages, checkpoints, the timeline, MoE).

Split from monitor/state.py so that the reducers (monitor/reducers.py), which write these fields, and RunState,
which derives figures from them, both import them without importing each other.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any

from appliance.monitor.eval_report import EvalReport
from appliance.monitor.events import finite
from appliance.monitor.gpu import NodeGpus

# Panels refresh only when their section changed; the reducers record which ones an event touched.
SECTIONS = (
    "run", "throughput", "curves", "gpus", "stages", "checkpoints", "timeline", "energy", "eval", "plan", "experts",
    "preflight",
)  # fmt: skip
TERMINAL_RUN_STATES = ("done", "prepared", "failed", "preempted")  # the last `run` event says nothing goes on
TRAINING_STAGES = ("training", "train")
STEP_WINDOW = 100  # step events kept for rates: with BLOOM's ~100 s steps, the last few hours
EVAL_BOOKKEEPING = ("t", "kind", "step", "consumed_samples", "final")  # when, not what was measured
TIMELINE_KEEP = 200  # failures/recoveries kept for display (the counters cover all of them)


def first_of(mapping: dict[str, Any], *keys: str) -> Any:
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
class RunFields:
    """What RunState holds (monitor/state.py): everything the dashboard shows, as of the newest event read. The
    reducers (monitor/reducers.py) write these fields; RunState adds the figures derived from them."""

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
    # The restarts the run may still spend (elastic launches: train/restart_budget.py; others: the agent's), once
    # a `nodes` or `recovery` event said; None before.
    restarts_left: int | None = None
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
    # The newest preflight of the plan (a `preflight` event, or preflight.json as the dashboard reads it): model,
    # hardware, layout and roles as preflight.json has them; None when the run has none
    preflight: dict[str, Any] | None = None
    # Control requests still waiting for the trainer (the file exists); set by the reader, not by events.
    checkpoint_requested: bool = False
    stop_requested: bool = False
    changed: set[str] = field(default_factory=lambda: set(SECTIONS))
