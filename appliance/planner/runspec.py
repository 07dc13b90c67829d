"""The run spec: plan.json as one typed object. The planner writes it; the head process, the launcher, every rank,
relayout, import, sbatch, metrics and export read it, and nothing reads plan.json any other way.

plan.json's sections and their types:
    hardware  Hardware         the machine or cluster planned for (appliance/hardware/profile.py)
    model     ModelShape       the architecture (init_std, layer_norm_epsilon, ...) and its recipe (model_shape.py)
    layout    Layout           tp, pp, dp, micro/global batch, ZeRO stage, recompute, sequence parallel (layout.py)
    train     TrainSettings    optimizer, schedules in samples, intervals, recovery (train_settings.py)
    run       RunSection       time, energy, carbon and cost estimate; restart budget; data-stage workers
    device    PlanDevice       the device kind, dtype and peak the estimate assumed
    init      ImportedWeights  where the first weights come from (`import`); absent for a fresh run
plus the planner's report (estimate, feasible, rejected, ...), kept as written for people and the dashboard.

Reading is strict: an unknown key, a missing one or a value of the wrong type is BadInput naming the file and the
key. The optional keys are the fields with a default in the dataclasses above, except layout's (every layout key is
required), and those defaults are the only ones (docs/PLANNER.md, "plan.json", lists them). Derived figures
(DERIVED) are accepted, not read, and recomputed on every write, so a hand edit of train_samples cannot leave a
stale step count behind. Keys older plans hold are read as LEGACY says.

It lives in planner/ because the planner writes it and everyone downstream reads it: it imports only hardware/ and
planner/ modules, so the data keeps flowing one way. The model's BloomConfig is built from `model` on the model
side (appliance/model/config.py, config_for_shape): its row count is the tokenizer's, known after the tokenizer stage.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from appliance.errors import BadInput
from appliance.hardware.carbon import CarbonProfile
from appliance.hardware.profile import Hardware
from appliance.planner.layout import LATER_LAYOUT_KEYS, Layout, pipeline_partition
from appliance.planner.model_shape import DEFAULT_INIT_STD, ModelShape
from appliance.planner.tp2d import TensorParallelComparison
from appliance.planner.train_settings import TrainSettings
from appliance.planner.typed_json import check_keys, dotted, from_json, required_fields, to_json

DEFAULT_MAX_RESTARTS = 3  # elastic-agent restarts of the worker group after a rank failure
MAX_DATA_WORKERS = 8  # data-stage processes when the plan leaves `workers` unset: min(CPU count, 8)

# Written on every write, ignored on read (recomputed from the fields they derive from).
DERIVED = {
    "model": ("parameters", "padded_vocab"),
    "layout": ("world_size", "micro_batches", "partition_method", "layers_per_stage", "padded_vocab"),
    "train": ("train_tokens", "steps"),
}
# Keys older plans hold, accepted on read and not written again:
#   train.init_std             a copy of model.init_std; it must agree with it (the model section is the source)
#   run.carbon_profile         what `--set carbon_profile/grid_g_per_kwh` asked for; run.carbon holds the result
#   run.grid_g_per_kwh
#   model.init_std = null      "not set": the default DEFAULT_INIT_STD
LEGACY = {"train": ("init_std",), "run": ("carbon_profile", "grid_g_per_kwh")}


@dataclass(frozen=True)
class RunSection:
    """The plan's "run" section: the estimate for `steps` full-batch steps, and how the run is carried out."""

    steps: int
    time_s: float
    time_days: float
    gpu_hours: float
    energy_kwh: float
    co2_kg: float
    cost_usd: float
    watts_per_rank: float
    pue: float
    kg_co2_per_kwh: float
    carbon: CarbonProfile  # the profile the estimate used; the energy meters use the same one
    usd_per_gpu_hour: float
    max_restarts: int = DEFAULT_MAX_RESTARTS
    workers: int | None = None  # data-stage processes; None: min(CPU count, MAX_DATA_WORKERS)
    # Sizing (planner/sizing.py). time_s includes overhead_s: eval_s per evaluation and checkpoint_s per checkpoint.
    overhead_s: float = 0.0
    eval_s: float = 0.0
    checkpoint_s: float = 0.0
    budget_s: float | None = None  # wall time training was given (the user's budget less the data stages); None: none
    corpus_tokens: int | None = None  # the corpus the plan was sized on; None: not yet known (before the data stage)
    # The prepared corpus's bytes the vocabulary was sized on (planner/vocabulary.py); None: not yet (before prep).
    corpus_bytes: int | None = None
    limit: str | None = None  # what bound the plan: compute-optimal, data, time, memory, recipe or user

    def __post_init__(self) -> None:
        if self.max_restarts < 0:
            raise ValueError(f"max_restarts must not be negative, got {self.max_restarts}")
        if self.workers is not None and self.workers < 1:
            raise ValueError(f"workers must be at least 1, got {self.workers}")


