"""The planner knows experts: a rank's expert memory is E/ep experts per MoE block (ZeRO over dp / ep), the search
tries ep smallest first and keeps the smallest that fits, and the plan shows the MoE cost model's lines."""

from __future__ import annotations

from dataclasses import replace

import pytest

from appliance.hardware.profile import load_hardware
from appliance.planner.layout import Layout, pipeline_partition
from appliance.planner.memory import memory_per_gpu, stage_expert_parameters, stage_moe_blocks
from appliance.planner.model_shape import load_model_shape
from appliance.planner.plan import Plan, make_plan
from appliance.planner.search import expert_parallel_degrees

# BLOOM's cluster and the 176B-active MoE preset; the hand-made layouts are tp = 1: pp 24 is the deepest balanced
# pipeline (72 = 70 blocks + embedding + head), leaving dp 16.
HARDWARE = load_hardware("jean-zay-a100-48n")
MOE = load_model_shape("bloom-moe-176b")


def _layout(ep: int) -> Layout:
    return Layout(1, 24, 16, 1, 2048, 1, "full", False, ep=ep)


def test_expert_memory_per_rank_is_divided_by_ep() -> None:
    partition = pipeline_partition(MOE.layers, 24)
    # Stage 0 holds blocks 0, 1: block 1 is an MoE block (every other block, from block 1).
    assert stage_moe_blocks(MOE, 0, partition) == 1
    one, dense_change = stage_expert_parameters(MOE, _layout(1), 0, partition)
    sixteen, same_change = stage_expert_parameters(MOE, _layout(16), 0, partition)
    assert one == 16 * MOE.expert_parameters() and sixteen == one / 16
    # The dense count loses the one MLP the MoE block does not have and gains the [E, h] gate, whatever ep.
    assert dense_change == same_change == MOE.moe_num_experts * MOE.hidden - MOE.expert_parameters()
    at_1, at_16 = (memory_per_gpu(_layout(ep), MOE, HARDWARE).breakdown_gb for ep in (1, 16))
    assert at_16["weights"] < at_1["weights"] / 3  # the 15 experts a rank no longer holds were most of its weights
    dense = load_model_shape("bloom-176b")
    assert stage_expert_parameters(dense, Layout(1, 24, 16, 1, 2048), 0, partition) == (0.0, 0.0)


def test_ep_candidates_divide_dp_and_the_experts() -> None:
    assert expert_parallel_degrees(MOE, 48) == [1, 2, 4, 8, 16]
    assert expert_parallel_degrees(MOE, 12) == [1, 2, 4]
    assert expert_parallel_degrees(load_model_shape("bloom-176b"), 16) == [1]


@pytest.fixture(scope="module")
def fp16_plan() -> Plan:
    return make_plan(HARDWARE, MOE, precision="fp16")


def test_search_keeps_the_smallest_ep_that_fits(fp16_plan: Plan) -> None:
    # Experts shard over tp like the dense MLP (expert memory / tp), so the fastest fp16 layout is tp = 4, pp = 24,
    # dp = 4, and there the smallest ep that fits.
    layout = fp16_plan.layout
    assert fp16_plan.feasible and (layout.tp, layout.pp, layout.dp, layout.ep) == (4, 24, 4, 4)
    smaller = memory_per_gpu(replace(layout, ep=2), MOE, HARDWARE, precision="fp16")
    assert not smaller.fits, "ep 2 fits: the search should have stopped there"
    notes = "\n".join(fp16_plan.notes)
    assert "expert parallelism ep=4" in notes and "the smallest ep that fits" in notes
    # 4 ep ranks 4 GPUs apart (tp = 4) over nodes of 8 GPUs: 2 nodes, the two-step exchange is modelled cheaper.
    assert "expert all-to-all: hierarchical" in notes
    assert "experts: 4 of 16 per rank in each of 2 MoE layers, each sharded over tp=4" in notes


def test_bf16_fits_once_experts_shard_over_tp() -> None:
    # At tp = 1 nothing fits in bf16 (the fp32 gradient-accumulation buffer: 109.6 GB at pp 24, ep 16); sharding
    # the experts over tp = 2 halves their memory and the plan fits.
    plan = make_plan(HARDWARE, MOE)
    assert plan.feasible and plan.layout.tp > 1 and not plan.layout.sequence_parallel
    assert not memory_per_gpu(_layout(16), MOE, HARDWARE).fits
    assert any("the smallest ep that fits" in note for note in plan.notes)


def test_tp_divides_a_ranks_expert_parameters_but_not_the_replicated_bias() -> None:
    partition = pipeline_partition(MOE.layers, 24)
    h, f = MOE.hidden, MOE.ffn_hidden
    layout = replace(_layout(16), tp=2, dp=8, ep=8)
    experts, dense_change = stage_expert_parameters(MOE, layout, 0, partition)
    assert experts == 2 * ((2 * h * f + f) // 2 + h)  # E/ep = 2 experts, h->f and f->h split, f->h bias whole
    assert dense_change == MOE.moe_num_experts * h - ((2 * h * f + f) // 2 + h)  # the tp = 2 MLP that is not there


def test_the_engine_splits_only_node_aligned_ep_groups() -> None:
    from appliance.parallel.experts.exchange import _node_aligned

    assert _node_aligned([[0, 1, 2, 3], [4, 5, 6, 7]], 2)  # 2 nodes x 2 ranks each
    assert not _node_aligned([[2, 3, 4, 5, 6, 7]], 4)  # 2 ranks on node 0, 4 on node 1: flat instead


# ---- experts with context parallelism -----------------------------------------------------------------------------
def test_search_offers_cp_with_experts() -> None:
    """One node of 8 H100s (GPU ranks, so cp is searched): the MoE preset is evaluated at cp > 1 together with ep."""
    from appliance.planner.search import search_layouts

    result = search_layouts(load_hardware("h100-sxm5-x8-node"), MOE, 64)
    with_cp = {(e.layout.cp, e.layout.ep) for e in result.evaluated if e.layout.cp > 1}
    assert any(ep > 1 for _, ep in with_cp), sorted(with_cp)


def test_cp_neither_splits_nor_repeats_the_experts() -> None:
    """Experts are whole and replicated over cp: at ZeRO 0 (fp32: fp16 at 0 runs stage 1) the weights and optimizer
    states of dp=8, cp=2, ep=4 are those of dp=8, ep=4; at ZeRO 1 the expert states partition over dp x cp / ep, so
    cp = 2 at dp = 8 keeps what dp = 16 at cp = 1 keeps (the same 4 replicas of each expert share them)."""
    states = ("weights", "gradients", "optimizer")

    def breakdown(dp: int, cp: int, zero: int) -> dict[str, float]:
        layout = Layout(1, 24, dp, 1, 2048, zero, "full", False, cp, ep=4)
        return memory_per_gpu(layout, MOE, HARDWARE, precision="fp16" if zero else "fp32").breakdown_gb

    at_cp1, at_cp2 = breakdown(8, 1, 0), breakdown(8, 2, 0)
    assert [at_cp2[k] for k in states] == [at_cp1[k] for k in states]
    assert at_cp2["activations"] < at_cp1["activations"]  # each CP rank holds half of every sequence
    assert [breakdown(8, 2, 1)[k] for k in states] == [breakdown(16, 1, 1)[k] for k in states]
