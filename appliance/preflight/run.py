"""Build each role of a plan in the emulated world, step it, and set what it holds beside the planner's figures.
The plan is read as the run spec (planner/runspec.py): what `plan` makes, and what a run directory's plan.json holds."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import torch

from appliance.model.config import BloomConfig, config_for_shape
from appliance.parallel.step.build import build_engine
from appliance.parallel.topology import ParallelTopology
from appliance.planner import calibration as cal
from appliance.planner.device import Device
from appliance.planner.kernel_path import kernels_for
from appliance.planner.layout import Layout, pipeline_partition
from appliance.planner.memory import stage_bytes, stage_parameters
from appliance.planner.reprice import plan_device, reprice_preflight
from appliance.planner.runspec import RunSpec
from appliance.planner.timing import optimizer_seconds, stage_compute_seconds, stage_microbatch_seconds
from appliance.preflight.local import LocalDevice, check_kind, local_device
from appliance.preflight.measure import ActivationMeter, StateMeter
from appliance.preflight.report import GIB, DevicePeak, Figure, Preflight, RoleReport, Unchecked
from appliance.preflight.roles import Role, roles
from appliance.preflight.world import StageHandoff, emulated_world, stdout_to_stderr

STEPS = 3  # the first warms up (allocations, DeepSpeed's first-step setup) and is not timed
# The planner's memory terms a built rank is not measured for here: DeepSpeed's pipe buffers, the backward's
# transient workspace and context parallelism's exchange buffers. They enter the verdict as planned.
UNMEASURED = ("pipe_buffers", "workspace", "cp_buffers")
# Micro-batches a built rank runs per step, at least: enough to time over several of them. A plan's step can hold far
# more (BLOOM-176B: 128 at gbs 2048, mbs 2, dp 8), which would cost minutes per role and measure nothing new.
TIMED_MICRO_BATCHES = 4


def preflight(spec: RunSpec, *, steps: int = STEPS, local: LocalDevice | None = None) -> Preflight:
    """Every role of ``spec``'s layout built and stepped ``steps`` times in this process, first stage first (the
    later stages receive buffers shaped as it sends), on ``local`` (default: this process's device), skipping the
    roles whose planned bytes exceed what it has free; and the plan's estimate with the measured figures."""
    if steps < 2:
        raise ValueError("preflight needs a warm-up step and at least one timed step")
    local = local or local_device()
    check_kind(spec, local)
    config = config_for_shape(spec.model, spec.model.padded_vocab(spec.layout.tp))
    device = plan_device(spec)  # the planner's, for its figures
    handoff = StageHandoff()
    reports: list[RoleReport] = []
    unchecked: list[Unchecked] = []
    with stdout_to_stderr(), rank_threads(device):
        for role in roles(spec.layout):
            planned = _planned(spec, device, role)
            need = _planned_total(planned)
            if need > local.free_bytes:
                unchecked.append(Unchecked(role, need, local.free_bytes))
                continue
            if role.stage > 0 and handoff.sent is None:  # fed what the first stage sends: it was not built
                unchecked.append(Unchecked(role, need, local.free_bytes, unfed=True))
                continue
            try:
                reports.append(_role_report(spec, device, config, role, handoff, steps, planned))
            except torch.OutOfMemoryError:
                # More than the planner's figure, and more than this device had free: on a device at least as
                # large as the plan's, the plan's ranks cannot hold it either (report.py Unchecked.rules_out).
                peak = 0.0
                if torch.cuda.is_available():
                    peak = float(torch.cuda.max_memory_reserved())
                    torch.cuda.empty_cache()
                unchecked.append(
                    Unchecked(
                        role, need, local.free_bytes, out_of_memory_at=peak, capacity_bytes=device.capacity_gb * GIB
                    )
                )
    return _with_estimate(spec, device, local, reports, unchecked)


def built_layout(layout: Layout) -> Layout:
    """The layout a role is built at: the plan's, with its micro-batches per step cut to max(pp, 4) where it has
    more. What is measured does not change: 1F1B keeps min(pp - stage, m) micro-batches in flight, which is the
    plan's while m >= pp; the shards, ZeRO partitions and buffers do not depend on m; the time is per micro-batch,
    and the optimizer step is one whatever m."""
    kept = max(layout.pp, TIMED_MICRO_BATCHES)
    if layout.micro_batches <= kept:
        return layout
    return replace(layout, global_batch_size=kept * layout.micro_batch_size * layout.dp)


def _role_report(
    spec: RunSpec,
    device: Device,
    config: BloomConfig,
    role: Role,
    handoff: StageHandoff,
    steps: int,
    planned: dict[str, float],
) -> RoleReport:
    layout = built_layout(spec.layout)
    on_gpu = torch.cuda.is_available()
    if on_gpu:
        torch.cuda.empty_cache()  # the previous role's blocks go back, so this role's reserved peak is its own
        torch.cuda.reset_peak_memory_stats()
    with emulated_world(role.rank, layout.world_size):
        topology = ParallelTopology.from_layout(layout, world_size=layout.world_size)
        engine = build_engine(config, topology, layout, replace(spec.train, global_batch_size=layout.global_batch_size),
                              hardware=spec.hardware)  # fmt: skip
        try:
            if engine.pipelined:
                (handoff.feed if role.stage > 0 else handoff.record)(engine.engine)
            states = StateMeter(engine.engine.module, engine.engine.optimizer)
            optimizer = OptimizerTimer(engine.engine.optimizer, on_gpu)
            activations = ActivationMeter(engine.engine.module.parameters())
            seconds, optimizer_seconds = [], []
            for step in range(steps):
                batches = random_batches(config, layout.micro_batch_size, spec.train.seq_len, layout.micro_batches)
                # The gradients' peak is watched on the untimed first step only: the watch walks the optimizer.
                watch = states.watching_backward() if step == 0 else contextlib.nullcontext()
                optimizer.seconds = 0.0
                _synchronize(on_gpu)
                start = time.perf_counter()
                with activations.hooks(), watch:
                    engine.train_batch(batches)
                _synchronize(on_gpu)
                seconds.append(time.perf_counter() - start)
                optimizer_seconds.append(optimizer.seconds)
            held = states.count()
            shapes = {name: tuple(p.shape) for name, p in engine.named_parameters()}
        finally:
            engine.close()
    compute_ms, optimizer_ms = _planned_ms(spec, device, role)
    peak = None
    if on_gpu:
        peak = DevicePeak(float(torch.cuda.max_memory_allocated()), float(torch.cuda.max_memory_reserved()))
    share = time_share(spec, device)
    step_s = sum(seconds[1:]) / (len(seconds) - 1) / share
    optimizer_s = sum(optimizer_seconds[1:]) / (len(optimizer_seconds) - 1) / share
    return RoleReport(
        role=role,
        parameters=Figure(held.parameters, planned["weights"]),
        gradients=Figure(held.gradients, planned["gradients"] + planned["grad_accumulation"]),
        optimizer=Figure(held.optimizer, planned["optimizer"]),
        activations=Figure(activations.peak, planned["activations"] + planned["logits"]),
        ms_per_micro_batch=Figure(1e3 * (step_s - optimizer_s) / layout.micro_batches, compute_ms),
        optimizer_ms=Figure(1e3 * optimizer_s, optimizer_ms),
        unmeasured_bytes=sum(planned[key] for key in UNMEASURED),
        margin_fraction=cal.ALLOCATOR_MARGIN,
        fixed_overhead_bytes=device.fixed_overhead_gb * GIB,
        capacity_bytes=device.capacity_gb * GIB,
        shapes=shapes,
        device_peak=peak,
    )


class OptimizerTimer:
    """Seconds the engine's optimizer steps take, summed into ``seconds`` (the optimizer's step wrapped on the
    instance, as the engine calls it; on a GPU the queued work is waited for on both sides of it)."""

    def __init__(self, optimizer: Any, on_gpu: bool) -> None:
        self.seconds = 0.0
        step = optimizer.step

        def timed_step(*args: Any, **kwargs: Any) -> Any:
            _synchronize(on_gpu)
            start = time.perf_counter()
            try:
                return step(*args, **kwargs)
            finally:
                _synchronize(on_gpu)
                self.seconds += time.perf_counter() - start

        optimizer.step = timed_step


def _synchronize(on_gpu: bool) -> None:
    if on_gpu:
        torch.cuda.synchronize()


def time_share(spec: RunSpec, device: Device) -> float:
    """The share of a core a CPU rank of the plan gets: its ranks run one thread each (train/launch.py sets
    OMP_NUM_THREADS=1, and rank_threads does here), and where they outnumber the node's cores they take turns, so a
    rank's time is what one thread takes over its share. 1 on GPUs, whose ranks each own a device."""
    if device.kind != "cpu":
        return 1.0
    return min(1.0, spec.hardware.cpu_cores / device.ranks_per_node)


@contextlib.contextmanager
def rank_threads(device: Device) -> Iterator[None]:
    """torch's intra-op threads set to a CPU rank's one for the block (GPU plans: left as they are)."""
    if device.kind != "cpu":
        yield
        return
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def random_batches(
    config: BloomConfig, micro_batch_size: int, seq_len: int, count: int
) -> list[tuple[torch.Tensor, ...]]:
    """``count`` micro-batches of uniformly drawn token ids and next-token labels (what a step's costs depend on is
    their shape, not their values)."""
    shape = (micro_batch_size, seq_len)
    return [
        (torch.randint(0, config.vocab_size, shape), torch.randint(0, config.vocab_size, shape)) for _ in range(count)
    ]


def _planned(spec: RunSpec, device: Device, role: Role) -> dict[str, float]:
    """The planner's bytes by memory term for a rank of the role's stage (planner/memory.py stage_bytes)."""
    kernels = kernels_for(device, spec.model)
    return stage_bytes(spec.layout, spec.model, device, role.stage, spec.train.seq_len, kernels)[1]


def _planned_ms(spec: RunSpec, device: Device, role: Role) -> tuple[float, float]:
    """The planner's compute per micro-batch on the role's stage (its terms of planner/timing.py less the
    communication) and its optimizer step there, in ms."""
    layout, model = spec.layout, spec.model
    kernels = kernels_for(device, model)
    layers = pipeline_partition(model.layers, layout.pp).layers_per_stage[role.stage]
    terms = stage_microbatch_seconds(model, layout, device, spec.hardware, role.stage, layers, spec.train.seq_len,
                                     kernels)  # fmt: skip
    optimizer_s = optimizer_seconds(stage_parameters(model, layout, role.stage), layout, device)
    return 1e3 * stage_compute_seconds(terms), 1e3 * optimizer_s


def _planned_total(planned: dict[str, float]) -> float:
    """The planner's bytes for a rank of the stage with its allocator margin: what building it here would take (the
    fixed per-process overhead is this process's, already paid)."""
    return sum(planned.values()) * (1 + cal.ALLOCATOR_MARGIN)


def _with_estimate(
    spec: RunSpec, device: Device, local: LocalDevice, reports: list[RoleReport], unchecked: list[Unchecked]
) -> Preflight:
    """The result, with the plan's estimate priced again: the built roles' memory in place of the model's for their
    stages, and, measured on the plan's kind of device, their compute and optimizer times."""
    same = local.runs_like(spec)
    stage_compute = {r.role.stage: r.ms_per_micro_batch.measured / 1e3 for r in reports} if same else {}
    optimizer_s = max((r.optimizer_ms.measured / 1e3 for r in reports), default=None) if same else None
    overhead = device.fixed_overhead_gb * GIB
    totals = [r.total_bytes for r in reports] + [u.planned_bytes + overhead for u in unchecked]
    priced = reprice_preflight(spec, stage_compute, optimizer_s, max(totals) / GIB)
    planned, measured = dict(spec.report.estimate), dict(priced.report.estimate)
    if spec.device.kind == "cpu":  # the planner gives CPU ranks no measured peak, so no utilisation (render.py)
        for estimate in (planned, measured):
            estimate.pop("mfu", None)
            estimate.pop("hfu", None)
    return Preflight(reports, unchecked, local.name, same, planned, measured)
