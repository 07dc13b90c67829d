"""Running the appliance as a user does: its entry point in a subprocess, in a working directory of the test's.

These runs check the CPU path, on any machine: with a GPU visible the appliance would plan for it (another model,
dp = 1), so the subprocess sees none (cpu_only_env). The GPU path has its own check (docs/PERFORMANCE.md).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from appliance.parallel.testing import RANK_ENVIRONMENT

ROOT = Path(__file__).resolve().parents[2]
ENTRY = ROOT / "bloom_appliance.py"


def appliance_command(*args: str, python_flags: tuple[str, ...] = ()) -> list[str]:
    return [sys.executable, *python_flags, str(ENTRY), *args]


def cpu_only_env() -> dict[str, str]:
    """This process's environment with no CUDA device visible (and DeepSpeed on its CPU accelerator), as the
    distributed tests' ranks get it (appliance/parallel/testing.py): the appliance plans and trains for the CPU."""
    return {**os.environ, **RANK_ENVIRONMENT}


def run_appliance(
    *args: str, cwd: Path, timeout: float = 600, python_flags: tuple[str, ...] = ()
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        appliance_command(*args, python_flags=python_flags),
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout,
        env=cpu_only_env(),
    )
