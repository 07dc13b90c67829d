"""The restart budget of an elastic launch (`--nnodes MIN:MAX`, `--spares K`) counts failures, not replacements.

torch's agent counts every restart of its worker group against --max-restarts, a spare's takeover as much as a crash,
and each agent counts its own (a spare's fresh agent has spent none, a survivor of four losses four). So the launcher
gives the agents a budget they cannot reach (AGENT_RESTARTS) and the run keeps one count, in control/restarts.json:
node 0's launcher opens it at each launch with the plan's `run.max_restarts`, and rank 0 of every later start of that
launch spends one restart unless the start costs the run nothing it should count:

- the last start stopped cleanly (control/preempted: the agents stopped its ranks for a joining node, and they saved);
- nodes joined and none left (the run grew back);
- the training nodes changed only by spares taking lost nodes' places, at the same layout (a replacement).

Anything else spends one: a rank that crashed, a hang the watchdog killed, a loss no spare covered (a step-down). The
start that finds the budget overspent stops the run through the failed marker (exit 1, resumable), as a spent agent
budget did; the `nodes` and `recovery` events and summary.json say how many restarts are left.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from appliance.atomic import write_atomic
from appliance.rundir import RunDir

# The agents' own --max-restarts under an elastic launch: more than any run restarts, so theirs never ends a run.
AGENT_RESTARTS = 1_000_000
FAILURES_KEPT = 20  # the newest failures the record names (the count covers all of them)


@dataclass
class Budget:
    budget: int  # the plan's run.max_restarts
    spent: int = 0
    starts: int = 0  # starts of this launch so far
    failures: list[dict[str, object]] = field(default_factory=list)  # {t, reason}, newest last

    @property
    def left(self) -> int:
        return max(0, self.budget - self.spent)

    @property
    def overspent(self) -> bool:
        """A failure past the budget: the agents of a plain launch would have given up at this one."""
        return self.spent > self.budget


def record_path(run_dir: RunDir) -> Path:
    return run_dir.control / "restarts.json"


def open_launch(run_dir: RunDir, budget: int) -> None:
    """Node 0's launcher, before its agent starts: this launch's count begins at nothing spent."""
    run_dir.make_control()
    _write(run_dir, Budget(budget))


def read_budget(run_dir: RunDir, budget: int) -> Budget:
    """The launch's record, or a fresh one with `budget` (a launch no node 0 opened, e.g. node 0 ran an older
    version)."""
    try:
        found = json.loads(record_path(run_dir).read_text())
        return Budget(int(found["budget"]), int(found["spent"]), int(found["starts"]), list(found.get("failures", [])))
    except (OSError, ValueError, KeyError, TypeError):
        return Budget(budget)


@dataclass(frozen=True)
class StartFacts:
    """What rank 0 knows of this start against the last one (train/node_record.py)."""

    stopped_cleanly: bool  # the last start left control/preempted
    before_nodes: list[str]  # the last start's training nodes
    nodes: list[str]  # this start's
    replacements: list[str]  # nodes that may take a lost node's place: spares that claimed one, idle survivors
    layout_kept: bool


def costs_a_restart(facts: StartFacts) -> bool:
    """Whether this start (not the launch's first) spends a restart of the budget (module docstring)."""
    before, now = set(facts.before_nodes), set(facts.nodes)
    if facts.stopped_cleanly or (before < now):
        return False
    came = now - before
    replaced = bool(came) and len(now) == len(before) and facts.layout_kept and came <= set(facts.replacements)
    return not replaced


def account_start(run_dir: RunDir, budget: int, facts: StartFacts | None, reason: str) -> tuple[Budget, bool]:
    """Rank 0 at a start: count it, spend a restart when it costs one; returns the record and whether it spent."""
    record = read_budget(run_dir, budget)
    spend = record.starts > 0 and (facts is None or costs_a_restart(facts))
    record.starts += 1
    if spend:
        record.spent += 1
        record.failures = [*record.failures, {"t": round(time.time(), 3), "reason": reason}][-FAILURES_KEPT:]
    _write(run_dir, record)
    return record, spend


def _write(run_dir: RunDir, record: Budget) -> None:
    write_atomic(record_path(run_dir), (json.dumps(asdict(record)) + "\n").encode())
