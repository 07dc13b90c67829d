"""What every contender trains: the plan's model, micro-batch and precision on one device, the same batches, the same
number of steps, and one timing rule.

The plan is the one `run` would make for this machine (the model ladder's pick unless --model names one). The bench
runs it on one device: tp = pp = dp = 1 with the plan's micro-batch size, precision and recompute, and per step the
micro-batches one data-parallel rank of the plan accumulates (global batch / (micro-batch x dp)), so a step here is
one rank's share of a real step. A plan that splits the model (tp or pp > 1) does not fit one device and is refused.
On CPU every contender runs with the plan's cores per rank as torch threads (what `train` gives each gloo rank), so
the peak the MFU divides by, the plan's per-rank peak, is that of the cores in use.

Sizing (BenchSize, the flags --micro-batch, --steps, --micro-batches): a GPU check has minutes, and one rank's share
of bloom-1b7's global batch is ~25 s a step. --micro-batch N replaces the plan's micro-batch size, and a step is then
one micro-batch unless --micro-batches M asks for M (gradient accumulation); --steps K times K steps. --quick is a
smoke run: bloom-micro-test on CPU; on a GPU bloom-560m at micro-batch 2, one micro-batch a step, 5 timed steps.

Timing: `warmup_steps` steps first (not timed: the allocator, torch.compile's graph capture and code generation,
Triton's autotuning and first launches, first-touch), then `steps` steps, each timed on its own (synchronised on
GPUs); tokens/s is tokens per step over the median step time, robust to a neighbour's burst on a shared machine,
with the mean recorded beside it. contenders.py runs them (taking turns on CPU).
"""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from appliance.errors import BadInput
from appliance.planner.runspec import RunSpec

Batch = tuple[torch.Tensor, torch.Tensor]  # (input ids, next-token labels), each [micro_batch, seq]
Progress = Callable[[str], None]
StepFn = Callable[[list[Batch]], Any]
QUICK_MODEL = "bloom-micro-test"  # --quick on CPU: the tests' model, a few seconds for the whole bench
# --quick on a GPU: BLOOM's smallest model, one micro-batch of 2 x 2048 tokens a step, sized so that the three
# contenders (torch.compile's inductor build included) finish in under three minutes on an H100 or H200.
QUICK_GPU_MODEL, QUICK_GPU_MICRO_BATCH, QUICK_GPU_STEPS, QUICK_GPU_WARMUP = "bloom-560m", 2, 5, 2


@dataclass(frozen=True)
class BenchSize:
    """The sizing flags; None: the plan's (or --quick's) choice."""

    micro_batch: int | None = None  # --micro-batch: samples per micro-batch, instead of the plan's
    steps: int | None = None  # --steps: timed steps
    micro_batches: int | None = None  # --micro-batches: micro-batches per step (gradient accumulation)

    def __post_init__(self) -> None:
        for flag, value in (("--micro-batch", self.micro_batch), ("--steps", self.steps),
                            ("--micro-batches", self.micro_batches)):  # fmt: skip
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise BadInput(f"bench {flag} {value}: must be a whole number of at least 1")


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


def bench_device(gpus_per_node: int) -> torch.device:
    """The device the bench measures: the current CUDA device where the plan has GPUs and torch sees one (hide them
    with CUDA_VISIBLE_DEVICES= to bench the CPU), else the CPU."""
    if gpus_per_node > 0 and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def plan_workload(model: str | None, *, quick: bool = False, size: BenchSize = BenchSize()) -> Workload:
    """The one-device workload for `model` (None: the ladder's pick; --quick: QUICK_MODEL on CPU, QUICK_GPU_MODEL
    on a GPU) on this machine, sized by `size` (the module docstring has the rules)."""
    from appliance.hardware import detect
    from appliance.planner import load_model_shape, make_plan

    hw = detect()
    device = bench_device(hw.gpus_per_node)
    cuda = device.type == "cuda"
    quick_gpu = quick and cuda
    name = model or ((QUICK_GPU_MODEL if cuda else QUICK_MODEL) if quick else None)
    plan = make_plan(hw, load_model_shape(name) if name else None)
    spec = plan.spec()
    lay = spec.layout
    if lay.tp > 1 or lay.pp > 1:
        raise BadInput(
            f"bench: {spec.model.name} needs tp={lay.tp} pp={lay.pp} on this machine; the bench measures one device:"
            " pass --model with a model that fits one (e.g. bloom-1b7 on an 80 GB GPU)"
        )
    micro_batch = size.micro_batch or (QUICK_GPU_MICRO_BATCH if quick_gpu else lay.micro_batch_size)
    if size.micro_batches is not None:
        micro_batches = size.micro_batches
    elif size.micro_batch is not None or quick_gpu:
        micro_batches = 1  # a micro-batch size of the user's: one micro-batch a step unless asked for more
    else:
        micro_batches = lay.global_batch_size // (lay.micro_batch_size * lay.dp)  # one DP rank's share of a step
    one_step = micro_batch * micro_batches
    one = dataclasses.replace(lay, dp=1, micro_batch_size=micro_batch, global_batch_size=one_step)
    train = dataclasses.replace(spec.train, micro_batch_size=micro_batch, global_batch_size=one_step)
    spec = dataclasses.replace(spec, layout=one, train=train)
    ranks_per_node = lay.world_size // max(1, hw.nodes)
    threads = torch.get_num_threads() if cuda else max(1, round(hw.cpu_cores / ranks_per_node))
    if quick:
        warmup, steps = (QUICK_GPU_WARMUP, QUICK_GPU_STEPS) if cuda else (1, 3)
    else:
        warmup, steps = 3, 20
    return Workload(
        spec=spec,
        planned=plan.to_json()["layout"],
        micro_batches=micro_batches,
        threads=threads,
        warmup_steps=warmup,
        steps=size.steps or steps,
        device=device,
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
            "status": "ok",
            "tokens_per_s": self.tokens_per_s,
            "median_step_s": self.median_s,
            "mean_step_s": statistics.fmean(self.seconds),
            "steps_timed": len(self.seconds),
        }
