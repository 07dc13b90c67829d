#!/usr/bin/env python3
"""bloom-appliance: one command from raw text to an evaluated BLOOM model. See README.md."""

import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent
VENV_PYTHON = ROOT / ".venv" / "bin" / "python"

# Run inside the project's environment whatever python started us (./install.sh creates it).
if (
    VENV_PYTHON.exists()
    and Path(sys.prefix).resolve() != (ROOT / ".venv").resolve()
    and "BLOOM_NO_REEXEC" not in os.environ
):
    os.execv(str(VENV_PYTHON), [str(VENV_PYTHON), *sys.argv])

sys.path.insert(0, str(ROOT))
from appliance.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
