"""Fault injection for recovery drills: make a chosen rank fail in a chosen way at a chosen step.

A run that has never lost a rank has not tested its recovery. Set BLOOM_FAULTS before `train` or `run`:

    BLOOM_FAULTS="kill@step=5:rank=1"               rank 1 SIGKILLs itself at the start of step 5 (mid-step for
                                                    its peers, which are already in the step's collectives)
    BLOOM_FAULTS="hang@step=3:rank=1"               rank 1 SIGSTOPs itself: alive, silent, holding its peers
    BLOOM_FAULTS="nan@step=4"                       the loss of step 4 is NaN on every rank that computes it
    BLOOM_FAULTS="save_crash@step=6:rank=1"         rank 1 SIGKILLs itself inside the save of step 6, after
                                                    writing its files and before the commit
    BLOOM_FAULTS="write_crash@step=6:rank=1"        rank 1 SIGKILLs itself halfway through writing its files of
                                                    step 6 in the background, once step 7 has run meanwhile
    BLOOM_FAULTS="enospc@step=6:rank=1"             rank 1's checkpoint write of step 6 fails with ENOSPC

Several faults are separated by commas. Each fires on the first attempt only (the elastic agent's restart count
TORCHELASTIC_RESTART_COUNT is 0) unless it says `attempt=N`, so the restarted workers run clean and the drill
shows the recovery. `step=A-B` covers a range. Without rank, a fault fires on every rank.
"""

from __future__ import annotations

import errno
import os
import signal
import time
from dataclasses import dataclass

from appliance.errors import BadInput

ENV = "BLOOM_FAULTS"
KINDS = ("kill", "hang", "nan", "save_crash", "enospc", "write_crash")
# write_crash waits at most this long for training to move on past the save's step (a save that blocks the loop, such
# as the last one or a stop's, never lets it): the kill then comes mid-write all the same.
WRITE_CRASH_PATIENCE_S = 60.0


@dataclass(frozen=True)
class Fault:
    kind: str
    first_step: int
    last_step: int
    rank: int | None = None
    attempt: int = 0

    def applies(self, kind: str, step: int, rank: int, attempt: int) -> bool:
        return (
            kind == self.kind
            and self.first_step <= step <= self.last_step
            and (self.rank is None or self.rank == rank)
            and attempt == self.attempt
        )


def parse_faults(text: str) -> list[Fault]:
    """`kind@step=N[:rank=R][:attempt=A]`, comma-separated; a mistake names the variable and the entry."""
    faults = []
    for entry in filter(None, (e.strip() for e in text.split(","))):
        kind, _, rest = entry.partition("@")
        fields: dict[str, str] = {}
        for part in filter(None, rest.split(":")):
            key, eq, value = part.partition("=")
            if not eq:
                raise BadInput(f"{ENV}: {entry!r}: expected key=value, got {part!r}")
            fields[key] = value
        unknown = set(fields) - {"step", "rank", "attempt"}
        if kind not in KINDS or "step" not in fields or unknown:
            raise BadInput(f"{ENV}: {entry!r}: expected one of {KINDS} as kind@step=N[:rank=R][:attempt=A]")
        try:
            first, _, last = fields["step"].partition("-")
            faults.append(
                Fault(
                    kind=kind,
                    first_step=int(first),
                    last_step=int(last or first),
                    rank=int(fields["rank"]) if "rank" in fields else None,
                    attempt=int(fields.get("attempt", "0")),
                )
            )
        except ValueError:
            raise BadInput(f"{ENV}: {entry!r}: step, rank and attempt are whole numbers") from None
    return faults


class FaultInjector:
    """The faults planned for this rank and attempt. Without BLOOM_FAULTS every check is a no-op."""

    def __init__(self, rank: int, faults: list[Fault] | None = None, attempt: int | None = None) -> None:
        self.rank = rank
        self.faults = parse_faults(os.environ.get(ENV, "")) if faults is None else faults
        self.attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) if attempt is None else attempt
        self.started_step = 0  # the newest step the training loop has started (read by the writer thread)

    def due(self, kind: str, step: int) -> bool:
        return any(f.applies(kind, step, self.rank, self.attempt) for f in self.faults)

    def at_step_start(self, step: int) -> None:
        """Kill or stop this process at the start of `step` when planned."""
        self.started_step = step
        if self.due("kill", step):
            os.kill(os.getpid(), signal.SIGKILL)
        if self.due("hang", step):
            os.kill(os.getpid(), signal.SIGSTOP)

    def in_save(self, step: int) -> None:
        """Between writing this rank's checkpoint files and the commit."""
        if self.due("save_crash", step):
            os.kill(os.getpid(), signal.SIGKILL)

    def during_write(self, step: int) -> None:
        """Between two of this rank's checkpoint files, in the writer thread: SIGKILL once the training loop has
        started the second step after the save's, so the step between them ran (on every rank: its collectives
        need this one) while the save was half written."""
        if not self.due("write_crash", step):
            return
        deadline = time.monotonic() + WRITE_CRASH_PATIENCE_S
        while self.started_step < step + 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        os.kill(os.getpid(), signal.SIGKILL)

    def before_write(self, step: int) -> None:
        """Before this rank writes its checkpoint files: a full disk, as the write would see it."""
        if self.due("enospc", step):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), f"rank {self.rank} checkpoint of step {step}")
