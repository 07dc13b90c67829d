"""`train --run-dir D --layout tp=..,pp=..,dp=..[,cp=..]`: continue a run at another parallel layout.

Checkpoints are layout-independent (model shards and per-parameter optimizer state under Hugging Face names, re-cut
for whatever ranks load them), so changing the layout is only a change of plan: the layout is checked against the
model and the batch as the planner checks any layout, the plan's estimate is redone for it, and the next launch
loads the newest checkpoint directly at the new layout. BLOOM-176B needed a 47-minute offline conversion for this.

What must not change: the global batch (the schedules are counted in samples and stay as they are) and the
embedding's row count (the tokenizer was padded to 128 x tp for the original tp; a new tp must give the same
padding, which any divisor of the original tp does).
"""

from __future__ import annotations

from typing import Any

from appliance.atomic import write_atomic
from appliance.errors import BadInput
from appliance.hardware.profile import OPTIONAL_KEYS, PROFILE_KEYS, Hardware, hardware_from_table
from appliance.planner import make_plan, parse_layout
from appliance.planner.runspec import load_spec
from appliance.rundir import RunDir


def _hardware_for(planned: Hardware, world: int, source: str) -> Hardware:
    """The plan's hardware, resized to the nodes the new layout fills (continuing on fewer or more nodes of the
    same kind); on CPU, ranks are processes and the hardware stays as it is."""
    table = {k: getattr(planned, k) for k in (*PROFILE_KEYS, *OPTIONAL_KEYS) if getattr(planned, k) is not None}
    hardware = hardware_from_table(table, source)
    if not hardware.has_gpus:
        return hardware
    if world % hardware.gpus_per_node:
        raise BadInput(f"--layout: {world} ranks do not fill whole nodes of {hardware.gpus_per_node} GPUs")
    table["nodes"] = world // hardware.gpus_per_node
    return hardware_from_table(table, source)


def change_layout(run_dir: RunDir, text: str) -> dict[str, Any]:
    """Rewrite the run's plan for the layout `text` (the planner's syntax; gbs defaults to the run's own, mbs too).
    Returns {"from": old layout, "to": new layout}; BadInput when the layout cannot carry on this run."""
    source = str(run_dir.plan)
    spec = load_spec(run_dir.plan)
    old = spec.layout_section()
    gbs = spec.train.global_batch_size
    layout = parse_layout(text if "gbs=" in text else f"{text},gbs={gbs}")
    if layout.global_batch_size != gbs:
        raise BadInput(f"--layout {text}: gbs={layout.global_batch_size}, but this run's global batch is {gbs}")
    if "mbs=" not in text:
        layout = parse_layout(f"{text},gbs={gbs},mbs={spec.layout.micro_batch_size}")
    new = make_plan(_hardware_for(spec.hardware, layout.world_size, source), spec.model, layout=layout).spec()
    if not new.report.feasible:
        raise BadInput(f"--layout {text}: cannot run: {'; '.join(new.report.reasons or ['infeasible'])}")
    from appliance.tokenizer.vocab import padded_vocab_size, tokenizer_vocab_size

    entries = tokenizer_vocab_size(run_dir.tokenizer_json)
    rows = {"from": padded_vocab_size(entries, spec.layout.tp), "to": padded_vocab_size(entries, new.layout.tp)}
    if rows["from"] != rows["to"]:
        raise BadInput(
            f"--layout {text}: tp={new.layout.tp} pads the vocabulary to {rows['to']} rows, but this run's "
            f"embedding has {rows['from']} (padded for tp={spec.layout.tp}); pick a tp that divides {spec.layout.tp}"
        )
    moved = spec.with_layout(new.layout, new.report.estimate)
    write_atomic(run_dir.plan, moved.dumps())
    return {"from": old, "to": moved.layout_section()}
