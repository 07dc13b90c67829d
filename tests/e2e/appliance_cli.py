"""Running the appliance as a user does: its entry point in a subprocess, in a working directory of the test's."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
ENTRY = ROOT / "bloom_appliance.py"


def appliance_command(*args: str, python_flags: tuple[str, ...] = ()) -> list[str]:
    return [sys.executable, *python_flags, str(ENTRY), *args]


def run_appliance(
    *args: str, cwd: Path, timeout: float = 600, python_flags: tuple[str, ...] = ()
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        appliance_command(*args, python_flags=python_flags), cwd=cwd, capture_output=True, text=True, timeout=timeout
    )
