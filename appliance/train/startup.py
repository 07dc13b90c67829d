"""Where a launch's time goes before training runs at speed: the `startup` event, from the head's launch of the
elastic agent to the end of the first step, by phase.

The head stamps the launch in the ranks' environment (LAUNCH_TIME_ENV, train/launch.py). Rank 0 marks the end of
each phase of its start (rank/worker.py), and the clock watches rank 0's own events for the rest: the evaluation
at the start step (planned: the first validation loss of the curve) and the first step, whose step event ends the
start. Its phases, in order, add up to `total_s`:

  agent            the launch to this rank's process start: the agent's own start, the rendezvous, the spawn (only
                   on the launch's first attempt: after an agent restart the head's stamp is an attempt old)
  imports          the process start to the rank's modules imported (torch, DeepSpeed, the appliance)
  process_groups   the device, the plan's checks, DeepSpeed's communication backend, the topology's groups,
                   the hang watchdog and the GPU and energy sampler started
  kernel_choice    which implementation runs each fused op (measured on GPUs, parallel/step/kernel_choice.py), the plan
                   priced again with those times
  engine           the model, its layout, the engine (DeepSpeed or the single-replica one) and its optimizer,
                   regional torch.compile wrapped (it compiles in the first step)
  data             the datasets opened (index maps built or read from their cache), the trainer
  checkpoint_load  the newest valid checkpoint found and loaded (a resume), else only looked for
  first_eval       the evaluation before the first step of a run that starts at step 0
  first_step       the first step, its batch read: torch.compile and Triton's JIT compile here
"""

from __future__ import annotations

import os
import time
from typing import Any

from appliance.monitor.events import EventWriter

# The head's launch of the agent (unix time, train/launch.py), in the environment the agent hands its ranks.
LAUNCH_TIME_ENV = "BLOOM_LAUNCH_TIME"
# The agent's count of its restarts of the worker group, in each rank's environment (torch.distributed.run).
RESTART_ENV = "TORCHELASTIC_RESTART_COUNT"

PHASES = (
    "agent",
    "imports",
    "process_groups",
    "kernel_choice",
    "engine",
    "data",
    "checkpoint_load",
    "first_eval",
    "first_step",
)


def process_start_time() -> float:
    """When this process started (unix time), before the interpreter ran any import: on Linux, its age (the uptime
    less its start in clock ticks since boot, proc(5) field 22; both to 10 ms) taken from now. psutil's create_time
    adds those ticks to the boot time, which Linux gives to the whole second: up to a second off."""
    try:
        with open("/proc/self/stat") as f:
            after_name = f.read().rsplit(")", 1)[1].split()  # the name may hold spaces; fields from the 3rd on
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        age = uptime - int(after_name[22 - 3]) / os.sysconf("SC_CLK_TCK")
        return time.time() - age
    except (OSError, ValueError, IndexError):
        import psutil

        return float(psutil.Process().create_time())


def launch_time(env: dict[str, str] | None = None) -> float | None:
    """The head's launch stamp, on the agent's first attempt only; None when absent, unreadable, or stale."""
    env = dict(os.environ) if env is None else env
    if env.get(RESTART_ENV, "0") != "0":
        return None
    try:
        return float(env[LAUNCH_TIME_ENV])
    except (KeyError, ValueError):
        return None


class StartupClock:
    """Phase ends marked as the rank starts; the first step's event closes the account and emits `startup`.

    It is an event sink of rank 0's writer: the evaluation and step events the trainer emits tell it when the first
    evaluation and the first step ended, without a hook in the training loop."""

    def __init__(
        self,
        *,
        launched: float | None = None,
        process_started: float | None = None,
        restart: int = 0,
    ) -> None:
        self.writer: EventWriter | None = None
        self.started = process_started if process_started is not None else process_start_time()
        # The first phase runs from the launch when its stamp is usable, else (an agent restart) from the process.
        self.launched = launched
        self.restart = restart
        self.phases: dict[str, float] = {}
        if launched is not None:
            self.phases["agent"] = max(0.0, self.started - launched)
        self._last = self.started
        self.done = False

    @classmethod
    def for_rank(cls) -> StartupClock:
        return cls(launched=launch_time(), restart=int(os.environ.get(RESTART_ENV, "0") or 0))

    def report_to(self, writer: EventWriter) -> None:
        """Emit the startup event on `writer` (rank 0's), watching its events for the first evaluation and step."""
        self.writer = writer
        writer.sinks.append(self)

    def mark(self, phase: str, now: float | None = None) -> None:
        """The phase `phase` ended now (it began where the previous one ended)."""
        if phase not in PHASES:
            raise ValueError(f"unknown startup phase {phase!r}; known: {PHASES}")
        now = time.time() if now is None else now
        self.phases[phase] = self.phases.get(phase, 0.0) + max(0.0, now - self._last)
        self._last = max(self._last, now)

    # ---- the sink: rank 0's own events -------------------------------------------------------------------------
    def write(self, event: dict[str, Any]) -> None:
        if self.done:
            return
        kind = event.get("kind")
        try:
            if kind == "eval" and "first_step" not in self.phases:
                self.mark("first_eval", float(event["t"]))
            elif kind == "step":
                self._finish(event)
        except (KeyError, TypeError, ValueError):
            self.done = True  # a malformed event: no account rather than a wrong one, and never an exception

    def close(self) -> None:
        self.done = True

    def _finish(self, step: dict[str, Any]) -> None:
        self.done = True  # before emitting: this sink sees its own event
        self.mark("first_step", float(step["t"]))
        if self.writer is not None:
            self.writer.emit("startup", **self.fields(step))

    def fields(self, step: dict[str, Any]) -> dict[str, Any]:
        """The startup event's keys: `phases` {name: seconds} in PHASES order, `total_s` their sum, and where the
        account begins (`from`: launch or process_start), the agent's restart count, the first step's number and its
        own step time (the trainer's figure; the first_step phase also holds the gap before it)."""
        phases = {name: self.phases[name] for name in PHASES if name in self.phases}
        return {
            "phases": phases,
            "total_s": sum(phases.values()),
            "from": "launch" if self.launched is not None else "process_start",
            "restart": self.restart,
            "step": int(step["step"]),
            "first_step_time_s": step.get("step_time_s"),
        }
