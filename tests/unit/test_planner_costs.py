"""The memory and time model against closed-form formulas worked by hand, and its monotonic properties."""

from __future__ import annotations

import pytest

from appliance.hardware import load_hardware
from appliance.planner import (
    Layout,
    activation_bytes_per_layer,
    communication_bytes_per_rank,
    load_model_shape,
    memory_per_gpu,
    state_bytes,
    step_time,
)
from appliance.planner import calibration as cal
from appliance.planner.kernel_path import MEGATRON_DEEPSPEED
from appliance.planner.memory import reduce_bucket_bytes

GIB = 2**30
SBH = 2048 * 1 * 1024  # bloom-560m at micro-batch 1: s * b * h


@pytest.mark.parametrize(
    ("recompute", "sp", "act_bytes", "expected"),
    [
        # Korthikanti et al. Table 2 with s=2048, b=1, h=1024, a=16, t=2 (5as/(ht) = 80, 5as/h = 160):
        ("none", False, 2, SBH * (10 + 24 / 2 + 80)),
        ("none", True, 2, SBH / 2 * (34 + 160)),
        ("selective", False, 2, SBH * (10 + 24 / 2)),
        ("selective", True, 2, SBH * 34 / 2),
        ("full", False, 2, 2 * SBH),
        ("full", True, 2, 2 * SBH / 2),
        # fp32 activations: tensors double, the three 1-byte masks do not: (18 + 48/t + 9as/(ht)) s b h.
        ("none", False, 4, SBH * (18 + 48 / 2 + 9 * 16 * 2048 / (1024 * 2))),
        ("full", False, 4, 4 * SBH),
    ],
)
def test_activations_match_korthikanti(recompute: str, sp: bool, act_bytes: int, expected: float) -> None:
    """Korthikanti's counts are those of Megatron's kernels (with dropout), which BLOOM-176B ran."""
    model = load_model_shape("bloom-560m")
    got = activation_bytes_per_layer(model, 1, 2, recompute, sp, act_bytes, kernels=MEGATRON_DEEPSPEED)
    assert got == pytest.approx(expected, rel=1e-12)


def test_state_bytes_per_zero_stage() -> None:
    p = 1e9
    assert state_bytes(p, 0, 8, "bf16") == {
        "weights": 2e9,
        "gradients": 2e9,
        "grad_accumulation": 4e9,
        "optimizer": 12e9,
    }
    # BLOOM's bf16 optimizer (ZeRO-1): 2 + 2 + 4 + 12/dp bytes per parameter.
    assert state_bytes(p, 1, 8, "bf16") == {
        "weights": 2e9,
        "gradients": 2e9,
        "grad_accumulation": 4e9,
        "optimizer": 1.5e9,
    }
    # ZeRO-2: fp32 gradients sharded; the bf16 gradients live in one 5e8-element bucket, counted once a rank.
    assert state_bytes(p, 2, 8, "bf16") == {
        "weights": 2e9,
        "gradients": 0.0,
        "grad_accumulation": 0.5e9,
        "optimizer": 1.5e9,
    }
    assert reduce_bucket_bytes(2, "bf16") == 1e9 and reduce_bucket_bytes(1, "bf16") == 0.0
    assert state_bytes(p, 0, 2, "fp32") == {
        "weights": 4e9,
        "gradients": 4e9,
        "grad_accumulation": 0.0,
        "optimizer": 8e9,
    }
    # fp32 under DeepSpeed's ZeRO optimizer: an fp32 master partition beside the moments, and its fp32 bucket.
    assert state_bytes(p, 1, 2, "fp32")["optimizer"] == 6e9 and reduce_bucket_bytes(1, "fp32") == 2e9


def test_memory_of_one_gpu_by_hand() -> None:
    """bloom-560m, one A100, micro-batch 1, full recompute, our kernels (flash attention, chunked cross entropy,
    no dropout): every term written out. Nothing in it grows with s x s."""
    model = load_model_shape("bloom-560m")
    layout = Layout(tp=1, pp=1, dp=1, micro_batch_size=1, global_batch_size=8, zero_stage=0, recompute="full")
    s, b, h, a, v = 2048, 1, 1024, 16, 250880
    sbh = s * b * h
    states = 20 * 559_214_592  # bf16 weights 2 + bf16 grads 2 + fp32 buffer 4 + fp32 master and Adam 12
    stored = 24 * 2 * sbh + 2 * sbh + 2 * sbh  # block inputs, embedding LN input, final LN input
    rebuilt = sbh * (8 + 24) + 4 * b * a * s  # one block without recompute: no masks, no scores; fp32 logsumexp
    workspace = rebuilt + 2 * 2 * sbh + 3 * 2 * sbh + 4 * b * a * s  # + grads in/out, dQ dK dV, fp32 row delta
    # One chunk of the whole micro-batch's bf16 logits (2048 x 250,880 x 2 B = 1.03e9 B fit the GPU's 2 GiB), kept
    # in place as the gradient logits for backward, and the hidden-state gradient.
    logits = 2048 * v * 2 + 2 * sbh
    expected = (states + stored + workspace + logits) * (1 + cal.ALLOCATOR_MARGIN) / GIB + cal.GPU_FIXED_OVERHEAD_GB
    estimate = memory_per_gpu(layout, model, load_hardware("a100-80gb-x1"))
    assert estimate.total_gb == pytest.approx(expected, rel=1e-12)
    assert sum(estimate.breakdown_gb.values()) == pytest.approx(estimate.total_gb)
    assert estimate.fits


