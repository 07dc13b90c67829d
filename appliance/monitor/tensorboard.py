"""TensorBoard event files in `<run>/tensorboard/`, under the scalar names Megatron-DeepSpeed users know.

metrics.jsonl stays the source of truth; this is a copy of its figures for the tools users already watch. The
names are BigScience Megatron-DeepSpeed's (megatron/training.py, `training_log` and `evaluate_and_print_results`,
the code that trained BLOOM): a group, a slash, the scalar, with a ` vs samples` twin whose x axis is the consumed
samples instead of the step. Figures Megatron does not log (tokens/s, TFLOPs, MFU, GPU memory, energy, task scores)
get groups of their own in the same style.

Who writes: every EventWriter carries a TensorBoardSink (events.py's sink hook), and each event kind is written by
exactly one process (`step`, `eval`, `checkpoint` by rank 0; `gpu` and `energy` by each node's sampler), so each
scalar lands once, in its writer's own file (events.out.tfevents.<time>.<host>.<pid>...); TensorBoard merges the
files of one directory into one run. A process that writes no figure (the head, a watchdog) opens no file.

Cost on the training step: building one small protobuf per scalar and a queue put; tensorboard's EventFileWriter
writes and flushes from its own thread. The sink flushes on `checkpoint` and `run` events and at exit; a rank
killed outright loses at most its last FLUSH_S seconds of figures here (never in metrics.jsonl).

Steps redone after a restart (from the newest checkpoint) are written again: TensorBoard shows both points at those
steps, as it does for Megatron runs; metrics.jsonl's last report of a step is the one that counts.
"""

from __future__ import annotations

import atexit
import math
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from appliance.monitor.event_kinds import EVENT_KINDS
from appliance.monitor.events import finite
from appliance.monitor.scalar_sink import ScalarSink, StepClock

TENSORBOARD_DIR = "tensorboard"
TENSORBOARD_PIN = "tensorboard==2.21.0"  # install.sh's pin, named in the warning when the package is missing

# (scalar name, step event key): each written at x = step and, as `<name> vs samples`, at x = consumed samples.
# Megatron-DeepSpeed's own names first, then the figures it does not log, in the same style.
STEP_SCALARS = (
    ("lm-loss-training/lm loss", "loss"),
    ("learning-rate/learning-rate", "lr"),
    ("grad-norm/grad-norm", "grad_norm"),
    ("loss-scale/loss-scale", "loss_scale"),  # fp16 runs only
    ("batch-size/batch-size", "global_batch_size"),
    ("iteration-time/iteration-time", "step_time_s"),
    ("throughput/tokens-per-sec", "tokens_per_s"),
    ("throughput/samples-per-sec", "samples_per_s"),
    ("throughput/tflops-per-gpu", "tflops_per_gpu"),  # hardware FLOPs (recompute included)
    ("throughput/model-tflops-per-gpu", "model_tflops_per_gpu"),  # model FLOPs, MFU's numerator
    ("throughput/mfu", "mfu"),
)
VS_SAMPLES = " vs samples"

STEPS_VS_SAMPLES = "steps-vs-samples/y=steps,x=samples"  # the step plotted against the samples

# A scalar: (name, value, x). x is the step, or the consumed samples for the ` vs samples` twins.
Scalar = tuple[str, float, int]


def on_step_axis(name: str) -> bool:
    return not name.endswith(VS_SAMPLES) and name != STEPS_VS_SAMPLES


def _ppl(loss: float) -> float:
    return math.exp(min(loss, 50.0))  # the cap the trainer's own valid_ppl uses: a diverged loss stays finite


def _with_samples_twin(name: str, value: Any, step: int, samples: int | None) -> Iterator[Scalar]:
    number = finite(value)
    if number is None:
        return
    yield name, number, step
    if samples is not None:
        yield name + VS_SAMPLES, number, samples


def step_scalars(event: dict[str, Any]) -> Iterator[Scalar]:
    step, samples = int(event["step"]), int(event["consumed_samples"])
    yield STEPS_VS_SAMPLES, float(step), samples
    yield "steps-vs-samples/y=samples,x=steps", float(samples), step
    for name, key in STEP_SCALARS:
        yield from _with_samples_twin(name, event.get(key), step, samples)


