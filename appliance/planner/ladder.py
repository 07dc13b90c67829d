"""The model ladder: with no --model, the largest BLOOM shape that the data and the time can train compute-optimally
on this hardware (planner/sizing.py), and the reason for each size passed over.

From bloom-176b down, each at its published batch: a size is passed over when no layout fits its memory, or when
its target tokens (20 per parameter, or the user's train_tokens) do not fit the time budget or 4 epochs of the
corpus. When none qualifies, the smallest that fits memory is taken and trains what the data and time allow. A
machine without GPUs gets the CPU smoke model.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from appliance.hardware.profile import Hardware
from appliance.planner.model_shape import ModelShape, load_model_shape
from appliance.planner.recipe import default_global_batch_size
from appliance.planner.search import SearchResult, search_layouts
from appliance.planner.sizing import (
    DEFAULT_TIME_BUDGET_DAYS,
    MEMORY,
    TIME,
    Budget,
    duration_text,
    fits_optimally,
    optimal_tokens,
    overheads,
    tokens_text,
)
from appliance.planner.vocabulary import sized_model

LADDER = ("bloom-176b", "bloom-7b1", "bloom-3b", "bloom-1b7", "bloom-1b1", "bloom-560m")
CPU_MODEL = "bloom-tiny-cpu"


@dataclass
class ModelChoice:
    model: ModelShape
    lines: list[str] = field(default_factory=list)  # one line per size considered, then the verdict
    search: SearchResult | None = None  # the chosen model's search, reused by make_plan
    global_batch_size: int = 0
    bound: str | None = None  # why the next larger size was passed over: memory, data, time; None: none was
    vocabulary: str = ""  # the chosen shape's vocabulary and why (planner/vocabulary.py)


def _budget_text(budget: Budget) -> str:
    if budget.seconds is None:
        return f"the {DEFAULT_TIME_BUDGET_DAYS:.0f}-day budget"
    return f"the {duration_text(budget.seconds)} budget"


def choose_model(
    hardware: Hardware,
    *,
    global_batch_size: int | None = None,
    seq_len: int | None = None,
    budget: Budget | None = None,
    precision: str | None = None,
    vocab_size: int | None = None,
) -> ModelChoice:
    """Walk the ladder from the largest shape down; the first that fits memory and trains its target tokens within
    the time and the data wins. Each shape has its vocabulary sized to the corpus (planner/vocabulary.py), or
    vocab_size when given."""
    budget = budget or Budget()
    lines: list[str] = []

    vocab_lines: dict[str, str] = {}

    def shape(name: str) -> ModelShape:
        model = load_model_shape(name).with_seq_len(seq_len)
        corpus = {"corpus_bytes": budget.corpus_bytes, "corpus_tokens": budget.corpus_tokens}
        model, vocab_lines[name] = sized_model(model, **corpus, user=vocab_size)
        return model

    if not hardware.has_gpus:
        tiny = shape(CPU_MODEL)
        lines.append(f"no GPU: the CPU smoke model {tiny.name} ({tiny.parameters() / 1e6:.1f}M parameters)")
        gbs = global_batch_size or default_global_batch_size(tiny, hardware)
        return ModelChoice(tiny, lines, None, gbs, MEMORY, vocab_lines[tiny.name])

    fitting: list[tuple[ModelShape, SearchResult, int]] = []
    bound: str | None = None
    for name in LADDER:
        model = shape(name)
        gbs = global_batch_size or default_global_batch_size(model, hardware)
        result = search_layouts(hardware, model, gbs, precision)
        if result.best is None:
            least = min((e.memory.total_gb for e in result.evaluated), default=None)
            need = f" (the leanest layout needs {least:.0f} GiB per GPU)" if least is not None else ""
            lines.append(f"{name}: does not fit on {hardware.world_gpus} x {hardware.gpu}{need}")
            bound = MEMORY
            continue
        best = result.best
        eval_samples = min(model.recipe.eval_samples or gbs, gbs)
        ov = overheads(model, best.layout, hardware, best.time.total_s, eval_samples, budget.languages)
        ok, failed, seconds = fits_optimally(model, best.layout, best.time.total_s, ov, budget)
        target = budget.train_tokens if budget.train_tokens is not None else optimal_tokens(model)
        what = f"{tokens_text(target)} in {duration_text(seconds)}"
        if ok:
            lines.append(f"{name}: {what}, within {_budget_text(budget)}" + _data_text(budget, target))
            lines.append(f"chosen: {name}, the largest BLOOM shape that trains its tokens within the limits here")
            return ModelChoice(model, lines, result, gbs, bound, vocab_lines[name])
        if failed == TIME:
            lines.append(f"{name}: {what}, over {_budget_text(budget)}")
        else:
            assert budget.corpus_tokens is not None
            lines.append(
                f"{name}: {what}, but the corpus gives at most {tokens_text(budget.data_cap_tokens or 0)}"
                f" (4 epochs of {tokens_text(budget.corpus_tokens)})"
            )
        bound = failed
        fitting.append((model, result, gbs))
    if fitting:
        model, result, gbs = fitting[-1]
        lines.append(f"chosen: {model.name}, the smallest BLOOM shape; it trains what the data and time allow")
        return ModelChoice(model, lines, result, gbs, bound, vocab_lines[model.name])
    tiny = shape(CPU_MODEL)
    lines.append(f"chosen: {tiny.name}; no BLOOM shape fits this GPU memory")
    gbs = global_batch_size or default_global_batch_size(tiny, hardware)
    return ModelChoice(tiny, lines, None, gbs, MEMORY, vocab_lines[tiny.name])


def _data_text(budget: Budget, target: int) -> str:
    if budget.corpus_tokens is None:
        return " (corpus size not known yet)"
    return f" and {target / budget.corpus_tokens:.2g} epochs of the corpus"