def test_memory_of_one_gpu_by_hand_with_megatrons_kernels() -> None:
    """The same layout as BLOOM-176B's kernels would run it: Korthikanti's block with its [s, s] scores and
    dropout masks, the score gradient, the full logits with their fp32 softmax."""
    model = load_model_shape("bloom-560m")
    layout = Layout(tp=1, pp=1, dp=1, micro_batch_size=1, global_batch_size=8, zero_stage=0, recompute="full")
    s, b, h, a, v = 2048, 1, 1024, 16, 250880
    sbh = s * b * h
    states = 20 * 559_214_592
    stored = 24 * 2 * sbh + (2 + 1) * sbh + 2 * sbh  # block inputs, embedding LN input + mask, final LN input
    workspace = sbh * (10 + 24 + 5 * a * s / h) + 2 * 2 * sbh + 2 * b * a * s * s  # one block rebuilt + grads
    logits = (2 + 4) * s * b * v  # bf16 logits and the fp32 softmax
    expected = (states + stored + workspace + logits) * (1 + cal.ALLOCATOR_MARGIN) / GIB + cal.GPU_FIXED_OVERHEAD_GB
    estimate = memory_per_gpu(layout, model, load_hardware("a100-80gb-x1"), kernels=MEGATRON_DEEPSPEED)
    assert estimate.total_gb == pytest.approx(expected, rel=1e-12)


def test_bloom_stage_zero_is_fullest() -> None:
    """1F1B: stage 0 keeps p = 12 micro-batches in flight; it also holds the embedding."""
    estimate = memory_per_gpu(
        Layout(4, 12, 8, 2, 2048, 1, "full"), load_model_shape("bloom-176b"), load_hardware("jean-zay-a100-48n")
    )
    assert (estimate.stage, estimate.in_flight) == (0, 12)


MONOTONIC_CASES = [
    ("jean-zay-a100-48n", "bloom-176b", (4, 12, 8, 2, 2048)),
    ("a100-80gb-x8-node", "bloom-7b1", (2, 1, 4, 1, 512)),
    ("h100-sxm5-x8-node", "bloom-1b7", (4, 2, 1, 2, 64)),
    ("cpu-laptop-2core", "bloom-tiny-cpu", (1, 1, 2, 8, 16)),
]


@pytest.mark.parametrize(("hw_name", "model_name", "dims"), MONOTONIC_CASES)
def test_more_recompute_means_less_memory_and_more_time(hw_name: str, model_name: str, dims: tuple) -> None:
    """With [s, s] scores (CPU ranks; Megatron's kernels anywhere) each recompute level trades time for memory.
    Under flash attention selective recompute has nothing to drop: it costs and saves nothing."""
    hw, model = load_hardware(hw_name), load_model_shape(model_name)
    for kernels in (None, MEGATRON_DEEPSPEED):
        flash = hw.has_gpus and kernels is None
        for sp in (False, True) if dims[0] > 1 else (False,):
            layouts = [
                Layout(*dims, zero_stage=1, recompute=r, sequence_parallel=sp) for r in ("none", "selective", "full")
            ]
            memory = [memory_per_gpu(lay, model, hw, kernels=kernels).total_gb for lay in layouts]
            times = [step_time(lay, model, hw, kernels=kernels).total_s for lay in layouts]
            if flash:
                assert memory[0] == memory[1] > memory[2], memory
                assert times[0] == times[1] < times[2], times
            else:
                assert memory[0] > memory[1] > memory[2], memory
                assert times[0] < times[1] < times[2], times


@pytest.mark.parametrize(
    ("hw_name", "model_name", "pp", "recompute"),
    [
        ("a100-80gb-x8-node", "bloom-7b1", 1, "none"),
        ("a100-80gb-x8-node", "bloom-7b1", 2, "selective"),
        ("jean-zay-a100-48n", "bloom-176b", 12, "full"),
    ],
)
def test_more_tp_means_less_memory_per_gpu(hw_name: str, model_name: str, pp: int, recompute: str) -> None:
    hw, model = load_hardware(hw_name), load_model_shape(model_name)
    memory = [memory_per_gpu(Layout(tp, pp, 1, 1, 8, 1, recompute), model, hw).total_gb for tp in (1, 2, 4, 8)]
    assert memory == sorted(memory, reverse=True) and len(set(memory)) == 4, memory