def eval_scalars(event: dict[str, Any]) -> Iterator[Scalar]:
    """Validation loss, perplexity and bits per byte, over all sources and per source (the trainer's periodic
    evaluation and the final one); the final evaluation's task scores, with their standard errors. Bits per byte
    is not a Megatron-DeepSpeed scalar: it is named in the same style as the validation loss beside it."""
    step = int(event.get("step", 0))
    consumed = finite(event.get("consumed_samples"))
    samples = int(consumed) if consumed is not None else None
    loss = finite(event.get("valid_loss"))
    if loss is not None:
        yield from _with_samples_twin("lm-loss-validation/lm loss validation", loss, step, samples)
        yield from _with_samples_twin("lm-loss-validation/lm loss validation ppl", _ppl(loss), step, samples)
    yield from _with_samples_twin("lm-loss-validation/bits per byte", event.get("valid_bits_per_byte"), step, samples)
    source_bpb = event.get("per_source_bits_per_byte") or {}
    for source, figures in sorted((event.get("per_source") or {}).items()):
        # The periodic evaluation gives {source: loss} (and per_source_bits_per_byte beside it); the final one
        # {source: {"loss", "ppl", "bits_per_byte"}}.
        if isinstance(figures, dict):
            source_loss, bpb = finite(figures.get("loss")), figures.get("bits_per_byte")
        else:
            source_loss, bpb = finite(figures), source_bpb.get(source)
        yield from _with_samples_twin(f"lm-loss-validation/{source} bits per byte", bpb, step, samples)
        if source_loss is None:
            continue
        yield from _with_samples_twin(f"lm-loss-validation/{source} lm loss validation", source_loss, step, samples)
        yield from _with_samples_twin(
            f"lm-loss-validation/{source} lm loss validation ppl", _ppl(source_loss), step, samples
        )
    for task, scores in sorted((event.get("tasks") or {}).items()):
        if not isinstance(scores, dict):
            continue
        for metric, value in sorted(scores.items()):
            if metric in ("n", "num_fewshot") or finite(value) is None:
                continue  # counts and settings, not scores
            yield f"tasks/{task} {metric}", float(value), step


def checkpoint_scalars(event: dict[str, Any]) -> Iterator[Scalar]:
    step = int(event["step"])
    yield from _with_samples_twin("checkpoint/save-seconds", event.get("seconds"), step, None)
    yield from _with_samples_twin("checkpoint/stall-seconds", event.get("stall_s"), step, None)
    size = finite(event.get("bytes"))
    if size is not None:
        yield "checkpoint/size-gb", size / 1e9, step


def startup_scalars(event: dict[str, Any]) -> Iterator[Scalar]:
    """A launch's start, in seconds, at its first step: the total and each phase (train/startup.py)."""
    step = int(event.get("step", 0))
    total = finite(event.get("total_s"))
    if total is not None:
        yield "startup/total-seconds", total, step
    for phase, seconds in (event.get("phases") or {}).items():
        value = finite(seconds)
        if value is not None:
            yield f"startup/{phase}-seconds", value, step


def gpu_scalars(event: dict[str, Any], step: int) -> Iterator[Scalar]:
    """Each device of the node: memory, utilization, power, temperature (NVML's figures; none on a CPU node)."""
    node = event.get("node", "node")
    for device in event.get("devices") or []:
        gpu = f"{node}/gpu{device.get('index', 0)}"
        for group, key in (
            ("memory-used-gb", "memory_used_gb"),
            ("gpu-utilization", "util"),
            ("power-watts", "power_w"),
            ("temperature-c", "temperature_c"),
        ):
            value = finite(device.get(key))
            if value is not None:
                yield f"{group}/{gpu}", value, step


def energy_scalars(event: dict[str, Any], step: int) -> Iterator[Scalar]:
    """The node's totals over the whole run (measured or estimated: the energy event says which)."""
    node = event.get("node", "node")
    for name, key in (("kwh", "kwh"), ("co2-kg", "co2_kg"), ("gpu-kwh", "gpu_kwh"), ("cpu-kwh", "cpu_kwh")):
        value = finite(event.get(key))
        if value is not None:
            yield f"energy/{node} {name}", value, step


