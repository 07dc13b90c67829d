"""The block-level check of a kernel selection: the compiled block with the ops chosen one by one, against the same
block with the torch twins of the ops inductor fuses, timed whole.

Each op is measured alone (kernels/selection.py), where a Triton LayerNorm or bias+GeLU can beat its twin. Inside a
compiled block the twin is not a separate kernel: inductor fuses it with the residual add, the dropout and the casts
around it, while a custom op (bloom::layer_norm) stays a call of its own with its own reads and writes. So where the
per-op winner of a fusible op (`FUSIBLE`) is not the twin (a Triton kernel, or apex's LayerNorm behind it), the
block is timed with each combination of those ops switched to the twin ("reference"), and the fastest combination
is the run's choice. Where every fusible op's winner is the twin already (or torch.compile of it, which a compiled
block traces like the twin) there is nothing to compare and nothing is timed.

The block is the caller's (`BlockStep`: appliance/parallel/step/kernel_choice.py builds the run's BloomBlock and
compiles it as the engine does); this module only installs each combination in the registry, has the caller build
one forward + backward of the block under it, and times it with the selection's timer as op "block". The result is
kept in kernels.json under the block's shapes, with the per-op choices it started from: an entry measured from
other per-op choices is not used.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Mapping
from dataclasses import asdict
from typing import Any

from kernels import registry
from kernels.selection import Selection, Timer, failure_reason
from kernels.selection_cache import BLOCK, SelectionCache, entry_key

# The ops inductor fuses with their neighbours when they run as the torch twin inside a compiled block.
FUSIBLE = ("layer_norm", "bias_gelu")
# The per-op choices that are the twin inside a compiled block: torch.compile of the twin is traced into the block's
# graph like the twin itself.
TWINS = ("reference", "compiled")
PER_OP = "per-op choices"  # the label of the combination that changes nothing
# Builds one forward + backward of the compiled block with the registry's current choices (called once per
# combination, after registry.use of it): the step the timer calls.
BlockStep = Callable[[], Callable[[], object]]


def combinations(choices: Mapping[str, str]) -> dict[str, dict[str, str]]:
    """label -> the choices to time: the per-op ones first, then each non-empty set of the fusible ops whose
    per-op winner is not a twin (`TWINS`) switched to the twin ("layer_norm=reference", ...)."""
    switchable = [op for op in FUSIBLE if choices.get(op, "reference") not in TWINS]
    out = {PER_OP: dict(choices)}
    for n in range(1, len(switchable) + 1):
        for ops in itertools.combinations(switchable, n):
            out[",".join(f"{op}=reference" for op in ops)] = dict(choices) | dict.fromkeys(ops, "reference")
    return out


def check_block(selection: Selection, block_step: BlockStep, timer: Timer, cache: SelectionCache | None) -> None:
    """Time the block under each of `combinations(selection.choices)` (nothing when there is one) and make the
    fastest the selection's choices; `selection.block` records it. From `cache` when it holds the block's entry for
    the same per-op choices; a measured record is added to it. Leaves the registry's defaults installed (the
    selection's apply() installs its choices)."""
    per_op = dict(selection.choices)
    candidates = combinations(per_op)
    if len(candidates) == 1:
        return
    where = entry_key(asdict(selection.key), BLOCK, asdict(selection.key.shapes))
    record = None if cache is None else cache.get(where)
    if record is not None and record["per_op"] == per_op:
        selection.cached.append(BLOCK)
    else:
        selection.install_tiles()  # the block's attention with the tiles the run will launch
        record = _measure(candidates, block_step, timer)
        record["per_op"] = per_op
        if cache is not None and record["chosen"] is not None:
            cache.put(where, record)
        if selection.source == "cache":
            selection.source = "measured"
    selection.block = record
    if record["chosen"] is not None:
        selection.choices = dict(record["choices"])


def _measure(candidates: Mapping[str, dict[str, str]], block_step: BlockStep, timer: Timer) -> dict[str, Any]:
    # One timing per combination: each is a compile of the whole block (tens of seconds on a GPU), and a block's
    # time sums dozens of kernels, so it swings less between timings than one kernel's does.
    times: dict[str, float] = {}
    rejected: dict[str, str] = {}
    try:
        for label, choices in candidates.items():
            registry.use(choices)
            try:
                times[label] = timer(BLOCK, label, block_step())
            except Exception as error:  # a combination that fails to compile or run: the others still compete
                rejected[label] = failure_reason(error)
    finally:
        registry.use({})
    chosen = min(times, key=lambda label: times[label]) if times else None
    return {
        "chosen": chosen, "choices": dict(candidates[chosen]) if chosen else {}, "times_ms": times,
        "rejected": rejected,
    }  # fmt: skip
