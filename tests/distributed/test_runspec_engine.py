"""From plan.json to what the ranks build: every key of a plan that shapes the model and the engine, set away from
its default, is found in the built engine, through the worker's own code path (appliance/train/from_spec.py: the
run spec, the model config, build_engine, ds_config.json), on two gloo ranks at tp=2 with sequence parallelism."""

from __future__ import annotations

import json
import math
import os
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch

from appliance.hardware import load_hardware
from appliance.model.bloom import BloomForCausalLM
from appliance.parallel.testing import run_distributed
from appliance.parallel.topology import ParallelTopology
from appliance.planner import load_model_shape, make_plan, parse_layout
from appliance.planner.runspec import load_spec
from appliance.rundir import RunDir

pytestmark = pytest.mark.distributed

# Each differs from what the planner writes for this model on a CPU (zero 0, no recompute, no SP, fp32, init 0.02,
# epsilon 1e-5, the recipe's lr and seed, BLOOM's AdamW settings) and from the layout's own defaults (zero 1, full).
LAYOUT = "tp=2,pp=1,dp=1,mbs=2,gbs=4,zero=2,recompute=selective,sp=1"
MODEL = {"init_std": 0.0123, "layer_norm_epsilon": 1e-6}
TRAIN = {
    "lr": 3e-3,
    "min_lr": 3e-4,
    "adam_beta1": 0.85,
    "adam_beta2": 0.97,
    "adam_eps": 1e-7,
    "weight_decay": 0.05,
    "grad_clip": 0.7,
    "seed": 1234,
    "dtype": "bf16",
}
VOCAB = 512  # bloom-micro-test's tokenizer size, already a multiple of 128 x tp


def build_on_rank(topology: ParallelTopology, root: str) -> dict[str, Any]:
    """What the worker builds on this rank, described."""
    from appliance.train.from_spec import engine_for, model_config

    os.environ.setdefault("LOCAL_RANK", "0")  # read by DeepSpeed
    run_dir = RunDir(Path(root))
    spec = load_spec(run_dir.plan)
    engine = engine_for(spec, model_config(spec, VOCAB), topology, run_dir=run_dir)
    ds = engine.engine
    module = ds.module
    blocks = [m for m in module.modules() if hasattr(m, "self_attention")]
    named = dict(engine.named_parameters())
    weights = torch.cat([p.detach().float().flatten() for p in named.values() if p.ndim == 2])
    return {
        "ds_config": engine.ds_config,
        "zero_stage": ds.zero_optimization_stage(),
        "bf16": ds.bfloat16_enabled(),
        "param_dtypes": {str(p.dtype) for p in named.values()},
        "recompute_blocks": module.recompute_blocks,
        "recompute_core": {b.self_attention.recompute_core for b in blocks},
        # sequence parallelism lives in the blocks' tensor-parallel linears (they gather and reduce-scatter chunks)
        "sequence_parallel": {
            linear.sequence_parallel
            for b in blocks
            for linear in (
                b.self_attention.query_key_value,
                b.self_attention.dense,
                b.mlp.dense_h_to_4h,
                b.mlp.dense_4h_to_h,
            )
        },
        "blocks": len(blocks),
        "layer_norm_eps": {m.eps for m in module.modules() if isinstance(m, torch.nn.LayerNorm)},
        "groups": [{k: v for k, v in g.items() if k != "params"} for g in ds.basic_optimizer.param_groups],
        "embedding": named["transformer.word_embeddings.weight"].detach().float(),
        "sum": float(weights.double().sum()),
        "sum_sq": float((weights.double() ** 2).sum()),
        "count": weights.numel(),
        "biases_zero": all(not p.detach().any() for n, p in named.items() if n.endswith(".bias")),
    }


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    spec = make_plan(
        load_hardware("cpu-laptop-2core"), load_model_shape("bloom-micro-test"), layout=parse_layout(LAYOUT)
    ).spec()
    spec = replace(spec, model=replace(spec.model, **MODEL), train=replace(spec.train, **TRAIN))
    run_dir = RunDir(tmp_path_factory.mktemp("runspec") / "run").make()
    run_dir.plan.write_bytes(spec.dumps())
    ranks = run_distributed(build_on_rank, 2, str(run_dir.root), tp=2, timeout_s=600)
    return {"spec": spec, "run_dir": run_dir, "ranks": ranks}


