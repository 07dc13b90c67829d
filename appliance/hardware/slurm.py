"""What a SLURM batch script asks the scheduler for, written once for both script writers (`sbatch`:
train/slurm.py; `prep --sbatch`: data/prep_slurm.py): the shebang, one `#SBATCH` line per directive with the
optional partition and account last, and the check of a `--time` value."""

from __future__ import annotations

from appliance.errors import BadInput


def check_time_limit(time_limit: str, flag: str) -> None:
    """SLURM's [D-]HH:MM:SS (or MM, MM:SS, D-HH...): up to four numeric parts; `flag` names the setting."""
    parts = time_limit.replace("-", ":").split(":")
    if not all(p.isdigit() for p in parts) or not 1 <= len(parts) <= 4:
        raise BadInput(f"{flag} {time_limit!r}: expected [D-]HH:MM:SS")


def sbatch_header(directives: list[str], *, partition: str | None, account: str | None) -> list[str]:
    """The script's first lines, ending with a blank one."""
    chosen = [f"--partition={partition}"] * bool(partition) + [f"--account={account}"] * bool(account)
    return ["#!/bin/bash", *(f"#SBATCH {d}" for d in [*directives, *chosen]), ""]
