"""An optional Weights & Biases copy of the run's figures, offline only, when the `wandb` package is importable.

Never a dependency and never the network: the run is written in offline mode (WANDB_MODE=offline) under
`<run>/wandb/`, for `wandb sync` by the user, from wherever they choose. It holds the same scalars as the
TensorBoard files (tensorboard.py's names), against the step ("iteration"). One W&B run per training process:
the sink opens on the first `step` or `eval` event, so node samplers and the head process, which write neither,
start none; a restart opens the same run id again (resume="allow"), so `wandb sync` joins the attempts.
BLOOM_APPLIANCE_WANDB=0 turns it off where wandb is installed for other work.
"""

from __future__ import annotations

import atexit
import hashlib
import importlib
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from appliance.monitor.scalar_sink import ScalarSink
from appliance.monitor.tensorboard import on_step_axis, scalars_of

WANDB_DIR = "wandb"
PROJECT = "bloom-appliance"
OPENS_ON = ("step", "eval")


def wandb_wanted() -> bool:
    return os.environ.get("BLOOM_APPLIANCE_WANDB", "1") != "0"


class WandbSink(ScalarSink):
    def __init__(self, run_root: Path, warn: Callable[[str], None]) -> None:
        self.run_root = Path(run_root).resolve()
        super().__init__(self.run_root, warn)
        self._run: Any = None

    def stopped(self) -> str:
        return f"the offline W&B run stopped ({self.run_root / WANDB_DIR})"

    def copy(self, event: dict[str, Any]) -> None:
        scalars = scalars_of(event, self.clock)
        if self._run is None and (event.get("kind") not in OPENS_ON or not self._open()):
            return
        # The step-axis scalars only: W&B plots any of them against steps-vs-samples/y=samples,x=steps itself.
        on_steps = [(name, value, x) for name, value, x in scalars if on_step_axis(name)]
        if on_steps:
            self._run.log({**{name: value for name, value, _ in on_steps}, "iteration": on_steps[0][2]})

    def _open(self) -> bool:
        os.environ["WANDB_MODE"] = "offline"  # set before import and init: no login, no network, ever
        try:
            wandb = importlib.import_module("wandb")  # optional, never installed by install.sh
        except ImportError:
            self.off = True
            return False
        (self.run_root / WANDB_DIR).mkdir(parents=True, exist_ok=True)
        # One id per run directory: every attempt of this run resumes the same W&B run.
        run_id = hashlib.sha256(str(self.run_root).encode()).hexdigest()[:16]
        self._run = wandb.init(
            mode="offline",
            dir=str(self.run_root),
            project=PROJECT,
            name=self.run_root.name,
            id=run_id,
            resume="allow",
        )
        self._run.define_metric("*", step_metric="iteration")
        atexit.register(self.close)
        return True

    def close(self) -> None:
        if self._run is not None:
            run, self._run = self._run, None
            run.finish()
            atexit.unregister(self.close)
