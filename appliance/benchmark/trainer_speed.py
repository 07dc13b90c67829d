"""The trainer's own tokens/s: its real engine (train/from_spec.py builds it from the run spec, as every rank does),
one rank in this process, in a one-rank process group (gloo on CPU, NCCL on a GPU).

The contender also keeps the engine's first weights (Hugging Face names, fp32), which the peers start from, and
which kernels.registry ops one training step called.
"""

from __future__ import annotations

import os
import socket
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from appliance.benchmark.kernel_table import count_registry_calls
from appliance.benchmark.workload import Batch, Workload
from appliance.parallel.store import LOOPBACK, STORE_BIND_ENV

if TYPE_CHECKING:
    from appliance.parallel.step.engine import ParallelEngine

ONE_RANK_ENV = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", STORE_BIND_ENV)


def _free_loopback_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextmanager
def one_rank_group(backend: str) -> Iterator[None]:
    """A process group of this process alone, on loopback; the environment is restored afterwards."""
    from appliance.parallel.step.deepspeed_comm import init_deepspeed_comm

    if dist.is_initialized():
        raise RuntimeError("bench: a process group is already running in this process")
    saved = {key: os.environ.get(key) for key in ONE_RANK_ENV}
    os.environ.update(MASTER_ADDR=LOOPBACK, MASTER_PORT=str(_free_loopback_port()), RANK="0", WORLD_SIZE="1",
                      LOCAL_RANK="0", LOCAL_WORLD_SIZE="1")  # fmt: skip
    os.environ[STORE_BIND_ENV] = LOOPBACK  # the group's store too (parallel/store.py)
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


KERNELS_CACHE = Path("runs") / "bench" / "kernels.json"


class TrainerContender:
    """The trainer's engine for the workload, built in the one-rank group (one_rank_group must be open), called
    once per step like the peers. It keeps the engine's first weights, the first step's loss and the registry ops
    that step called."""

    def __init__(self, work: Workload) -> None:
        from appliance.parallel.topology import ParallelTopology
        from appliance.train.from_spec import engine_for, kernels_for, model_config

        spec = work.spec
        # The vocabulary the plan states (a run would read the tokenizer's; both are padded the same way).
        # The workload's layout is one device's (tp = pp = dp = 1: workload.py refuses any other).
        config, topology = (
            model_config(spec, spec.model.vocab_size),
            ParallelTopology.from_layout(spec.layout, world_size=1),
        )
        # The kernels as a run chooses them (measured on a GPU, about a minute and a half), kept beside the bench's
        # results so that the next bench of this GPU, software and shapes reads them instead.
        self.kernels = kernels_for(spec, config, topology, cache_file=KERNELS_CACHE)
        engine = engine_for(spec, config, topology, kernels=self.kernels)
        self.weights: dict[str, torch.Tensor] = engine.model_shard()
        self.engine: ParallelEngine | None = engine
        self.calls_per_step: Counter[str] = Counter()
        self.first_loss: float | None = None

    def release(self) -> None:
        """Drop the engine (its device memory), keeping weights, calls and loss: the peers run next."""
        if self.engine is None:
            raise RuntimeError("bench: the trainer contender was already released")
        self.engine.close()
        self.engine = None

    def __call__(self, micro_batches: list[Batch]) -> None:
        if self.engine is None:
            raise RuntimeError("bench: the trainer contender was released")
        if self.first_loss is not None:
            self.engine.train_batch(micro_batches)
            return
        # The first (warm-up) step counts the registry ops training calls; the counting wrappers add a Python call
        # per op, so the timed steps run without them.
        with count_registry_calls() as counted:
            self.first_loss = float(self.engine.train_batch(micro_batches).loss)
        self.calls_per_step.update(counted)
