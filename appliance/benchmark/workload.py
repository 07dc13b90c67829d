"""What every contender trains: the plan's model, micro-batch and precision on one device, the same batches, the same
number of steps, and one timing rule.

The plan is the one `run` would make for this machine (the model ladder's pick unless --model names one). The bench
runs it on one device: tp = pp = dp = 1 with the plan's micro-batch size, precision and recompute, and per step the
micro-batches one data-parallel rank of the plan accumulates (global batch / (micro-batch x dp)), so a step here is
one rank's share of a real step. A plan that splits the model (tp or pp > 1) does not fit one device and is refused.
On CPU every contender runs with the plan's cores per rank as torch threads (what `train` gives each gloo rank), so
the peak the MFU divides by, the plan's per-rank peak, is that of the cores in use.

Timing: `warmup_steps` steps first (not timed: allocator, compile, first-touch), then `steps` steps, each timed on
its own (synchronised on GPUs); tokens/s is tokens per step over the median step time, robust to a neighbour's
burst on a shared machine, with the mean recorded beside it. On CPU the contenders take turns, one step each
(time_contenders), so they all see the same load.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from appliance.errors import BadInput
from appliance.planner.runspec import RunSpec

Batch = tuple[torch.Tensor, torch.Tensor]  # (input ids, next-token labels), each [micro_batch, seq]
Progress = Callable[[str], None]
StepFn = Callable[[list[Batch]], Any]
QUICK_MODEL = "bloom-micro-test"  # --quick: the tests' model, a few seconds for the whole bench


@dataclass(frozen=True)
class Workload:
    spec: RunSpec  # the one-device spec the trainer's engine is built from
    planned: dict[str, Any]  # the layout the plan chose for the whole machine
    micro_batches: int  # per step, of spec.train.micro_batch_size samples each
    threads: int  # torch threads for every contender
    warmup_steps: int
    steps: int
    device: torch.device
    quick: bool

    @property
    def interleaved(self) -> bool:
        """CPU: the contenders take turns step by step (all three fit in memory, and the machine may be shared).
        GPU: one after the other (three copies of a model with its optimizer state may not fit one device)."""
        return self.device.type == "cpu"

    @property
    def tokens_per_step(self) -> int:
        return self.micro_batches * self.spec.train.micro_batch_size * self.spec.train.seq_len

    def batches(self) -> list[list[Batch]]:
        """warmup_steps + steps steps of random token ids (seeded: every contender gets the same ones)."""
        train = self.spec.train
        gen = torch.Generator().manual_seed(train.seed)
        shape = (train.micro_batch_size, train.seq_len + 1)
        steps = []
        for _ in range(self.warmup_steps + self.steps):
            tokens = [
                torch.randint(0, self.spec.model.vocab_size, shape, generator=gen) for _ in range(self.micro_batches)
            ]
            steps.append([(t[:, :-1].contiguous(), t[:, 1:].contiguous()) for t in tokens])
        return steps


def plan_workload(model: str | None, *, quick: bool = False) -> Workload:
    """The one-device workload for `model` (None: the ladder's pick; --quick: QUICK_MODEL) on this machine."""
    from appliance.hardware import detect
    from appliance.planner import load_model_shape, make_plan

    hw = detect()
    name = model or (QUICK_MODEL if quick else None)
    plan = make_plan(hw, load_model_shape(name) if name else None)
    spec = plan.spec()
    lay = spec.layout
    if lay.tp > 1 or lay.pp > 1:
        raise BadInput(
            f"bench: {spec.model.name} needs tp={lay.tp} pp={lay.pp} on this machine; the bench measures one device:"
            " pass --model with a model that fits one (e.g. bloom-1b7 on an 80 GB GPU)"
        )
    micro_batches = lay.global_batch_size // (lay.micro_batch_size * lay.dp)
    one_step = lay.micro_batch_size * micro_batches
    one = dataclasses.replace(lay, dp=1, global_batch_size=one_step)
    spec = dataclasses.replace(spec, layout=one, train=dataclasses.replace(spec.train, global_batch_size=one_step))
    cuda = hw.gpus_per_node > 0 and torch.cuda.is_available()
    ranks_per_node = lay.world_size // max(1, hw.nodes)
    threads = torch.get_num_threads() if cuda else max(1, round(hw.cpu_cores / ranks_per_node))
    return Workload(
        spec=spec,
        planned=plan.to_json()["layout"],
        micro_batches=micro_batches,
        threads=threads,
        warmup_steps=1 if quick else 3,
        steps=3 if quick else 20,
        device=torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu"),
        quick=quick,
    )


@dataclass(frozen=True)
class StepTimes:
    seconds: list[float]  # each timed step
    tokens_per_step: int

    @property
    def median_s(self) -> float:
        return statistics.median(self.seconds)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens_per_step / self.median_s

    def to_json(self) -> dict[str, Any]:
        return {
            "tokens_per_s": self.tokens_per_s,
            "median_step_s": self.median_s,
            "mean_step_s": statistics.fmean(self.seconds),
            "steps_timed": len(self.seconds),
        }


def _timed(step: StepFn, micro_batches: list[Batch], cuda: bool) -> float:
    if cuda:
        torch.cuda.synchronize()
    start = time.perf_counter()
    step(micro_batches)
    if cuda:
        torch.cuda.synchronize()
    return time.perf_counter() - start


def time_contenders(makers: dict[str, Callable[[], StepFn]], work: Workload, batches: list[list[Batch]],
                    progress: Progress) -> dict[str, StepTimes]:  # fmt: skip
    """Builds each contender (in order: a later maker may use what an earlier one built) and runs every step of
    `batches` on it, timing those after the warm-up. Interleaved (work.interleaved): the contenders take turns,
    one step each, so a neighbour's burst on a shared machine slows them alike; else one contender after the
    other, each dropped before the next is built."""
    cuda = work.device.type == "cuda"
    seconds: dict[str, list[float]] = {name: [] for name in makers}

    def record(i: int, name: str, elapsed: float) -> None:
        if i >= work.warmup_steps:
            seconds[name].append(elapsed)

    def report(i: int, names: list[str]) -> None:
        n = i - work.warmup_steps + 1
        if n <= 0 or n % 5 == 0 or i == len(batches) - 1:
            what = "warm-up" if n <= 0 else f"{n}/{work.steps}"
            progress(f"  step {what}: " + ", ".join(f"{name} {last[name]:.3f} s" for name in names))

    last: dict[str, float] = {}  # each contender's latest step

    if work.interleaved:
        steps = {}
        for name, make in makers.items():
            progress(f"  building {name}")
            steps[name] = make()
        for i, micro_batches in enumerate(batches):
            for name, step in steps.items():
                last[name] = _timed(step, micro_batches, cuda)
                record(i, name, last[name])
            report(i, list(steps))
    else:
        for name, make in makers.items():
            progress(f"  building {name}")
            step = make()
            for i, micro_batches in enumerate(batches):
                last[name] = _timed(step, micro_batches, cuda)
                record(i, name, last[name])
                report(i, [name])
            del step
    return {name: StepTimes(times, work.tokens_per_step) for name, times in seconds.items()}