@dataclass(frozen=True)
class PlanDevice:
    """What the estimate assumed of each rank's device (appliance/planner/device.py)."""

    kind: str  # "gpu" or "cpu"
    name: str
    dtype: str
    peak_tflops: float  # dense bf16 tensor-core peak on GPUs; fp32 FMA peak on CPU ranks


@dataclass(frozen=True)
class ImportedWeights:
    """`import`: the transformers checkpoint the run starts from, and the hash of its tokenizer. JSON keys: "from"
    (a Python keyword, hence `source` here) and "tokenizer_sha256"."""

    source: str
    tokenizer_sha256: str

    def to_json(self) -> dict[str, str]:
        return {"from": self.source, "tokenizer_sha256": self.tokenizer_sha256}


@dataclass(frozen=True)
class PlanReport:
    """The planner's account of its choice: read by people and the dashboard, never by a rank."""

    estimate: dict[str, float]
    feasible: bool
    reasons: list[str]
    rejected: list[dict[str, Any]]
    rejected_counts: dict[str, int]
    memory_breakdown_gb: dict[str, float]
    memory_stage: int
    in_flight_micro_batches: int
    time_breakdown_s: dict[str, float]
    bottleneck_stage: int
    conventions: dict[str, str]
    mode: str
    candidates: int
    search_seconds: float
    notes: list[str]
    model_choice: list[str]
    sizing: list[str] = dataclasses.field(default_factory=list)  # absent from plans written before sizing
    # The tokenizer's size and why (planner/vocabulary.py); absent from plans written before it
    vocabulary: list[str] = dataclasses.field(default_factory=list)
    # 1D vs Optimus 2D tensor parallelism per block (planner/tp2d.py); None: a CPU plan, or one written before it
    tensor_parallel: TensorParallelComparison | None = None


SECTIONS = ("hardware", "model", "layout", "train", "run", "device", "init")
REPORT_KEYS = tuple(f.name for f in dataclasses.fields(PlanReport))
REQUIRED_REPORT_KEYS = tuple(required_fields(PlanReport))


