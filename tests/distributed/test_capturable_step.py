"""The single-replica step (forward, backward, the optimizer region: parallel/step/single_replica.py,
flat_optimizer.py) is what CUDA-graph capture needs, shown without a GPU, on the step as it runs on CUDA:

- no host read: nothing waits for the device while a step is issued (parallel/step/host_reads.py's counter);
- no host scalar where a device tensor is needed: with the learning rate changed between two steps (as a schedule
  changes it), the two steps issue the same ops with the same arguments, and the Triton launches the same kernels on
  the same grids with the same scalars and the same tensors; and no op mixes a host tensor into the device's work
  (a host-to-device copy of the step's inputs, or of the gradients' addresses, is the only way data comes in);
- the same op sequence on two consecutive steps (names, shapes, dtypes, devices, every other argument);
- the step's persistent buffers (weights, masters, moments, the fp32 sum, step count, learning rate, the kernels'
  tables) keep their addresses from step to step.

Two runs of one rank, in this process. On the meta device, inside kernels.launch.recording for an H100: the device
is not the host, so a host tensor handed to a device op shows, and the optimizer takes its GPU path, whose launches are
recorded with their arguments instead of run. On CPU with BLOOM_KERNELS=triton (every kernel in Triton's interpreter):
real values, so host reads and addresses can be checked. Two micro-batches a step, so the fold runs too.

Positive controls: each check fails on a step that reads the loss (`.item()`), passes the learning rate as a host
float, multiplies by a host scalar tensor, or reallocates a persistent buffer between steps (on CPU with the torch
twins, which run in a fraction of the interpreter's time).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from appliance.model.config import BloomConfig
from appliance.parallel.step.host_reads import counting_host_reads
from appliance.parallel.testing import build_test_engine
from appliance.parallel.topology import ParallelTopology
from kernels.launch import H100, Launch, recording

CONFIG = BloomConfig(vocab_size=256, hidden_size=64, n_layer=2, n_head=4)
MBS, MICRO_BATCHES, SEQ = 2, 2, 16
COPIES = frozenset({"aten::copy_", "aten::_to_copy"})


def _micro_batches(step: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(step)
    tokens = [torch.randint(0, CONFIG.vocab_size, (MBS, SEQ + 1), generator=generator) for _ in range(MICRO_BATCHES)]
    return [(t[:, :-1].contiguous(), t[:, 1:].contiguous()) for t in tokens]


def _describe(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return ("tensor", tuple(value.shape), str(value.dtype), value.device.type)
    if isinstance(value, (list, tuple)):
        return tuple(_describe(v) for v in value)
    return repr(value)


class StepRecord(TorchDispatchMode):
    """Every op a step issues, with its arguments described (tensors by shape, dtype and device; everything else by
    value); the host-to-device copies apart; and the ops that take host tensors beside device ones."""

    def __init__(self, device: str) -> None:
        super().__init__()
        self.device = device
        self.ops: list[tuple[str, Any]] = []
        self.uploads: list[tuple[int, ...]] = []
        self.host_operands: list[str] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        name = func._schema.name
        self.ops.append((name, _describe(args), _describe(sorted(kwargs.items()))))
        out = func(*args, **kwargs)
        tensors = [t for t in (*_flat(args), *_flat(kwargs.values()), *_flat(out))]
        devices = {t.device.type for t in tensors}
        if {"cpu", self.device} <= devices:
            if name in COPIES:
                self.uploads.append(tuple(next(t for t in _flat(args) if t.device.type == "cpu").shape))
            else:
                self.host_operands.append(name)
        return out


def _flat(value: Any) -> Iterator[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        yield value
    elif hasattr(value, "__iter__") and not isinstance(value, (str, bytes, dict)):  # lists, tuples, dict values
        for v in value:
            yield from _flat(v)


def _launches(launches: list[Launch]) -> list[tuple[Any, ...]]:
    """Each launch: kernel, grid, every argument (tensors by shape, dtype and device; scalars by value), options."""
    return [(launch.kernel.__name__, launch.grid, _describe(launch.args), _describe(sorted(launch.options.items())))
            for launch in launches]  # fmt: skip


@contextmanager
def _one_rank(device: str | None = None) -> Iterator[Any]:
    """A single-replica bf16 engine of one rank in this process (on `device` instead of the accelerator's)."""
    from appliance.benchmark.trainer_speed import one_rank_group
    from appliance.parallel.step import build

    saved = build._engine_device
    if device is not None:
        build._engine_device = lambda: torch.device(device)  # type: ignore[assignment]
    try:
        with one_rank_group("gloo"):
            yield build_test_engine(
                CONFIG, ParallelTopology(tp=1, pp=1, dp=1, world_size=1), micro_batch_size=MBS,
                global_batch_size=MBS * MICRO_BATCHES, dtype="bf16", weight_decay=0.1, grad_clip=1.0,
            )  # fmt: skip
    finally:
        build._engine_device = saved  # type: ignore[assignment]


Tamper = Callable[[Any], None]


def _meta_steps(tamper: Tamper | None = None) -> dict[str, Any]:
    """A warm-up step, then two recorded steps with the learning rate changed before each, on the meta device."""
    with _one_rank("meta") as engine:
        if tamper is not None:
            tamper(engine)
        out: dict[str, Any] = {"steps": []}
        with recording(H100):
            engine.train_batch_async(_micro_batches(0))
        for step, lr in ((1, 3e-4), (2, 2e-4)):
            engine.set_lr(lr)  # between steps, as the trainer's schedule does
            batches = _micro_batches(step)
            with recording(H100) as launches, StepRecord("meta") as record:
                engine.train_batch_async(batches)
            out["steps"].append({"ops": record.ops, "uploads": record.uploads, "host_operands": record.host_operands,
                                 "launches": _launches(launches)})  # fmt: skip
        return out


def _persistent(engine: Any) -> dict[str, int]:
    """The addresses of every buffer the step keeps: the optimizer's and its kernels' tables, and the parameters."""
    optimizer = engine.engine.optimizer
    kept = {"weights": optimizer.weights, "master": optimizer.master, "exp_avg": optimizer.exp_avg,
            "exp_avg_sq": optimizer.exp_avg_sq, "grad_sum": optimizer.grad_sum, "step_count": optimizer.step_count,
            "lr": optimizer.lr}  # fmt: skip
    tables = optimizer._map()
    kept |= {f"table.{k}": getattr(tables, k) for k in ("offsets", "numels", "groups", "weight_decay", "addresses")}
    for key, chunks in tables._chunks.items():
        kept |= {f"chunks{key}.{k}": getattr(chunks, k) for k in ("tensor", "start", "partials")}
    kept |= {f"param.{n}": p for n, p in engine.named_parameters()}
    return {k: v.data_ptr() for k, v in kept.items()}


def _cpu_steps(tamper: Tamper | None = None, kernels: str = "triton") -> dict[str, Any]:
    """On CPU, every kernel in the interpreter (`kernels`: BLOOM_KERNELS): host reads while two steps are issued, and
    the persistent buffers' addresses before and after them."""
    saved = os.environ.get("BLOOM_KERNELS")
    os.environ["BLOOM_KERNELS"] = kernels
    try:
        with _one_rank() as engine:
            engine.train_batch(_micro_batches(0))
            before = _persistent(engine)
            if tamper is not None:
                tamper(engine)
            batches = [_micro_batches(step) for step in (1, 2)]
            with counting_host_reads() as issuing:
                for micro_batches, lr in zip(batches, (3e-4, 2e-4), strict=True):
                    engine.set_lr(lr)
                    engine.train_batch_async(micro_batches)
            return {"reads": dict(issuing.counts), "before": before, "after": _persistent(engine)}
    finally:
        if saved is None:
            os.environ.pop("BLOOM_KERNELS")
        else:
            os.environ["BLOOM_KERNELS"] = saved


def capture_problems(meta: dict[str, Any], cpu: dict[str, Any]) -> list[str]:
    """What stands between these steps and a CUDA graph; empty when nothing does."""
    found = []
    if cpu["reads"]:
        found.append(f"host reads while the steps were issued: {cpu['reads']}")
    moved = sorted(k for k in cpu["before"] if cpu["before"][k] != cpu["after"][k])
    if moved:
        found.append(f"persistent buffers at new addresses: {moved}")
    first, second = meta["steps"]
    for step in meta["steps"]:
        if step["host_operands"]:
            found.append(f"host tensors in device ops: {step['host_operands']}")
    if first["ops"] != second["ops"]:
        diff = next(i for i, (a, b) in enumerate(zip(first["ops"], second["ops"], strict=False)) if a != b)
        found.append(f"the op sequence changes between steps at op {diff}: {first['ops'][diff]} then "
                     f"{second['ops'][diff]}")  # fmt: skip
    if first["launches"] != second["launches"]:
        found.append("the Triton launches change between steps")
    if first["uploads"] != second["uploads"]:
        found.append(f"the uploads change between steps: {first['uploads']} then {second['uploads']}")
    return found


@pytest.fixture(scope="module")
def steps() -> tuple[dict[str, Any], dict[str, Any]]:
    return _meta_steps(), _cpu_steps()


def test_the_single_replica_step_is_capturable(steps: tuple[dict[str, Any], dict[str, Any]]) -> None:
    meta, cpu = steps
    assert capture_problems(meta, cpu) == []
    step = meta["steps"][0]
    names = [launch[0] for launch in step["launches"]]
    # The optimizer's GPU path ran: one fold (the first micro-batch), the norm and the update.
    assert names == ["_fold_kernel", "_sum_squares_kernel", "_adamw_kernel"], names
    # Data comes in twice a micro-batch (inputs, labels), and the gradients' addresses before the fold and the step.
    batch = (MBS, SEQ)
    assert step["uploads"][:2] == [batch, batch] and step["uploads"].count(batch) == 2 * MICRO_BATCHES
    addresses = [u for u in step["uploads"] if u != batch]
    assert len(addresses) == 2 and len(set(addresses)) == 1, step["uploads"]  # before the fold and the step


# ---- positive controls: each check catches what it is for ------------------------------------------------------
def _reads_the_loss(engine: Any) -> None:
    single = engine.engine
    step = single.step

    def reading(loss: torch.Tensor | None = None) -> None:
        if loss is not None:
            loss.item()  # e.g. a step that logs its loss
        step(loss)

    single.step = reading


def _host_learning_rate(engine: Any) -> None:
    optimizer = engine.engine.optimizer
    step = optimizer.step

    def with_host_lr(loss: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        norm, skipped = step(loss)
        optimizer.master.mul_(1.0 - float(optimizer.param_groups[0]["lr"]))  # a float the schedule changes
        return norm, skipped

    optimizer.step = with_host_lr


def _host_scalar_tensor(engine: Any) -> None:
    optimizer = engine.engine.optimizer
    step = optimizer.step

    def with_host_scalar(loss: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        norm, skipped = step(loss)
        optimizer.exp_avg.mul_(torch.tensor(0.5))  # a 0-d host tensor beside device ones
        return norm, skipped

    optimizer.step = with_host_scalar


def _reallocates(engine: Any) -> None:
    optimizer = engine.engine.optimizer
    optimizer.exp_avg = optimizer.exp_avg.clone()


@pytest.mark.parametrize(
    ("tamper", "where", "expected"),
    [
        (_reads_the_loss, "cpu", "host reads"),
        (_host_learning_rate, "meta", "op sequence changes"),
        (_host_scalar_tensor, "meta", "host tensors in device ops"),
        (_reallocates, "cpu", "persistent buffers at new addresses"),
    ],
    ids=["reads-the-loss", "host-lr", "host-scalar-tensor", "reallocates"],
)
def test_each_check_fails_on_a_step_that_breaks_capture(
    steps: tuple[dict[str, Any], dict[str, Any]], tamper: Tamper, where: str, expected: str
) -> None:
    meta, cpu = steps
    if where == "meta":
        meta = _meta_steps(tamper)
    else:
        cpu = _cpu_steps(tamper, kernels="reference")  # the checks, not the kernels, are under test: the fast path
    found = capture_problems(meta, cpu)
    assert any(expected in problem for problem in found), found
