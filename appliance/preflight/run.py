"""Build each role of a plan in the emulated world, step it, and set what it holds beside the planner's figures.
The plan is read as the run spec (planner/runspec.py): what `plan` makes, and what a run directory's plan.json holds."""

from __future__ import annotations

import contextlib
import time

import torch

from appliance.model.config import BloomConfig, config_for_shape
from appliance.parallel.step.build import build_engine
from appliance.parallel.topology import ParallelTopology
from appliance.planner import calibration as cal
from appliance.planner.device import Device, make_device
from appliance.planner.kernel_path import kernels_for
from appliance.planner.layout import pipeline_partition
from appliance.planner.memory import stage_bytes
from appliance.planner.runspec import RunSpec
from appliance.planner.timing import stage_microbatch_seconds
from appliance.preflight.measure import ActivationMeter, StateMeter
from appliance.preflight.report import Figure, RoleReport
from appliance.preflight.roles import Role, roles
from appliance.preflight.world import StageHandoff, emulated_world, stdout_to_stderr

STEPS = 3  # the first warms up (allocations, DeepSpeed's first-step setup) and is not timed
# The planner's step terms a rank of the emulated world does not spend: its collectives return at once.
COMMUNICATION = ("tp_comm", "cp_comm", "pp_p2p")
# The planner's memory terms a built rank is not measured for here: DeepSpeed's pipe buffers, the backward's
# transient workspace and context parallelism's exchange buffers. They enter the verdict as planned.
UNMEASURED = ("pipe_buffers", "workspace", "cp_buffers")


def preflight(spec: RunSpec, *, steps: int = STEPS) -> list[RoleReport]:
    """Every role of ``spec``'s layout built and stepped ``steps`` times in this process, first stage first (the
    later stages receive buffers shaped as it sends)."""
    if steps < 2:
        raise ValueError("preflight needs a warm-up step and at least one timed step")
    config = config_for_shape(spec.model, spec.model.padded_vocab(spec.layout.tp))
    device = make_device(spec.hardware, spec.layout.world_size, spec.train.dtype)  # the planner's, for its figures
    handoff = StageHandoff()
    with stdout_to_stderr():
        return [_role_report(spec, device, config, role, handoff, steps) for role in roles(spec.layout)]


def _role_report(
    spec: RunSpec, device: Device, config: BloomConfig, role: Role, handoff: StageHandoff, steps: int
) -> RoleReport:
    layout = spec.layout
    with emulated_world(role.rank, layout.world_size):
        topology = ParallelTopology.from_layout(layout, world_size=layout.world_size)
        engine = build_engine(config, topology, layout, spec.train, hardware=spec.hardware)
        try:
            if engine.pipelined:
                (handoff.feed if role.stage > 0 else handoff.record)(engine.engine)
            states = StateMeter(engine.engine.module, engine.engine.optimizer)
            activations = ActivationMeter(engine.engine.module.parameters())
            seconds = []
            for step in range(steps):
                batches = random_batches(config, layout.micro_batch_size, spec.train.seq_len, layout.micro_batches)
                # The gradients' peak is watched on the untimed first step only: the watch walks the optimizer.
                watch = states.watching_backward() if step == 0 else contextlib.nullcontext()
                start = time.perf_counter()
                with activations.hooks(), watch:
                    engine.train_batch(batches)
                seconds.append(time.perf_counter() - start)
            held = states.count()
            shapes = {name: tuple(p.shape) for name, p in engine.named_parameters()}
        finally:
            engine.close()
    planned = _planned(spec, device, role)
    measured_ms = 1e3 * sum(seconds[1:]) / (len(seconds) - 1) / layout.micro_batches
    return RoleReport(
        role=role,
        parameters=Figure(held.parameters, planned["weights"]),
        gradients=Figure(held.gradients, planned["gradients"] + planned["grad_accumulation"]),
        optimizer=Figure(held.optimizer, planned["optimizer"]),
        activations=Figure(activations.peak, planned["activations"] + planned["logits"]),
        ms_per_micro_batch=Figure(measured_ms, planned["ms_per_micro_batch"]),
        unmeasured_bytes=sum(planned[key] for key in UNMEASURED),
        margin_fraction=cal.ALLOCATOR_MARGIN,
        fixed_overhead_bytes=device.fixed_overhead_gb * 2**30,
        capacity_bytes=device.capacity_gb * 2**30,
        shapes=shapes,
    )


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
    """The planner's bytes by memory term for the role's stage (planner/memory.py stage_bytes), and its compute time
    per micro-batch there in ms: the stage's terms of planner/timing.py less the communication."""
    layout, model = spec.layout, spec.model
    kernels = kernels_for(device, model)
    seq_len = spec.train.seq_len
    _, planned = stage_bytes(layout, model, device, role.stage, seq_len, kernels)
    layers = pipeline_partition(model.layers, layout.pp).layers_per_stage[role.stage]
    terms = stage_microbatch_seconds(model, layout, device, spec.hardware, role.stage, layers, seq_len, kernels)
    planned["ms_per_micro_batch"] = 1e3 * sum(v for k, v in terms.items() if k not in COMMUNICATION)
    return planned