@dataclass(frozen=True)
class RunSpec:
    hardware: Hardware
    model: ModelShape
    layout: Layout
    train: TrainSettings
    run: RunSection
    device: PlanDevice
    report: PlanReport
    init: ImportedWeights | None = None

    def __post_init__(self) -> None:
        """The facts plan.json states twice must agree (the trainer reads train, the topology reads layout)."""
        lay, train = self.layout, self.train
        problems = [
            f"train.{key}({getattr(train, key)}) != {where}.{key}({value})"
            for key, where, value in (
                ("global_batch_size", "layout", lay.global_batch_size),
                ("micro_batch_size", "layout", lay.micro_batch_size),
                ("seq_len", "model", self.model.seq_len),
            )
            if getattr(train, key) != value
        ]
        if problems:
            raise BadInput("; ".join(problems))
        lay.validate(
            lay.world_size,
            self.model.heads,
            self.model.layers,
            self.model.seq_len,
            moe_num_experts=self.model.moe_num_experts,
            dtype=train.dtype,
            expert_device_budget_mb=train.expert_device_budget_mb,
            expert_host_budget_mb=train.expert_host_budget_mb,
        )

    # ---- reading -------------------------------------------------------------------------------------------
    @classmethod
    def from_json(cls, data: Any, source: str = "plan") -> RunSpec:
        """Parse plan.json's object; BadInput naming `source` (the file) and the key on anything unexpected."""
        data = check_keys(
            data,
            where="",
            source=source,
            known={*SECTIONS, *REPORT_KEYS},
            required=[*SECTIONS[:-1], *REQUIRED_REPORT_KEYS],
        )
        model_json = data["model"]
        if isinstance(model_json, dict) and "init_std" in model_json and model_json["init_std"] is None:
            model_json = {**model_json, "init_std": DEFAULT_INIT_STD}  # LEGACY: null meant "not set"
        model = _section(ModelShape, model_json, "model", source)
        train = _section(TrainSettings, data["train"], "train", source)
        legacy_std = data["train"].get("init_std", model.init_std)
        if legacy_std != model.init_std:
            raise BadInput(
                f"{source}: train.init_std({legacy_std}) disagrees with model.init_std({model.init_std});"
                " model.init_std is the one the model uses: set that one and drop train.init_std"
            )
        sections = {
            "hardware": _section(Hardware, data["hardware"], "hardware", source),
            "layout": _section(Layout, data["layout"], "layout", source),
            "run": _section(RunSection, data["run"], "run", source),
            "device": _section(PlanDevice, data["device"], "device", source),
            "report": from_json(PlanReport, {k: data[k] for k in REPORT_KEYS if k in data}, where="", source=source),
            "init": None if data.get("init") is None else _imported(data["init"], source),
        }
        try:
            return cls(model=model, train=train, **sections)
        except BadInput as e:
            raise BadInput(f"{source}: {e}") from None

    # ---- writing -------------------------------------------------------------------------------------------
    def to_json(self) -> dict[str, Any]:
        """plan.json's object: the public keys of `plan --json` (docs/ARCHITECTURE.md) and the sections above."""
        out: dict[str, Any] = {
            "hardware": to_json(self.hardware),
            "model": self.model.to_dict(),
            "layout": self.layout_section(),
            **to_json(self.report),
            "device": to_json(self.device),
            "train": self.train_section(),
            "run": to_json(self.run),
        }
        if self.init is not None:
            out["init"] = self.init.to_json()
        return out

    def dumps(self) -> bytes:
        """plan.json's bytes, as every writer writes them."""
        return json.dumps(self.to_json(), indent=1).encode()

    def layout_section(self) -> dict[str, Any]:
        """The layout with the figures derived from it (DERIVED["layout"])."""
        lay = self.layout
        partition = pipeline_partition(self.model.layers, lay.pp)
        return {
            **lay.to_dict(),
            "world_size": lay.world_size,
            "micro_batches": lay.micro_batches,
            "partition_method": partition.method,
            "layers_per_stage": list(partition.layers_per_stage),
            "padded_vocab": self.model.padded_vocab(lay.tp),
        }

    def train_section(self) -> dict[str, Any]:
        """The training settings with the figures derived from them (DERIVED["train"]) after train_samples."""
        out: dict[str, Any] = {}
        for key, value in to_json(self.train).items():
            out[key] = value
            if key == "train_samples":
                out["train_tokens"] = self.train.train_samples * self.train.seq_len
                out["steps"] = self.train.steps_at_full_batch
        return out

    # ---- what readers ask ----------------------------------------------------------------------------------
    def data_workers(self, cpu_count: int | None) -> int:
        return self.run.workers or min(cpu_count or 1, MAX_DATA_WORKERS)

    def with_layout(self, layout: Layout, estimate: dict[str, float]) -> RunSpec:
        """The same run at another layout (same global batch; the micro-batch follows the layout's)."""
        return replace(
            self,
            layout=layout,
            train=replace(self.train, micro_batch_size=layout.micro_batch_size),
            report=replace(self.report, estimate=dict(estimate)),
        )


def _section(cls: type[Any], data: Any, where: str, source: str) -> Any:
    accepted = (*DERIVED.get(where, ()), *LEGACY.get(where, ()))
    # Layout's defaults (zero 1, full recompute, no SP: BLOOM-176B's) complete a `--layout` string; a plan states
    # every key, since a default filled in here would silently decide how the ranks run.
    # Only the context-parallel keys, which plans written before them lack, default (to cp = 1).
    required = [f.name for f in dataclasses.fields(cls) if f.name not in LATER_LAYOUT_KEYS] if cls is Layout else None
    return from_json(cls, data, where=where, source=source, accepted=accepted, required=required)


def _imported(data: Any, source: str) -> ImportedWeights:
    keys = ("from", "tokenizer_sha256")
    data = check_keys(data, where="init", source=source, known=keys, required=keys)
    for key in keys:
        if not isinstance(data[key], str):
            raise BadInput(f"{source}: key {dotted('init', key)!r} must be a string, got {data[key]!r}")
    return ImportedWeights(source=data["from"], tokenizer_sha256=data["tokenizer_sha256"])


def load_spec(path: Path) -> RunSpec:
    """plan.json at `path` as a RunSpec; BadInput naming the file when it is missing, not JSON, or not a plan."""
    try:
        text = Path(path).read_text()
    except FileNotFoundError:
        raise BadInput(f"{path}: no such plan (not a run directory?)") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise BadInput(f"{path}: not valid JSON: {e}") from None
    return RunSpec.from_json(data, str(path))
