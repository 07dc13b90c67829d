"""The model ladder: with no --model, the largest BLOOM shape that trains its token budget within the time budget
on this hardware, and the reason for each size passed over.

Budget: BLOOM's own recipe (each shape's [train] tokens: 341B, 366B for 176B) within 120 days, about the wall time
of BLOOM-176B's training (March 11 to early July 2022). When no size finishes in time, the smallest that fits is
taken and the plan says so. A machine without GPUs gets the CPU smoke model.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from appliance.hardware.profile import Hardware
from appliance.planner.model_shape import ModelShape, load_model_shape
from appliance.planner.recipe import default_global_batch_size, train_samples_for
from appliance.planner.search import SearchResult, search_layouts

LADDER = ("bloom-176b", "bloom-7b1", "bloom-3b", "bloom-1b7", "bloom-1b1", "bloom-560m")
CPU_MODEL = "bloom-tiny-cpu"
DEFAULT_TIME_BUDGET_DAYS = 120.0


@dataclass
class ModelChoice:
    model: ModelShape
    lines: list[str] = field(default_factory=list)  # one line per size considered, then the verdict
    search: SearchResult | None = None  # the chosen model's search, reused by make_plan
    global_batch_size: int = 0


def _days(model: ModelShape, result: SearchResult, train_tokens: int | None) -> float:
    assert result.best is not None
    layout = result.best.layout
    samples = train_samples_for(model, train_tokens)
    return samples / layout.global_batch_size * result.best.time.total_s / 86400


def _tokens(model: ModelShape, train_tokens: int | None) -> str:
    tokens = train_samples_for(model, train_tokens) * model.seq_len
    return f"{tokens / 1e9:.0f}B tokens" if tokens >= 1e9 else f"{tokens / 1e6:.1f}M tokens"


def choose_model(
    hardware: Hardware,
    *,
    global_batch_size: int | None = None,
    seq_len: int | None = None,
    train_tokens: int | None = None,
    time_budget_days: float = DEFAULT_TIME_BUDGET_DAYS,
    precision: str | None = None,
) -> ModelChoice:
    """Walk the ladder from the largest shape down; the first that fits and finishes within budget wins."""
    lines: list[str] = []
    if not hardware.has_gpus:
        tiny = load_model_shape(CPU_MODEL).with_seq_len(seq_len)
        smallest = load_model_shape(LADDER[-1]).with_seq_len(seq_len)
        result = search_layouts(hardware, smallest, default_global_batch_size(smallest, hardware), precision)
        if result.best is not None:
            lines.append(
                f"{smallest.name}: {_tokens(smallest, train_tokens)} would take"
                f" {_days(smallest, result, train_tokens) / 365:.0f} years on these CPU ranks"
            )
        lines.append(f"no GPU: the CPU smoke model {tiny.name} ({tiny.parameters() / 1e6:.1f}M parameters)")
        return ModelChoice(tiny, lines, None, global_batch_size or default_global_batch_size(tiny, hardware))

    fitting: list[tuple[ModelShape, SearchResult, int]] = []
    for name in LADDER:
        model = load_model_shape(name).with_seq_len(seq_len)
        gbs = global_batch_size or default_global_batch_size(model, hardware)
        result = search_layouts(hardware, model, gbs, precision)
        if result.best is None:
            least = min((e.memory.total_gb for e in result.evaluated), default=None)
            need = f" (the leanest layout needs {least:.0f} GB per GPU)" if least is not None else ""
            lines.append(f"{name}: does not fit on {hardware.world_gpus} x {hardware.gpu}{need}")
            continue
        days = _days(model, result, train_tokens)
        verdict = "within" if days <= time_budget_days else "over"
        lines.append(
            f"{name}: {_tokens(model, train_tokens)} in {days:.0f} days ({verdict} the"
            f" {time_budget_days:.0f}-day budget)"
        )
        if days <= time_budget_days:
            lines.append(f"chosen: {name}, the largest BLOOM shape that trains within budget here")
            return ModelChoice(model, lines, result, gbs)
        fitting.append((model, result, gbs))
    if fitting:
        model, result, gbs = fitting[-1]
        lines.append(f"chosen: {model.name}, the smallest BLOOM shape; none finishes within the time budget")
        return ModelChoice(model, lines, result, gbs)
    tiny = load_model_shape(CPU_MODEL).with_seq_len(seq_len)
    lines.append(f"chosen: {tiny.name}; no BLOOM shape fits this GPU memory")
    return ModelChoice(tiny, lines, None, global_batch_size or default_global_batch_size(tiny, hardware))
