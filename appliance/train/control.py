"""Stop and save requests, agreed on by every rank at the same step.

Requests arrive three ways: control files in the run directory (the dashboard's `s` and `x`, or `touch`),
SIGTERM (a scheduler's preemption) and SIGUSR1 (SLURM's --signal=USR1@300 warning). Each rank notes what
it saw; one MAX all-reduce per step makes the decision identical on all ranks, so all stop at the same step.
The flags are host values and travel on the host group (`host_group`: gloo over the world), so agreeing on them never
waits for the device: an all-reduce of CUDA tensors read back on the host would wait for every kernel queued before
it, the whole step.
"""

from __future__ import annotations

import signal
from dataclasses import dataclass
from pathlib import Path
from types import FrameType

import torch
import torch.distributed as dist

from appliance.rundir import RunDir

SAVE, STOP = 0, 1

_host_groups: dict[int, dist.ProcessGroup] = {}


def host_group() -> dist.ProcessGroup | None:
    """The process group for values the host holds (flags, times, counts): the world itself when it runs on gloo,
    else a gloo group over the world, created once per world (collective: every rank calls it, in the same order).
    None without a process group."""
    if not (dist.is_available() and dist.is_initialized()):
        return None
    world = dist.group.WORLD
    assert world is not None
    if dist.get_backend() == "gloo":
        return world
    key = id(world)
    if key not in _host_groups:
        _host_groups[key] = dist.new_group(backend="gloo")
    return _host_groups[key]


@dataclass
class Requests:
    save: bool = False
    stop: bool = False


class ControlChannel:
    def __init__(self, run_dir: RunDir, *, poll_files: bool, group: dist.ProcessGroup | None = None) -> None:
        self.run_dir = run_dir
        self.group = group  # the host group (host_group()); None: this process alone
        self.poll_files = poll_files  # one rank reads the files; the all-reduce tells the others
        self._signalled: str | None = None
        for sig in (signal.SIGTERM, signal.SIGUSR1):
            signal.signal(sig, self._on_signal)

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        self._signalled = signal.Signals(signum).name

    @property
    def signal_name(self) -> str | None:
        return self._signalled

    def _local(self) -> Requests:
        req = Requests(stop=self._signalled is not None)
        if self.poll_files:
            req.save = _consume(self.run_dir.request_checkpoint)
            req.stop = req.stop or _consume(self.run_dir.request_stop)
        return req

    def local_flags(self) -> tuple[float, float]:
        """(save, stop) as this rank saw them, 1.0 or 0.0, for the caller's own all-reduce (MAX)."""
        local = self._local()
        return float(local.save), float(local.stop)

    def poll(self) -> Requests:
        """The requests every rank agrees on (a MAX all-reduce of local_flags on the host group)."""
        flags = torch.tensor(self.local_flags(), dtype=torch.float64, device="cpu")
        if self.group is not None:
            dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self.group)
        agreed = flags.tolist()
        return Requests(save=bool(agreed[SAVE]), stop=bool(agreed[STOP]))


def _consume(path: Path) -> bool:
    try:
        path.unlink()
        return True
    except FileNotFoundError:
        return False
