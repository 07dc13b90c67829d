"""RunState: the events of metrics.jsonl folded into what the dashboard and the headless printer both render, and the
figures derived from it.

Pure: no I/O and no wall clock. Every time-derived figure (rates, ETAs, "elapsed") is measured on the events' own
"t", so a finished run reads the same today as tomorrow, and replaying hours of a 384-GPU run costs only the
JSON parsing (bench/tui_tail.py measures it). Each kind's reducer is the function event_kinds.py names for it in
monitor/reducers.py (which lists the optional keys it reads); the fields are in monitor/state_fields.py.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from appliance.monitor import reducers
from appliance.monitor.event_kinds import EVENT_KINDS
from appliance.monitor.events import finite
from appliance.monitor.gpu import NodeGpus, parse_devices
from appliance.monitor.state_fields import (
    TERMINAL_RUN_STATES,
    TRAINING_STAGES,
    CheckpointInfo,
    RunFields,
    StageInfo,
    first_of,
)

# Each kind's reducer, found from its declaration.
REDUCERS: dict[str, Callable[[RunFields, dict[str, Any], float], None]] = {
    name: getattr(reducers, kind.reducer) for name, kind in EVENT_KINDS.items() if kind.reducer is not None
}


class RunState(RunFields):
    """Everything the dashboard shows, as of the newest event read."""

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
        kind = event.get("kind")
        handler = REDUCERS.get(kind) if isinstance(kind, str) else None
        if handler is not None:
            try:
                handler(self, event, t if t is not None else (self.last_t or 0.0))
            except (TypeError, ValueError, AttributeError):
                # A malformed event (a hand-edited file, a writer from another version) must not stop the
                # dashboard or the headless log: count it and read on.
                self.bad_events += 1
        self.changed.add("run")

    @property
    def nodes(self) -> dict[str, NodeGpus]:
        """The latest gpu event of each node, by node name."""
        for node, (t, raw) in self._gpu_raw.items():
            if node not in self._nodes:
                self._nodes[node] = NodeGpus(node, t, parse_devices(raw))
        return self._nodes

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
            if isinstance(section, dict) and first_of(section, "energy_kwh", "kwh", "co2_kg") is not None:
                return finite(first_of(section, "energy_kwh", "kwh")), finite(section.get("co2_kg"))
        return None, None


def reduce(state: RunState, event: dict[str, Any]) -> None:
    """Fold one event into the state (the reducer both the dashboard and the headless printer use)."""
    state.apply(event)
