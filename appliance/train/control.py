"""Stop and save requests, agreed on by every rank at the same step.

Requests arrive three ways: control files in the run directory (the dashboard's `s` and `x`, or `touch`),
SIGTERM (a scheduler's preemption) and SIGUSR1 (SLURM's --signal=USR1@300 warning). Each rank notes what
it saw; one MAX all-reduce per step makes the decision identical on all ranks, so all stop at the same step.
The flags live on the engine's device: NCCL moves CUDA tensors only, gloo CPU ones.
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


@dataclass
class Requests:
    save: bool = False
    stop: bool = False


class ControlChannel:
    def __init__(self, run_dir: RunDir, *, poll_files: bool, device: torch.device) -> None:
        self.run_dir = run_dir
        self.device = device
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

    def poll(self) -> Requests:
        local = self._local()
        flags = torch.tensor([float(local.save), float(local.stop)], device=self.device)
        if dist.is_available() and dist.is_initialized():
            dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        agreed = flags.tolist()  # one device-to-host copy for both flags
        return Requests(save=bool(agreed[SAVE]), stop=bool(agreed[STOP]))


def _consume(path: Path) -> bool:
    try:
        path.unlink()
        return True
    except FileNotFoundError:
        return False
