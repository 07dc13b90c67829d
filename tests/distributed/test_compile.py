"""Regional compile (`compile=on`, parallelize.compile_blocks) trains like eager blocks, on gloo ranks.

Each launch (tp = 1; tp = 2 with sequence parallelism; pp = 2; dp = 2 with ZeRO 1, where the overlapped parameter
gather's forward pre-hooks run around the compiled blocks) trains the same tiny BLOOM twice on the same ranks, with
compile off and on, through the worker's build_engine (the single-replica step or DeepSpeed's, the layout's TP/SP or
pipeline, the compiled blocks), and compares the losses and the weights after STEPS steps. The compiled blocks are
the same arithmetic with elementwise ops fused, which rounds fp32 differently; the bound is a multiple of the noise
floor (noise_floor.py: how far the single-process reference moves when only its summation order changes, measured
on this CPU).

Also checked in every launch: fullgraph=True (a graph break is an error), every block compiled, no recompile in
training steps 2..STEPS (torch._dynamo.config.error_on_recompile), and evaluation: its first shape and a second one
compile (no_grad and eval mode are guarded), a third shape and the training step after it compile nothing.

Every launch uses inductor, the backend `compile=on` runs (C++ generated and built with gcc here, Triton on GPUs):
the four launches took 85 s on this 2-core machine with an empty inductor cache, 38 s with a warm one.
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import reference_training
import torch
from noise_floor import assert_within, check_floor, measure_floor
from reference_training import Recipe

from appliance.model.bloom import BloomBlock
from appliance.model.config import BloomConfig
from appliance.parallel.testing import build_test_engine, run_distributed
from appliance.parallel.topology import ParallelTopology

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

CONFIG = BloomConfig(vocab_size=256, hidden_size=64, n_layer=2, n_head=4)  # 256 = 128 x tp(2)
SEQ, MBS, GBS, STEPS, SEED, LR = 16, 2, 4, 10, 1234, 1e-2
# Evaluation's sequence lengths: the first two compile its graphs, the third must reuse one. DeepSpeed's pipeline
# engine sizes its stage-to-stage buffers at the first batch, so at pp > 1 evaluation keeps the training length.
EVAL_LENGTHS = {1: (SEQ, 8, 12), 2: (SEQ, SEQ, SEQ)}  # by pp
# Compiled blocks round fp32 differently in their fused elementwise ops (the matmuls are the same BLAS calls), from
# the first step on, where the floor's reorderings change only how micro-batch and thread sums add up: measured
# (10 steps) losses 1.8-3.6 x and weights 0.9-1.2 x the floor over the four launches, so 10 x leaves room for
# other CPUs.
FACTOR = 10.0
QUANTITIES = ("losses", "weights")

RECIPE = Recipe(
    config=CONFIG, seed=SEED, micro_batch_size=MBS, steps=[(s * GBS, GBS) for s in range(STEPS)],
    lr_at=lambda consumed: LR, weight_decay=0.0, betas=(0.9, 0.95), eps=1e-8, grad_clip=1.0,
)  # fmt: skip


def token_stream() -> torch.Tensor:
    """Samples of SEQ + 1 tokens: arithmetic progressions mod 200 (ids 200..255 are vocabulary padding)."""
    g = torch.Generator().manual_seed(0)
    n = STEPS * GBS + MBS
    start, stride = torch.randint(0, 200, (n, 1), generator=g), torch.randint(1, 7, (n, 1), generator=g)
    return (start + stride * torch.arange(SEQ + 1)) % 200


def _micro_batches(topology: ParallelTopology, step: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """This DP rank's micro-batches of a step: DP rank d takes every dp-th micro-batch of the step's samples."""
    tokens = token_stream()
    _, dp_rank, _ = topology.coords(torch.distributed.get_rank())
    firsts = range(step * GBS + dp_rank * MBS, (step + 1) * GBS, MBS * topology.dp)
    return [reference_training.batch(tokens, range(i, i + MBS)) for i in firsts]


def _eval_batch(length: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    inputs, labels = reference_training.batch(token_stream(), range(STEPS * GBS, STEPS * GBS + MBS))
    return [(inputs[:, :length].contiguous(), labels[:, :length].contiguous())]


def _graphs() -> int:
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def train_case(topology: ParallelTopology, mode: str, sp: bool, recompute: str, zero: int) -> dict[str, Any]:
    """STEPS steps and three evaluations with compile=mode; what the test compares and checks."""
    from torch._dynamo.utils import counters

    os.environ.setdefault("LOCAL_RANK", "0")  # read by DeepSpeed
    torch._dynamo.reset()
    counters.clear()
    engine = build_test_engine(
        CONFIG, topology, micro_batch_size=MBS, global_batch_size=GBS, sequence_parallel=sp, recompute=recompute,
        zero_stage=zero, seed=SEED, lr=LR, compile=mode,
    )  # fmt: skip
    blocks = [m for m in engine.engine.module.modules() if isinstance(m, BloomBlock)]
    compiled = sum("forward" in vars(block) for block in blocks)
    losses = [engine.train_batch(_micro_batches(topology, 0)).loss]
    after_first_step = _graphs()
    with torch._dynamo.config.patch(error_on_recompile=True):
        losses += [engine.train_batch(_micro_batches(topology, step)).loss for step in range(1, STEPS - 1)]
    lengths = EVAL_LENGTHS[topology.pp]
    evals = [engine.eval_sums(_eval_batch(length)) for length in lengths[:2]]
    after_eval = _graphs()
    with torch._dynamo.config.patch(error_on_recompile=True):
        evals.append(engine.eval_sums(_eval_batch(lengths[2])))
        losses.append(engine.train_batch(_micro_batches(topology, STEPS - 1)).loss)
    out = {
        "blocks": len(blocks), "compiled": compiled, "losses": losses, "weights": engine.model_shard(),
        "gathers_overlapped": engine.param_gather is not None,
        "graphs_after_first_step": after_first_step, "graphs_after_eval": after_eval, "graphs_at_end": _graphs(),
        "graph_breaks": sum(counters["graph_break"].values()), "evals": evals,
    }  # fmt: skip
    engine.close()
    return out


def compare_case(topology: ParallelTopology, sp: bool, recompute: str, zero: int) -> dict[str, Any]:
    return {mode: train_case(topology, mode, sp, recompute, zero) for mode in ("off", "on")}


@pytest.fixture(scope="module")
def floor() -> Any:
    _, measured = measure_floor(lambda order: reference_training.train(RECIPE, token_stream(), order)[1])
    check_floor(measured, QUANTITIES)
    return measured


LAUNCHES = {
    # (tp, pp, dp): sequence parallel, recompute (selective: a checkpoint region inside the traced block; full: the
    # pipeline's checkpoint around the compiled block), ZeRO stage. dp x cp = 1 and pp = 1 step through the
    # single-replica engine, the others through DeepSpeed's; at dp = 2 with ZeRO 1 each block's forward pre-hook
    # waits for its overlapped parameter gather, which must stay outside the compiled graph.
    (1, 1, 1): (False, "selective", 0),
    (2, 1, 1): (True, "selective", 0),
    (1, 2, 1): (False, "full", 0),
    (1, 1, 2): (False, "none", 1),
}


@pytest.mark.parametrize(("tp", "pp", "dp"), list(LAUNCHES))
def test_compiled_blocks_train_like_eager_ones(tp: int, pp: int, dp: int, floor: Any) -> None:
    sp, recompute, zero = LAUNCHES[(tp, pp, dp)]
    ranks = run_distributed(compare_case, tp * pp * dp, sp, recompute, zero, tp=tp, pp=pp, dp=dp, timeout_s=900.0)
    for rank, result in enumerate(ranks):
        eager, compiled = result["off"], result["on"]
        where = f"tp={tp} pp={pp} dp={dp} rank {rank}"
        assert compiled["gathers_overlapped"] == (zero > 0 and dp > 1), where
        assert eager["compiled"] == 0 and eager["graphs_at_end"] == 0, where
        assert compiled["blocks"] > 0 and compiled["compiled"] == compiled["blocks"], where
        assert compiled["graph_breaks"] == 0, where
        # One graph serves every block of the stage: the blocks are alike, parameters are the graph's inputs.
        assert compiled["graphs_after_first_step"] == 1, (where, compiled["graphs_after_first_step"])
        # Evaluation's two shapes add one graph each at most (the second with symbolic sizes); the third shape and
        # the last training step add none (error_on_recompile would have raised in the rank).
        assert 1 <= compiled["graphs_after_eval"] - 1 <= 2, (where, compiled["graphs_after_eval"])
        assert compiled["graphs_at_end"] == compiled["graphs_after_eval"], where
        for key in QUANTITIES:
            assert_within(compiled[key], eager[key], key, floor, FACTOR, f"{where}: compiled vs eager {key}")
        # evaluation sums are sums of the same token losses: the losses' floor
        sums, tokens = zip(*compiled["evals"], strict=True)
        want_sums, want_tokens = zip(*eager["evals"], strict=True)
        assert tokens == want_tokens, where
        assert_within(list(sums), list(want_sums), "losses", floor, FACTOR, f"{where}: compiled vs eager eval sums")
