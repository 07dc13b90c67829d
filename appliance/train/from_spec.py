"""A rank's model config and engine from the run spec: the one code path from plan.json to what is built, shared by
the worker and the tests that check it (tests/unit/test_runspec_engine.py).

The engine takes the spec's own sections (layout, training settings, hardware), passed through unchanged: no
default stands in for a missing key (the spec refuses a plan without it) and no key is copied out of them.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from appliance.atomic import write_atomic
from appliance.model.config import BloomConfig, config_for_shape
from appliance.parallel.parallelize import compiles_blocks
from appliance.parallel.step.build import build_engine
from appliance.parallel.step.engine import ParallelEngine
from appliance.parallel.step.kernel_choice import choose_kernels, kernel_record
from appliance.parallel.topology import ParallelTopology
from appliance.planner.measured_kernels import MeasuredKernels
from appliance.planner.reprice import reprice
from appliance.planner.runspec import RunSpec, load_spec
from appliance.rundir import RunDir


def model_config(spec: RunSpec, tokenizer_size: int) -> BloomConfig:
    """The plan's BLOOM shape; the embedding has the tokenizer's rows padded to a multiple of 128 x tp (already the
    tokenizer's own size when it was built for this tp)."""
    from appliance.tokenizer.vocab import padded_vocab_size

    return config_for_shape(spec.model, padded_vocab_size(tokenizer_size, spec.layout.tp))


def engine_device() -> torch.device:
    """Where the engine keeps the model: DeepSpeed's current device (cuda:<local rank>, or cpu)."""
    from deepspeed.accelerator import get_accelerator

    return torch.device(get_accelerator().current_device_name())


def kernels_for(
    spec: RunSpec,
    config: BloomConfig,
    topology: ParallelTopology,
    *,
    run_dir: RunDir | None = None,
    cache_file: Path | None = None,
) -> dict[str, Any]:
    """The kernels this run's ranks use, chosen by measurement on CUDA under BLOOM_KERNELS=auto (collective: rank 0
    measures, or reads run_dir/kernels.json when it was measured for this GPU, software and shapes; every rank
    installs the choice), as the record ds_config.json and the `kernels` event carry (kernel_choice.kernel_record).
    `cache_file`: another place for that cache (bench keeps one beside its results)."""
    device = engine_device()
    selection = choose_kernels(
        config,
        topology,
        micro_batch_size=spec.train.micro_batch_size,
        seq_len=spec.train.seq_len,
        dtype=spec.train.dtype,
        device=device,
        cache_file=cache_file if cache_file is not None else None if run_dir is None else run_dir.kernels,
        documents=spec.train.reset_attention_mask,
        # The block-level check times the compiled block: only where the run compiles its blocks (`compile`).
        compiled_blocks=compiles_blocks(spec.train.compile, device),
    )
    return kernel_record(selection, device)


def engine_for(
    spec: RunSpec,
    config: BloomConfig,
    topology: ParallelTopology,
    *,
    run_dir: RunDir | None = None,
    kernels: dict[str, Any] | None = None,
) -> ParallelEngine:
    """This rank's engine for the spec's layout and training settings (collective). The kernels are chosen first
    (kernels_for; `kernels`: that record when the caller has chosen them already). With `run_dir`, rank 0 writes
    the DeepSpeed config the engine runs with, and the kernels, to run_dir/ds_config.json, replacing the previous
    launch's."""
    if kernels is None:
        kernels = kernels_for(spec, config, topology, run_dir=run_dir)
    # The spec's sections as they are: the layout (batch sizes, ZeRO, recompute, SP, cp_mode), the training settings
    # (precision, optimizer, seed, seq_len, compile, the expert store's budgets) and the plan's nodes and links, which
    # the MoE exchange is chosen for as the plan priced it.
    disk_dir = expert_disk_dir(run_dir, dist.get_rank()) if run_dir is not None else None
    engine = build_engine(
        config,
        topology,
        spec.layout,
        spec.train,
        hardware=spec.hardware,
        expert_disk_dir=disk_dir if spec.train.expert_host_budget_mb else None,  # the store's tier past the host's
    )
    if run_dir is not None and dist.get_rank() == 0:
        record = engine.ds_config
        if engine.all_to_all is not None:
            record["moe_all_to_all"] = engine.all_to_all.record()  # which exchange the experts use, and why
        record["kernels"] = kernels  # which implementation of each fused op runs, and its measured time
        write_ds_config(run_dir, record)
    return engine


def reprice_plan(run_dir: RunDir, spec: RunSpec, kernels: dict[str, Any]) -> RunSpec:
    """plan.json's estimate priced with the fused-op times measured at this launch (planner/measured_kernels.py),
    written into plan.json (its estimate, time breakdown and notes only, atomically) when that changes them; the
    spec as the run now reads it. Unchanged without measured times, and when this launch runs another layout than
    plan.json's (a re-formed elastic world: its estimate stays the plan's)."""
    measured = MeasuredKernels.from_record(kernels)
    if measured is None:
        return spec
    on_disk = load_spec(run_dir.plan)
    if on_disk.layout != spec.layout:
        return spec
    priced = reprice(on_disk, measured)
    if priced.report != on_disk.report:
        data = json.loads(run_dir.plan.read_text())
        written = priced.to_json()
        data.update({key: written[key] for key in ("estimate", "time_breakdown_s", "notes")})
        RunSpec.from_json(data, str(run_dir.plan))  # the spec's own checks, as on any read of plan.json
        write_atomic(run_dir.plan, json.dumps(data, indent=1).encode())
    return replace(spec, report=priced.report)


def expert_disk_dir(run_dir: RunDir, rank: int) -> Path:
    """Where this rank's tiered expert store keeps the experts its host budget has no room for: one directory per
    rank (every rank numbers its experts from 0, so the ranks of one node would otherwise share file names)."""
    return run_dir.root / "expert_store" / f"rank{rank:05d}"


def write_ds_config(run_dir: RunDir, config: dict) -> None:
    """ds_config.json, as Megatron-DeepSpeed launches keep theirs. It holds batch sizes, precision, ZeRO stage and
    clipping only (parallel/step/deepspeed_config.py builds it from the plan): nothing secret. No clipping is written as
    Infinity, which json.load (DeepSpeed's own reader) accepts."""
    write_atomic(run_dir.ds_config, (json.dumps(config, indent=1, sort_keys=True) + "\n").encode())
