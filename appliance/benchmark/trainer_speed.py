"""The trainer's own tokens/s: its real engine (train/from_spec.py builds it from the run spec, as every rank does),
one rank in this process, in a one-rank process group (gloo on CPU, NCCL on a GPU).

The measurement also hands back the engine's first weights (Hugging Face names, fp32), which the peers start from,
and which kernels.registry ops one training step called.
"""

from __future__ import annotations

import os
import socket
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.distributed as dist

from appliance.benchmark.kernel_table import count_registry_calls
from appliance.benchmark.workload import Batch, Progress, StepTimes, Workload, time_steps

ONE_RANK_ENV = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")


@dataclass(frozen=True)
class TrainerRun:
    times: StepTimes
    weights: dict[str, torch.Tensor]  # before the first step
    calls_per_step: Counter[str]
    first_loss: float


def _free_loopback_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextmanager
def one_rank_group(backend: str) -> Iterator[None]:
    """A process group of this process alone, on loopback; the environment is restored afterwards."""
    from appliance.parallel.deepspeed_comm import init_deepspeed_comm

    if dist.is_initialized():
        raise RuntimeError("bench: a process group is already running in this process")
    saved = {key: os.environ.get(key) for key in ONE_RANK_ENV}
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_loopback_port()), RANK="0", WORLD_SIZE="1",
                      LOCAL_RANK="0", LOCAL_WORLD_SIZE="1")  # fmt: skip
    try:
        init_deepspeed_comm(backend)
        yield
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def measure_trainer(work: Workload, batches: list[list[Batch]], progress: Progress) -> TrainerRun:
    from appliance.parallel.topology import ParallelTopology
    from appliance.train.from_spec import engine_for, model_config

    spec = work.spec
    with one_rank_group("nccl" if work.device.type == "cuda" else "gloo"):
        # The vocabulary the plan states (a run would read the tokenizer's; both are padded the same way).
        config = model_config(spec, spec.model.vocab_size)
        engine = engine_for(spec, config, ParallelTopology(tp=1, pp=1, dp=1, world_size=1))
        weights = engine.model_shard()
        losses: list[float] = []
        calls: Counter[str] = Counter()

        def step(micro_batches: list[Batch]) -> None:
            if losses:
                losses.append(engine.train_batch(micro_batches).loss)
                return
            # The first (warm-up) step counts the registry ops training calls; the counting wrappers add a Python
            # call per op, so the timed steps run without them.
            with count_registry_calls() as counted:
                losses.append(engine.train_batch(micro_batches).loss)
            calls.update(counted)

        times = time_steps(step, work, batches, "trainer (DeepSpeed engine)", progress)
    return TrainerRun(times=times, weights=weights, calls_per_step=calls, first_loss=losses[0])
