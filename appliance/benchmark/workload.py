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
burst on a shared machine, with the mean recorded beside it.
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


def time_steps(step: Callable[[list[Batch]], Any], work: Workload, batches: list[list[Batch]], label: str,
               progress: Progress) -> StepTimes:  # fmt: skip
    """Runs every step of `batches`; times those after the warm-up (see the module docstring)."""
    cuda = work.device.type == "cuda"
    seconds = []
    for i, micro_batches in enumerate(batches):
        if cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        step(micro_batches)
        if cuda:
            torch.cuda.synchronize()
        elapsed = time.perf_counter() - start
        timed = i >= work.warmup_steps
        if timed:
            seconds.append(elapsed)
        if not timed or (i - work.warmup_steps + 1) % 5 == 0 or i == len(batches) - 1:
            what = "warm-up" if not timed else f"{i - work.warmup_steps + 1}/{work.steps}"
            progress(f"  {label}: step {what} {elapsed:.3f} s")
    return StepTimes(seconds, work.tokens_per_step)
