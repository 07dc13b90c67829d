"""Context parallelism in the planner: memory and time per CP rank, the exchange's bytes, the search choosing cp
when the sequence needs it (and saying why), seq-2048 plans unchanged, and `plan` showing cp.

The cost model is plain float64 arithmetic on the same inputs, so ratios that the formulas make exact are compared
at rel=1e-12 (rounding of a few float operations), not at a measured noise floor."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from appliance import cli
from appliance.errors import BadInput
from appliance.hardware import load_hardware
from appliance.hardware.specs import GIB
from appliance.planner import (
    Layout,
    activation_bytes_per_layer,
    communication_bytes_per_rank,
    format_plan,
    load_model_shape,
    make_plan,
    memory_per_gpu,
    parse_layout,
    step_time,
)
from appliance.planner.context_parallel import attention_share, busiest_attention_share
from appliance.planner.device import cp_link, make_device
from appliance.planner.kernel_path import kernels_for
from appliance.planner.search import search_layouts

H100_NODE = "h100-sxm5-x8-node"
EXACT = 1e-12  # float64 rounding of the same formula evaluated in another order


def _long(name: str, seq_len: int):
    return load_model_shape(name).with_seq_len(seq_len)


# -- memory ---------------------------------------------------------------------------------------------------------


def test_activations_per_rank_fall_by_cp() -> None:
    """bloom-3b at 32K tokens, flash attention, no recompute, one micro-batch: ring keeps exactly 1/cp of the
    activations per rank; Ulysses 1/cp plus the attention output it keeps in both layouts (2 b (s/c) h bytes per
    block). Weights do not change; ZeRO-1's optimizer shards are the same for dp x cp = 8 either way."""
    hw, model = load_hardware(H100_NODE), _long("bloom-3b", 32768)
    b, s, h, L = 1, 32768, model.hidden, model.layers
    plain = memory_per_gpu(Layout(1, 1, 8, b, 64, 1, "none"), model, hw).breakdown_gb
    for cp in (2, 4, 8):
        ring = memory_per_gpu(Layout(1, 1, 8 // cp, b, 64, 1, "none", cp=cp, cp_mode="ring"), model, hw)
        ulysses = memory_per_gpu(Layout(1, 1, 8 // cp, b, 64, 1, "none", cp=cp), model, hw)
        assert ring.breakdown_gb["activations"] == pytest.approx(plain["activations"] / cp, rel=EXACT)
        context = L * 2 * b * (s // cp) * h / GIB
        assert ulysses.breakdown_gb["activations"] == pytest.approx(plain["activations"] / cp + context, rel=EXACT)
        for est in (ring, ulysses):
            assert est.breakdown_gb["weights"] == plain["weights"]
            assert est.breakdown_gb["optimizer"] == pytest.approx(plain["optimizer"], rel=EXACT)
        # the exchange buffers: Ulysses 3 act e, ring 2 K/V + 2 dK/dV chunks in flight and an fp32 dQ (8 act + 4) e
        e = b * (s // cp) * h
        assert ulysses.breakdown_gb["cp_buffers"] == pytest.approx(3 * 2 * e / GIB, rel=EXACT)
        assert ring.breakdown_gb["cp_buffers"] == pytest.approx((8 * 2 + 4) * e / GIB, rel=EXACT)
    assert plain["cp_buffers"] == 0.0


def test_materialised_scores_fall_by_cp_too() -> None:
    """CPU ranks keep [s, s] scores: with s/cp queries per rank (ring) or a/cp heads (Ulysses), the s^2 term
    falls by cp like the rest, so the whole per-block figure does."""
    model = load_model_shape("bloom-tiny-cpu")
    torch_path = kernels_for(make_device(load_hardware("cpu-laptop-2core"), 2), model)
    s = model.seq_len
    whole = activation_bytes_per_layer(model, 1, 1, "none", False, 4, s, kernels=torch_path)
    half = activation_bytes_per_layer(model, 1, 1, "none", False, 4, s, kernels=torch_path, cp=2)
    assert half == pytest.approx(whole / 2, rel=EXACT)


def test_cp_lets_a_long_sequence_fit() -> None:
    """bloom-7b1 at 32K on one H100 node without recompute: one whole sequence per rank (cp=1) does not fit in
    80 GB; split over 4 ranks it does."""
    hw, model = load_hardware(H100_NODE), _long("bloom-7b1", 32768)
    whole = memory_per_gpu(Layout(1, 1, 8, 1, 512, 2, "none"), model, hw)
    split = memory_per_gpu(Layout(1, 1, 2, 1, 512, 2, "none", cp=4, cp_mode="ring"), model, hw)
    assert not whole.fits and split.fits
    assert whole.breakdown_gb["activations"] > whole.capacity_gb > split.total_gb


# -- exchange bytes and time ----------------------------------------------------------------------------------------


def test_exchange_bytes_by_hand() -> None:
    """bloom-micro-test (s 32, h 64, 2 blocks), tp=2 cp=2, micro-batch 1, 4 micro-batches, fp32 (4 bytes).
    One of q, k, v or the attention output on a rank: e = b (s/c) h / t = 1 x 16 x 64 / 2 = 512 elements, 2048 B.
    Ulysses: 4 all-to-alls each sending (c-1)/c = 1/2 of it, forward and again backward: 4096 + 4096 per block.
    Ring: K, V (2 x 2048) c-1 = 1 time forward, K, V, dK, dV (4 x 2048) backward: 4096 + 8192 per block.
    Per step: 4 micro-batches x 2 blocks; full recompute repeats the forward's exchange."""
    model = load_model_shape("bloom-micro-test")
    counts = {
        (mode, recompute): communication_bytes_per_rank(
            Layout(2, 1, 1, 1, 4, 0, recompute, cp=2, cp_mode=mode), model, stage=0, act_bytes=4, param_bytes=4
        )
        for mode in ("ulysses", "ring")
        for recompute in ("none", "full")
    }
    assert counts["ulysses", "none"]["cp_exchange"] == 4 * 2 * (4096 + 4096)
    assert counts["ring", "none"]["cp_exchange"] == 4 * 2 * (4096 + 8192)
    assert counts["ulysses", "full"]["cp_exchange"] == 4 * 2 * (2 * 4096 + 4096)
    assert counts["ring", "full"]["cp_exchange"] == 4 * 2 * (2 * 4096 + 8192)
    # TP all-reduces carry the rank's s/c tokens: 4 per block + embedding + LM head, 2(t-1)/t = 1x of 16 x 64 x 4 B
    assert counts["ulysses", "none"]["tp_allreduce"] == 4 * (2 * 4 + 2) * 16 * 64 * 4
    # Gradients reduce over dp x cp = 2 ranks: the same bytes as dp=2 without CP
    plain = communication_bytes_per_rank(Layout(2, 1, 2, 1, 4, 0, "none"), model, stage=0, act_bytes=4)
    assert plain["cp_exchange"] == 0.0 and plain["dp_reduce"] > 0
    assert counts["ring", "none"]["dp_reduce"] == plain["dp_reduce"]
    for c in counts.values():
        assert c["total"] == pytest.approx(sum(v for k, v in c.items() if k != "total"))


def test_compute_per_rank_falls_by_cp() -> None:
    """Same micro-batches per step (dp fixed), cp=2 Ulysses: the GEMMs run half the tokens at the same width
    (min(tokens, h/t) = h) and the attention half the causal work (a/cp heads over the whole square)."""
    hw, model = load_hardware(H100_NODE), _long("bloom-3b", 32768)
    one = step_time(Layout(1, 1, 4, 1, 64, 1, "none"), model, hw).breakdown_s
    two = step_time(Layout(1, 1, 4, 1, 64, 1, "none", cp=2), model, hw).breakdown_s
    assert two["gemm"] == pytest.approx(one["gemm"] / 2, rel=EXACT)
    assert two["attention"] == pytest.approx(one["attention"] / 2, rel=EXACT)
    assert one["cp_comm"] == 0.0 and two["cp_comm"] > 0


def test_causal_balance() -> None:
    """Piece i of n holds i + 1/2 units of causal work. Zigzag (rank r: pieces r and 2c-1-r) gives every rank 2c of
    the 2c^2 units; contiguous pieces leave the last rank c - 1/2 of c^2/2, (2c-1)/c times the average."""
    for c in (2, 4, 8):
        assert busiest_attention_share(c, 2 * c, zigzag=True) == pytest.approx(1 / c, rel=EXACT)
        assert busiest_attention_share(c, c, zigzag=False) == pytest.approx((2 * c - 1) / c**2, rel=EXACT)
        assert attention_share(Layout(1, 1, 1, cp=c, cp_mode="ring")) == pytest.approx(1 / c, rel=EXACT)
        assert attention_share(Layout(1, 1, 1, cp=c)) == 1 / c


def test_ulysses_all_to_all_time_by_hand() -> None:
    """bloom-7b1 at 32K, tp=1 cp=4 Ulysses on NVLink, no recompute: per block and micro-batch 4 all-to-alls of
    (c-1)/c x 2 e bytes each way, e = 8192 x 4096, each with c-1 message latencies, not overlapped; 30 blocks x
    256 micro-batches."""
    hw, model = load_hardware(H100_NODE), _long("bloom-7b1", 32768)
    layout = Layout(1, 1, 2, 1, 512, 2, "none", cp=4)
    link = cp_link(hw, make_device(hw, 8), 1, 4)
    assert link.kind == "nvlink"
    one_way = 4 * 3 / 4 * 2 * 8192 * 4096 / link.bandwidth + 4 * 3 * link.latency
    expected = 30 * 256 * 2 * one_way
    assert step_time(layout, model, hw).breakdown_s["cp_comm"] == pytest.approx(expected, rel=EXACT)


def test_ring_hides_its_exchange_at_long_sequences_only() -> None:
    """Ring's transfer of one K, V chunk runs under the attention of the chunk already there: hidden at 32K tokens
    on NVLink (the chunk's attention grows with s^2, the transfer with s), exposed at 2K across nodes."""
    node = load_hardware(H100_NODE)
    long_ring = Layout(1, 1, 2, 1, 512, 2, "none", cp=4, cp_mode="ring")
    assert step_time(long_ring, _long("bloom-7b1", 32768), node).breakdown_s["cp_comm"] == 0.0
    cluster, model = load_hardware("jean-zay-a100-48n"), load_model_shape("bloom-7b1")
    short_ring = Layout(4, 1, 24, 1, 2400, 1, "none", cp=4, cp_mode="ring")  # tp x cp = 16 > 8 GPUs per node
    assert cp_link(cluster, make_device(cluster, 384), 4, 4).kind == cluster.inter_node
    assert cp_link(cluster, make_device(cluster, 384), 2, 4).kind == "nvlink"
    assert step_time(short_ring, model, cluster).breakdown_s["cp_comm"] > 0


# -- search and plan ------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def plan_32k():
    return make_plan(load_hardware(H100_NODE), load_model_shape("bloom-7b1"), seq_len=32768)


def test_32k_plan_on_one_h100_node_splits_sequences_and_says_why(plan_32k) -> None:
    """`plan --hardware h100-sxm5-x8-node --model bloom-7b1 --seq-len 32768`: the plan splits each sequence over
    4 ranks (ring), and says what it beat: the fastest layout without CP (TP + SP) is predicted ~18% slower."""
    lay = plan_32k.layout
    assert plan_32k.feasible and lay.cp > 1 and lay.world_size == 8
    why = plan_32k.notes[1]
    assert why.startswith(f"context parallel cp={lay.cp} ({lay.cp_mode})")
    assert "the fastest layout without CP" in why and "slower" in why
    assert any(n.startswith("context parallel exchange:") for n in plan_32k.notes)
    beaten = plan_32k.rejected[0]
    assert beaten["layout"]["cp"] == 1 and beaten["reason"].endswith("the fastest layout without context parallelism")
    text = format_plan(plan_32k)
    assert f"cp={lay.cp},cp_mode={lay.cp_mode}" in text and f"{lay.sequence_chunks} pieces per sequence" in text
    doc = plan_32k.to_json()
    assert (doc["layout"]["cp"], doc["layout"]["cp_mode"]) == (lay.cp, lay.cp_mode)
    assert "cp_comm" in doc["time_breakdown_s"]


def test_cp_is_chosen_when_nothing_else_fits() -> None:
    """bloom-560m on 1M-token sequences, 8 GPUs of 24 GB: no cp=1 layout fits (the leanest, TP=8 with SP and full
    recompute, still holds 131K tokens per rank); the plan says so, with the activations."""
    hw = replace(load_hardware(H100_NODE), gpu_memory_gb=24)
    plan = make_plan(hw, load_model_shape("bloom-560m"), seq_len=1 << 20, global_batch_size=64)
    assert plan.feasible and plan.layout.cp > 1
    why = plan.notes[1]
    assert "without CP no layout fits" in why and "> 24.0 GiB" in why and "activations" in why
    beaten = plan.rejected[0]
    assert beaten["layout"]["cp"] == 1 and "the leanest layout without context parallelism" in beaten["reason"]


# What the planner chose before it knew context parallelism (commit 9dfefd9), default sequence lengths, and the
# step time it gave then. Since then the chunked loss also charges the [V/t, h] weight traffic of its chunks
# (kernel_path.LossChunks.weight_passes) at the memory rate, once per micro-batch slot of the last stage, which is
# the slowest stage in each of these plans: (m + p - 1) slots x passes x V/t x h x act bytes / (memory_bw x 0.8).
# GPU chunks: the whole micro-batch when its bf16 logits fit 2 GiB, else 4096 tokens (2^31 / (250,880 x 2 B) =
# 4279 -> 4096); passes: 3 for one chunk, 4n + 1 for n. CPU: 512-token chunks (2^22 / 8192) of 1024 tokens, fp32.
# The H100 rows' first figures are those of the H100/H200 GEMM and attention efficiencies refitted to one H200's
# bloom-560m steps (calibration.py; was 5.5856646 and 11.674272): same layouts, the GEMMs faster.
BEFORE_CP = [
    # m = 512 / (8 x 8) = 8; 8 x 2048 tokens = 4 chunks, 17 passes
    ("h100-sxm5-x8-node", "bloom-3b", None, "tp=1,pp=1,dp=8,mbs=8,gbs=512,zero=2,recompute=none,sp=0",
     4.7107528 + 8 * 17 * 250880 * 2560 * 2 / (3.35e12 * 0.8)),
    # m = 512 / (4 x 8) = 16; 4 x 2048 tokens = 2 chunks, 9 passes
    ("h100-sxm5-x8-node", "bloom-7b1", None, "tp=1,pp=1,dp=8,mbs=4,gbs=512,zero=2,recompute=none,sp=0",
     9.9751792 + 16 * 9 * 250880 * 4096 * 2 / (3.35e12 * 0.8)),
    ("a100-80gb-x8-node", "bloom-7b1", None, "tp=1,pp=1,dp=8,mbs=4,gbs=512,zero=2,recompute=none,sp=0",
     29.236664 + 16 * 9 * 250880 * 4096 * 2 / (2.039e12 * 0.8)),
    # m = 2048 / (2 x 8) = 128, p = 12: 139 slots; 2 x 2048 tokens x 62,720 x 2 B = 514 MB, one chunk, 3 passes
    ("jean-zay-a100-48n", "bloom-176b", 2048, "tp=4,pp=12,dp=8,mbs=2,gbs=2048,zero=1,recompute=none,sp=1",
     74.228319 + 139 * 3 * 62720 * 14336 * 2 / (2.039e12 * 0.8)),
    # m = 16 / (8 x 2) = 1; 2 chunks, 9 passes of the fp32 weight at one core's 10 GB/s
    ("cpu-laptop-2core", "bloom-tiny-cpu", None, "tp=1,pp=1,dp=2,mbs=8,gbs=16,zero=0,recompute=none,sp=0",
     0.42119573 + 1 * 9 * 8192 * 128 * 4 / (10e9 * 0.8)),
]  # fmt: skip


@pytest.mark.parametrize(("hw", "model", "gbs", "layout", "step_s"), BEFORE_CP)
def test_default_sequence_plans_are_unchanged(hw: str, model: str, gbs: int | None, layout: str, step_s: float):
    """At 2048 tokens (128 on CPU) CP never wins: the same layout, at the same predicted step time (8 digits)."""
    plan = make_plan(load_hardware(hw), load_model_shape(model), global_batch_size=gbs)
    assert plan.layout.describe() == layout and plan.layout.cp == 1
    assert plan.time.total_s == pytest.approx(step_s, rel=1e-7)
    assert not any(n.startswith("context parallel") for n in plan.notes)


def test_search_skips_ulysses_where_heads_do_not_split() -> None:
    """20 heads: at tp=1, cp=8 Ulysses would need 20 % 8 == 0; the search tries ring there and says why Ulysses
    was skipped. A given Ulysses layout with the same split is bad input naming the factors."""
    hw = load_hardware(H100_NODE)
    model = replace(load_model_shape("bloom-3b"), heads=20).with_seq_len(32768)  # head size 128
    result = search_layouts(hw, model, 64)
    cp8 = {(e.layout.cp_mode) for e in result.evaluated if e.layout.tp == 1 and e.layout.cp == 8}
    assert cp8 == {"ring"}
    assert any(e.layout.cp_mode == "ulysses" for e in result.evaluated if e.layout.tp == 1 and e.layout.cp == 4)
    for e in result.evaluated:
        assert e.layout.cp_mode == "ring" or (model.heads // e.layout.tp) % e.layout.cp == 0
    reasons = [r for _, r in result.constraint_rejections]
    assert any(
        "cp_mode=ulysses: heads(20) / tp(1) = 20 heads per TP rank is not divisible by cp(8)" in r for r in reasons
    )
    with pytest.raises(BadInput, match=r"heads\(20\) / tp\(2\) = 10 heads per TP rank is not divisible by cp\(4\)"):
        make_plan(hw, model, layout=parse_layout("tp=2,pp=1,dp=1,cp=4"), global_batch_size=64)


def test_search_tries_cp_only_below_the_micro_batch_and_on_gpus() -> None:
    """mbs >= cp is left out: dp x cp DP ranks at mbs/cp do the same per-rank work and memory without an exchange
    (checked here on one pair). CPU ranks run data parallel only."""
    hw, model = load_hardware(H100_NODE), _long("bloom-3b", 32768)
    result = search_layouts(hw, model, 64)
    assert any(e.layout.cp > 1 for e in result.evaluated)
    assert all(e.layout.micro_batch_size < e.layout.cp for e in result.evaluated if e.layout.cp > 1)
    split = Layout(1, 1, 4, 2, 64, 1, "none", cp=2)
    merged = Layout(1, 1, 8, 1, 64, 1, "none")
    a, b = memory_per_gpu(split, model, hw).breakdown_gb, memory_per_gpu(merged, model, hw).breakdown_gb
    for key in ("weights", "optimizer", "logits"):
        assert a[key] == pytest.approx(b[key], rel=EXACT)
    ta, tb = step_time(split, model, hw).breakdown_s, step_time(merged, model, hw).breakdown_s
    assert ta["gemm"] == pytest.approx(tb["gemm"], rel=EXACT)
    assert ta["attention"] == pytest.approx(tb["attention"], rel=EXACT)
    assert ta["cp_comm"] > 0 == tb["cp_comm"]
    cpu = search_layouts(load_hardware("cpu-laptop-2core"), load_model_shape("bloom-tiny-cpu"), 16)
    assert {e.layout.cp for e in cpu.evaluated} == {1}


def test_plan_evaluates_a_given_cp_layout(capsys: pytest.CaptureFixture[str]) -> None:
    """`plan --layout tp=2,pp=1,dp=2,cp=2,cp_mode=ring,...` plans that layout (the micro-batch, which it leaves out,
    the planner's: 1, below cp), in text and in --json."""
    args = ["plan", "--hardware", H100_NODE, "--model", "bloom-7b1", "--seq-len", "32768"]
    layout = ["--layout", "tp=2,pp=1,dp=2,cp=2,cp_mode=ring,zero=2,recompute=none,sp=1"]
    assert cli.main([*args, *layout, "--verbose"]) == 0
    text = capsys.readouterr().out
    assert "Layout: tp=2,pp=1,dp=2,mbs=1," in text and "cp=2,cp_mode=ring" in text
    assert "4 pieces per sequence (ring)" in text
    assert "cp_buffers" in text and "Verdict: FEASIBLE" in text
    assert cli.main([*args, *layout, "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert (doc["layout"]["cp"], doc["layout"]["cp_mode"], doc["layout"]["world_size"]) == (2, "ring", 8)
    assert doc["memory_breakdown_gb"]["cp_buffers"] > 0


def test_a_given_cp_layout_checks_the_sequence_length() -> None:
    """Ring cuts a sequence into 2 cp zigzag pieces: 1004 tokens do not split into 8 (they would into 4)."""
    with pytest.raises(BadInput, match=r"seq_len\(1004\) is not divisible by 8"):
        make_plan(
            load_hardware(H100_NODE),
            load_model_shape("bloom-560m"),
            seq_len=1004,
            layout=parse_layout("tp=1,pp=1,dp=2,cp=4,cp_mode=ring"),
        )