# Each kind's scalars, found from its declaration (event_kinds.py); a kind without a step of its own (a node's
# gpu and energy samples) is plotted at the newest training step.
SCALARS_OF_KIND: dict[str, Callable[..., Iterator[Scalar]]] = {
    name: globals()[kind.scalars] for name, kind in EVENT_KINDS.items() if kind.scalars is not None
}


def scalars_of(event: dict[str, Any], clock: StepClock) -> list[Scalar]:
    """The TensorBoard scalars of one event (none for kinds without figures: stage, warning, plan...)."""
    kind = event.get("kind")
    clock.saw(event)
    if not isinstance(kind, str) or kind not in SCALARS_OF_KIND:
        return []
    producer = SCALARS_OF_KIND[kind]
    return list(producer(event, clock.now()) if EVENT_KINDS[kind].scalars_at_step else producer(event))


class TensorBoardSink(ScalarSink):
    """Writes the scalars of the events it is given to `<run>/tensorboard/`; opens its file on the first scalar.

    Without the tensorboard package it writes nothing and says so once, through `warn`, when the first `step`
    event arrives (so the training process warns, not every node's sampler). It never raises: a failing write
    turns the sink off, with one warning.
    """

    # Buffered: up to this many scalars wait in memory for the writer thread; it also flushes every FLUSH_S.
    QUEUE_SIZE = 4096
    FLUSH_S = 60

    def __init__(self, run_root: Path, warn: Callable[[str], None]) -> None:
        super().__init__(run_root, warn)
        self.directory = Path(run_root) / TENSORBOARD_DIR
        self._writer: Any = None
        self._proto: Any = None

    def stopped(self) -> str:
        return f"TensorBoard event files stopped ({self.directory})"

    def copy(self, event: dict[str, Any]) -> None:
        scalars = scalars_of(event, self.clock)
        if scalars and self._open(event):
            wall_time = float(event.get("t", time.time()))
            # One record per x value (the step, the samples) holding all its scalars, not one per scalar: the
            # record writer checksums in Python, on its own thread, and that thread's share of the GIL is
            # what a write costs the training loop.
            by_x: dict[int, list[tuple[str, float]]] = {}
            for name, value, x in scalars:
                by_x.setdefault(x, []).append((name, value))
            for x, values in by_x.items():
                self._writer.add_event(self._scalars_event(values, x, wall_time))
        if self._writer is not None and event.get("kind") in ("checkpoint", "run"):
            self._writer.flush()

    def _open(self, event: dict[str, Any]) -> bool:
        if self._writer is not None:
            return True
        try:
            from tensorboard.compat.proto import event_pb2, summary_pb2
            from tensorboard.summary.writer.event_file_writer import EventFileWriter
        except ImportError:
            if event.get("kind") == "step":
                self.off = True
                self.warn(
                    f"the tensorboard package is not installed: {self.directory} is not written "
                    f"(metrics.jsonl holds every figure); ./install.sh installs {TENSORBOARD_PIN}"
                )
            return False
        self._proto = (event_pb2, summary_pb2)
        self._writer = EventFileWriter(str(self.directory), max_queue_size=self.QUEUE_SIZE, flush_secs=self.FLUSH_S)
        atexit.register(self.close)  # the workers never close their writers: their last figures are flushed here
        return True

    def _scalars_event(self, values: list[tuple[str, float]], x: int, wall_time: float) -> Any:
        event_pb2, summary_pb2 = self._proto
        summary = summary_pb2.Summary(value=[summary_pb2.Summary.Value(tag=n, simple_value=v) for n, v in values])
        return event_pb2.Event(wall_time=wall_time, step=x, summary=summary)

    def flush(self) -> None:
        if self._writer is not None:
            self._writer.flush()

    def close(self) -> None:
        if self._writer is not None:
            writer, self._writer = self._writer, None
            writer.close()
            atexit.unregister(self.close)