def test_layout_and_precision_reach_the_deepspeed_engine(built: dict[str, Any]) -> None:
    for rank in built["ranks"]:
        assert rank["zero_stage"] == 2 and rank["bf16"] and rank["param_dtypes"] == {"torch.bfloat16"}
        assert rank["recompute_core"] == {True} and rank["recompute_blocks"] is False  # selective, not full
        assert rank["sequence_parallel"] == {True} and rank["blocks"] == 2
        assert rank["layer_norm_eps"] == {1e-6}
        config = rank["ds_config"]
        assert (config["train_batch_size"], config["train_micro_batch_size_per_gpu"]) == (4, 2)
        assert config["gradient_accumulation_steps"] == 2  # 4 samples / (micro-batch 2 x dp 1)
        assert config["gradient_clipping"] == 0.7 and config["zero_optimization"]["stage"] == 2
        assert config["bf16"] == {"enabled": True}


def test_optimizer_hyperparameters_are_the_plans(built: dict[str, Any]) -> None:
    for rank in built["ranks"]:
        decay, no_decay = rank["groups"]
        for group in (decay, no_decay):
            assert (group["lr"], group["betas"], group["eps"]) == (3e-3, (0.85, 0.97), 1e-7)
        assert (decay["weight_decay"], no_decay["weight_decay"]) == (0.05, 0.0)  # none on biases and LayerNorms


def test_initial_weights_are_drawn_with_the_plans_seed_and_std(built: dict[str, Any]) -> None:
    spec = built["spec"]
    from appliance.model.config import config_for_shape

    single = BloomForCausalLM(config_for_shape(spec.model, VOCAB), seed=1234)
    full = single.transformer.word_embeddings.weight.detach().to(torch.bfloat16).float()
    rows = VOCAB // 2  # vocab-parallel: rank r holds rows [r * V/2, (r + 1) * V/2)
    for r, rank in enumerate(built["ranks"]):
        assert torch.equal(rank["embedding"], full[r * rows : (r + 1) * rows])
        assert rank["biases_zero"]
    # The two TP ranks hold disjoint slices of every weight matrix: together, all 131,072 draws of the model
    # (512 x 64 embedding + 2 blocks x 12 x 64^2). The sample std of n normal draws has a standard error of
    # std / sqrt(2n), 0.2% of it here; bf16 rounding (relative error below 2^-8, unbiased) adds a relative variance
    # under 2^-16 / 3, negligible. 5 standard errors: within 1% of 0.0123, where the old path drew at 0.02.
    n = sum(rank["count"] for rank in built["ranks"])
    mean = sum(rank["sum"] for rank in built["ranks"]) / n
    std = math.sqrt(sum(rank["sum_sq"] for rank in built["ranks"]) / n - mean**2)
    assert n == 131_072
    assert abs(std - 0.0123) < 5 * 0.0123 / math.sqrt(2 * n)


def test_ds_config_json_records_what_the_engine_was_given(built: dict[str, Any]) -> None:
    path = built["run_dir"].ds_config
    written = json.loads(path.read_text())
    kernels = written.pop(
        "kernels"
    )  # beside the DeepSpeed config: what the fused ops run (parallel/step/kernel_choice.py)
    assert written == built["ranks"][0]["ds_config"]
    assert kernels["source"] == "default" and kernels["backend"] == "reference"  # gloo ranks on CPU: nothing measured
    assert oct(path.stat().st_mode & 0o777) == "0o640"  # appliance/atomic.py's mode: group-readable, not world-readable
    assert not list(path.parent.glob(".ds_config.json.tmp*"))
