"""The sinks every EventWriter hands its events to: copies of the run's figures for the tools users already watch.

- TensorBoard event files in `<run>/tensorboard/` (tensorboard.py), always; without the tensorboard package, one
  warning event instead.
- An offline Weights & Biases run in `<run>/wandb/` (wandb_sink.py), only where `wandb` is importable and
  BLOOM_APPLIANCE_WANDB is not 0.

Both are lazy: a writer that never emits a figure (the head process, a watchdog) imports nothing and opens no file.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from pathlib import Path

from appliance.monitor.events import EventSink, EventWriter
from appliance.monitor.tensorboard import TensorBoardSink
from appliance.monitor.wandb_sink import WandbSink, wandb_wanted


def default_sinks(run_root: Path, warn: Callable[[str], None]) -> list[EventSink]:
    sinks: list[EventSink] = [TensorBoardSink(run_root, warn)]
    if wandb_wanted() and importlib.util.find_spec("wandb") is not None:
        sinks.append(WandbSink(run_root, warn))
    return sinks


def writer_with_sinks(path: Path, echo: bool = False) -> EventWriter:
    """An EventWriter on ``path`` (metrics.jsonl) that also hands its events to the default sinks: for the processes
    that write figures (rank 0, each node's sampler). A sink's trouble becomes one warning event of this writer."""
    writer = EventWriter(path, echo)
    writer.sinks = default_sinks(writer.path.parent, warn=writer.warn)
    return writer