def test_time_breakdown_sums_and_bubble_is_p_minus_1_over_m() -> None:
    layout = Layout(4, 12, 8, 2, 2048, 1, "full")
    t = step_time(layout, load_model_shape("bloom-176b"), load_hardware("jean-zay-a100-48n"))
    assert sum(t.breakdown_s.values()) == pytest.approx(t.total_s)
    per_microbatch = ("gemm", "attention", "elementwise", "recompute", "tp_comm", "pp_p2p", "grad_accumulation")
    work = sum(t.breakdown_s[k] for k in per_microbatch)
    assert t.breakdown_s["bubble"] == pytest.approx(work * (12 - 1) / 128)


def test_communication_bytes_by_hand() -> None:
    """bloom-micro-test, tp=2 pp=2 dp=2, micro-batch 1, global batch 8 (4 micro-batches), fp32 CPU ranks."""
    model = load_model_shape("bloom-micro-test")
    layout = Layout(2, 2, 2, 1, 8, 0, "none")
    activation = 4 * 32 * 1 * 64  # fp32 s b h
    counts = communication_bytes_per_rank(layout, model, stage=0, act_bytes=4, param_bytes=4)
    # 4 all-reduces per block + the embedding's forward one, ring over 2 ranks sends (2-1)/2 * 2 = 1x the tensor.
    assert counts["tp_allreduce"] == 4 * (4 + 1) * activation
    assert counts["pp_p2p"] == 4 * 1 * activation  # stage 0 only sends forward
    h, f = 64, 256
    block = (4 * h * h + 2 * h * f + 3 * h + f) / 2 + 6 * h
    params = block + 512 * h / 2 + 2 * h  # one block + vocab shard (512 rows padded for TP 2) + embedding LN
    assert counts["dp_reduce"] == pytest.approx(2 * (2 - 1) / 2 * 4 * params)
    assert counts["tied_embedding"] == 4 * 512 * h / 2
    assert counts["total"] == pytest.approx(sum(v for k, v in counts.items() if k != "total"))


def test_bloom_tp_bytes() -> None:
    """Middle stage: 6 blocks x 6 all-reduces (2 forward, 2 recompute, 2 backward) x 128 micro-batches of
    2 s b h bf16 bytes, a TP-4 ring sending 2 * 3/4 of each."""
    counts = communication_bytes_per_rank(Layout(4, 12, 8, 2, 2048, 1, "full"), load_model_shape("bloom-176b"), stage=1)
    assert counts["tp_allreduce"] == pytest.approx(128 * 6 * 6 * 1.5 * 2 * 2048 * 2 * 14336)
    assert counts["pp_p2p"] == pytest.approx(128 * 2 * 2 * 2048 * 2 * 14336)


def test_bf16_and_fp16_at_zero_0_are_priced_as_the_stage_1_deepspeed_runs() -> None:
    """DeepSpeed's config maps ZeRO 0 to stage 1 in bf16 and fp16 (train_settings.engine_zero_stage, the one rule
    both read): the planner's memory and step time of BLOOM's layout at zero=0 are those at zero=1, in fp32 they
    differ (its stage 0 runs, unsharded)."""
    from dataclasses import replace as with_fields

    from appliance.hardware import load_hardware
    from appliance.parallel.step.deepspeed_config import deepspeed_config
    from appliance.planner import load_model_shape, memory_per_gpu
    from appliance.planner.layout import parse_layout
    from appliance.planner.timing import step_time

    hardware, model = load_hardware("jean-zay-a100-48n"), load_model_shape("bloom-176b")
    one = parse_layout("tp=4,pp=12,dp=8,mbs=2,gbs=2048,zero=1,recompute=none,sp=1")
    zero = with_fields(one, zero_stage=0)
    for dtype in ("bf16", "fp16"):
        assert memory_per_gpu(zero, model, hardware, precision=dtype) == memory_per_gpu(one, model, hardware,
                                                                                        precision=dtype)  # fmt: skip
        assert step_time(zero, model, hardware, precision=dtype) == step_time(one, model, hardware, precision=dtype)
        config = deepspeed_config(global_batch_size=2048, micro_batch_size=2, dp=8, zero_stage=0, dtype=dtype,
                                  grad_clip=1.0, pipeline=True)  # fmt: skip
        assert config["zero_optimization"]["stage"] == 1
    fp32 = (memory_per_gpu(layout, model, hardware, precision="fp32").total_gb for layout in (zero, one))
    assert next(fp32) > next(fp32)
