"""How long a collective waits for a peer before its process group gives up: sized from the plan, not torch's defaults
(10 minutes for NCCL, 30 for gloo, DeepSpeed's 30).

A live rank waits in a collective while a peer does the longest stretch of work between two of them: at most a step
(a pipeline stage waits out the others' micro-batches) or a blocking save (ranks that wrote wait for the slowest
writer); an evaluation's ranks meet at every micro-batch, as a step's do. So

    timeout = max(COLLECTIVE_FLOOR_S, COLLECTIVE_MARGIN x max(step, save), hang watchdog + 2 beats)

from the plan's estimates (`step_time_s`, `run.checkpoint_s`): BLOOM-176B's 74.7 s step gives 224 s.
The floor covers what the estimates leave out: a start (the engine, the kernel measurements, the checkpoint load)
and a first step's compile. The last term lets the hang watchdog (train/watchdog.py, `hang_timeout_s`, 300 s unless
set) name a hung rank before its peers' collectives time out on it: BLOOM's plan then waits 310 s, and 234 s with
`--set hang_timeout_s=220`. A silent node is found sooner, in seconds, by the cross-node heartbeat
(train/peer_watch.py); this timeout ends the waits no heartbeat sees: a deadlock among live ranks, a network that
drops the collectives' traffic but not the run directory's.
"""

from __future__ import annotations

from datetime import timedelta

from appliance.planner.runspec import RunSpec

COLLECTIVE_MARGIN = 3.0
COLLECTIVE_FLOOR_S = 120.0


def collective_timeout_s(spec: RunSpec) -> float:
    longest = max(float(spec.report.estimate.get("step_time_s", 0.0)), spec.run.checkpoint_s)
    watchdog = spec.train.hang_timeout_s + 2 * spec.train.heartbeat_interval_s
    return max(COLLECTIVE_FLOOR_S, COLLECTIVE_MARGIN * longest, watchdog)


def use_for_new_groups(timeout: timedelta) -> None:
    """Every process group created from now on without a timeout of its own gets `timeout`: ours (train/control.py,
    parallel/topology.py) and DeepSpeed's (ZeRO, the pipeline's). torch reads its default from these two module
    globals at each new_group and offers no public setter; the world's own group takes the timeout where it is made
    (parallel/step/deepspeed_comm.py)."""
    from torch.distributed import distributed_c10d

    distributed_c10d.default_pg_timeout = timeout
    distributed_c10d.default_pg_nccl_timeout = timeout
