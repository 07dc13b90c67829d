"""What metrics.snapshot costs the follower that saves it and the reader that loads it, for the biggest state a
48-node run holds: every RunState field at its bound.

The state folds what a week of BLOOM-176B on 48 nodes x 8 GPUs leaves behind (the same events as
bench/tui_tail.py): each node's newest gpu event (8 devices) and 32 minute marks of its energy counter, 8,190 steps
(every curve at its 1,024 min/max buckets, MoE curves and a 24 x 64 expert load included), 50 checkpoints, 200
failures and recoveries on the timeline, 20 warnings, an evaluation with 46 languages and 30 tasks, the plan, and
the kernels and startup events. Then save_snapshot and load_snapshot (the file write with its fsync, and the full
read back with every check) are timed in wall and CPU seconds, each the best of `--repeat` (on a shared machine
the slower runs measure the neighbours), and the file's size printed.

    .venv/bin/python bench/snapshot_save.py [--repeat 7]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path[0] = str(REPO)  # not bench/, whose tokenize.py would stand in for the standard library's

from appliance.monitor.snapshot import load_snapshot, save_snapshot  # noqa: E402
from appliance.monitor.state import RunState, reduce  # noqa: E402
from bench.tui_tail import NODES, STEP_S, node_events, step_event  # noqa: E402

WEEK_STEPS = 8190  # a week at 105 s a step, stopped just before the curves' buckets merge: all 1,024 in use
MOE_LAYERS, EXPERTS = 24, 64
MARK_S = 61.0  # apart, so that every energy sample leaves a mark (one a minute) until each node holds 32


def big_state() -> RunState:
    state = RunState()
    t0 = 1.7e9
    reduce(state, {"t": t0, "kind": "plan", "train": {"steps": 95_000, "save_interval": 200}, "model": "bloom"})
    for minute in range(40):
        for node in range(NODES):
            for event in node_events(node, t0 + minute * MARK_S + node * 0.1, minute * MARK_S / 3600):
                reduce(state, event)
    for step in range(1, WEEK_STEPS + 1):
        t = t0 + step * STEP_S
        event: dict[str, Any] = step_event(step, t)
        event |= {"moe_aux_loss": 0.01, "expert_load": [[1 / EXPERTS] * EXPERTS] * MOE_LAYERS}
        reduce(state, event)
        if step % 160 == 0:
            reduce(state, {"t": t, "kind": "checkpoint", "step": step, "path": f"c/{step}", "seconds": 45})
        if step % 40 == 0:
            reduce(state, {"t": t, "kind": "failure", "rank": step % 384, "reason": "NCCL timeout"})
            reduce(state, {"t": t, "kind": "recovery", "restart": step // 40, "resumed_step": step, "lost_seconds": 9})
        if step % 300 == 0:
            reduce(state, {"t": t, "kind": "warning", "message": f"rank {step % 384} is slow"})
    languages = {f"lang{i:02d}": {"loss": 2.0 + i / 100, "ppl": 7.4, "bits_per_byte": 0.9} for i in range(46)}
    tasks = {f"task{i:02d}": {"acc": 0.5, "acc_stderr": 0.01, "acc_norm": 0.52, "n": 1000} for i in range(30)}
    reduce(state, {"t": t, "kind": "eval", "step": WEEK_STEPS, "valid_loss": 2.1, "per_source": languages})
    reduce(state, {"t": t, "kind": "eval", "step": WEEK_STEPS, "final": True, "tasks": tasks, "per_source": languages})
    reduce(state, {"t": t, "kind": "kernels", "source": "measured", "times_ms": {f"op{i}": 1.5 for i in range(12)}})
    reduce(state, {"t": t, "kind": "startup", "phases": {f"phase{i}": 3.0 for i in range(10)}, "total_s": 30.0})
    state.take_changed()
    assert state.gpu_count == NODES * 8  # and the dashboard's parsed copy of the gpu events, as its saves hold it
    return state


def best_of(repeat: int, fn: Any) -> tuple[float, float]:
    """The fastest (wall, CPU) seconds of `repeat` calls, each figure on its own."""
    wall, cpu = [], []
    for _ in range(repeat):
        start, start_cpu = time.perf_counter(), time.process_time()
        fn()
        wall.append(time.perf_counter() - start)
        cpu.append(time.process_time() - start_cpu)
    return min(wall), min(cpu)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeat", type=int, default=7, help="timings per figure; the fastest is printed")
    args = parser.parse_args()
    state = big_state()
    with tempfile.TemporaryDirectory() as tmp:
        metrics = Path(tmp) / "metrics.jsonl"
        metrics.write_text('{"t": 1.7e9, "kind": "run", "state": "started"}\n' * 1000)
        offset = metrics.stat().st_size
        save_s = best_of(args.repeat, lambda: save_snapshot(metrics, state, offset))
        load_s = best_of(args.repeat, lambda: load_snapshot(metrics))
        loaded = load_snapshot(metrics)
        size = metrics.with_name("metrics.snapshot").stat().st_size
    assert loaded.state is not None, loaded.reason
    print(
        f"snapshot of the biggest {NODES}-node state: {size / 1e3:.0f} kB; save {1000 * save_s[0]:.1f} ms wall, "
        f"{1000 * save_s[1]:.1f} ms CPU; load {1000 * load_s[0]:.1f} ms wall, {1000 * load_s[1]:.1f} ms CPU "
        f"(each the best of {args.repeat})"
    )


if __name__ == "__main__":
    main()
