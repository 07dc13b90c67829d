"""The cost model follows what runs: the kernels of each device (flash attention on GPUs, the materialised torch
path on CPU ranks, the chunked cross entropy), the overlap the DeepSpeed config and the engine really do, and the
precision of the plan (bf16, fp16, fp32)."""

from __future__ import annotations

import ast
from dataclasses import replace
from pathlib import Path

import pytest

from appliance.errors import BadInput
from appliance.hardware import load_hardware
from appliance.parallel.step.deepspeed_config import deepspeed_config
from appliance.planner import (
    Layout,
    activation_bytes_per_layer,
    load_model_shape,
    load_reference,
    make_plan,
    memory_per_gpu,
    parse_layout,
    state_bytes,
    step_time,
    timing,
    train_settings,
)
from appliance.planner import calibration as cal
from appliance.planner.device import make_device
from appliance.planner.kernel_path import (
    FLASH,
    FLASH_MAX_HEAD_DIM,
    LAYER_NORM_MAX_ROW,
    MATERIALISED,
    MEGATRON_DEEPSPEED,
    kernels_for,
)
from appliance.planner.memory import reduce_bucket_bytes
from appliance.planner.search import search_layouts

ROOT = Path(__file__).resolve().parents[2]
GIB = 2**30


def _constant(path: Path, name: str) -> object:
    """A module-level constant read from source (the kernel modules import Triton, which CPU machines lack)."""
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == name for t in node.targets):
            return ast.literal_eval(node.value)
    raise AssertionError(f"{path} has no {name}")


def test_kernel_limits_are_the_kernels_own() -> None:
    assert _constant(ROOT / "kernels/flash_attention.py", "MAX_HEAD_DIM") == FLASH_MAX_HEAD_DIM
    assert _constant(ROOT / "kernels/layer_norm.py", "MAX_ROW") == LAYER_NORM_MAX_ROW


def test_the_planner_prices_the_loss_with_the_kernels_own_chunk_rule() -> None:
    """One rule, imported by both (kernels/chunk_rule.py), and importing it loads no torch."""
    import subprocess
    import sys

    from appliance.planner import kernel_path
    from kernels import chunk_rule, chunked_ce

    assert kernel_path.auto_chunk_size is chunk_rule.auto_chunk_size is chunked_ce.auto_chunk_size
    code = "import sys, appliance.planner.kernel_path; print('torch' in sys.modules)"
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    assert loaded.stdout.strip() == "False"


def test_kernels_follow_the_device_and_the_head_width() -> None:
    a100, cpu = load_hardware("a100-80gb-x1"), load_hardware("cpu-laptop-2core")
    bloom = load_model_shape("bloom-560m")  # 64-wide heads
    assert kernels_for(make_device(a100, 1), bloom).attention == FLASH
    assert kernels_for(make_device(cpu, 2), load_model_shape("bloom-tiny-cpu")).attention == MATERIALISED
    wide = replace(bloom, heads=4)  # 256-wide heads: flash does not take them, the torch path runs instead
    assert kernels_for(make_device(a100, 1), wide).attention == MATERIALISED
    plan = make_plan(a100, wide, layout=parse_layout("tp=1,pp=1,dp=1,mbs=1,recompute=selective"))
    assert plan.feasible and any("materialised" in n for n in plan.notes)


def test_no_score_tensors_under_flash() -> None:
    """bloom-560m (a = 16, h = 1024) at t = 1, b = 1, no recompute: flash keeps 8 + 24 bytes per s b h and an fp32
    logsumexp (4 b a s); nothing s x s, so doubling s doubles every term."""
    model = load_model_shape("bloom-560m")
    flash = kernels_for(make_device(load_hardware("a100-80gb-x1"), 1), model)
    for s in (2048, 4096):
        sbh = s * 1024
        expected = sbh * (8 + 24) + 4 * 16 * s
        assert activation_bytes_per_layer(model, 1, 1, "none", False, 2, s, kernels=flash) == expected
    hw = load_hardware("a100-80gb-x1")
    layout = Layout(1, 1, 1, 1, 8, 0, "none")
    short, long = (memory_per_gpu(layout, model, hw, seq_len=s).breakdown_gb["workspace"] for s in (2048, 4096))
    assert long == pytest.approx(2 * short, rel=1e-12)


def test_cpu_ranks_keep_the_fp32_scores() -> None:
    """The torch path on CPU (fp32): 16 + 48 bytes per s b h, the GeLU twin's 6 more tensors of the fc1 output
    (6 x 4 x f/h = 96 bytes per s b h) and the fp32 softmax output, 4 a s^2 b bytes (its cast back to fp32 is the
    same tensor); the softmax backward's two fp32 [s, s] gradients in the workspace."""
    model = load_model_shape("bloom-560m")
    torch_path = kernels_for(make_device(load_hardware("cpu-laptop-2core"), 2), model)
    s = 2048
    sbh = s * 1024
    expected = sbh * (16 + 48 + 96) + 4 * 16 * s * s
    assert activation_bytes_per_layer(model, 1, 1, "none", False, 4, s, kernels=torch_path) == expected
    # The same path on a GPU in bf16 keeps the fp32 probabilities and their bf16 copy: 6 bytes per score.
    assert activation_bytes_per_layer(model, 1, 1, "none", False, 2, s, kernels=torch_path) == (
        sbh * (8 + 24 + 48) + 6 * 16 * s * s
    )


def test_selective_recompute_is_credited_only_where_it_drops_scores() -> None:
    cpu, model = load_hardware("cpu-laptop-2core"), load_model_shape("bloom-tiny-cpu")
    dims = (1, 1, 2, 8, 16)
    none, selective = (Layout(*dims, 0, r) for r in ("none", "selective"))
    # CPU: selective drops each block's fp32 softmax output, 4 b a s^2 bytes per block (2 blocks, b 8, a 4, s 128)
    saved = 2 * 4 * 8 * 4 * 128 * 128
    got = memory_per_gpu(none, model, cpu).breakdown_gb["activations"]
    got -= memory_per_gpu(selective, model, cpu).breakdown_gb["activations"]
    assert got * GIB == pytest.approx(saved, rel=1e-9)
    assert step_time(selective, model, cpu).breakdown_s["recompute"] > 0
    assert any(e.layout.recompute == "selective" for e in search_layouts(cpu, model, 16).evaluated)

    # GPU, flash: nothing to drop, so nothing is credited or charged, and the search does not offer it.
    a100, bloom = load_hardware("a100-80gb-x8-node"), load_model_shape("bloom-1b7")
    none, selective = (Layout(2, 1, 4, 1, 64, 1, r) for r in ("none", "selective"))
    assert memory_per_gpu(selective, bloom, a100).total_gb == memory_per_gpu(none, bloom, a100).total_gb
    assert step_time(selective, bloom, a100).breakdown_s["recompute"] == 0.0
    assert not any(e.layout.recompute == "selective" for e in search_layouts(a100, bloom, 64).evaluated)
    plan = make_plan(a100, bloom, layout=parse_layout("tp=2,pp=1,dp=4,mbs=1,gbs=64,recompute=selective"))
    assert any("recompute=selective does nothing under flash attention" in n for n in plan.notes)


def test_no_fused_softmax_shape_rejection() -> None:
    """mbs(1) x heads(16) / tp(8) = 2 attention batches: Megatron's fused softmax wants a multiple of 4, and the
    planner used to reject this layout for it. Our kernels take any count."""
    plan = make_plan(
        load_hardware("a100-80gb-x8-node"), load_model_shape("bloom-1b7"), layout=parse_layout("tp=8,pp=1,dp=1,mbs=1")
    )
    assert plan.feasible and plan.reasons == []


def test_chunked_loss_holds_one_chunk_of_logits() -> None:
    """BLOOM-176B's last stage at tp 4, b 2: Megatron's loss kept (2 + 4) x 4096 x 62720 bytes of logits; the chunked
    loss holds one chunk of the 4096 tokens' bf16 logits (4096 x 62,720 x 2 B = 514 MB fit the GPU rule's 2 GiB),
    which become the gradient logits in place, and the bf16 hidden gradient: no fp32 softmax."""
    hw, model = load_hardware("jean-zay-a100-48n"), load_model_shape("bloom-176b")
    layout = Layout(4, 1, 96, 2, 2048 * 3, 1, "full")  # pp = 1: the one stage is the last
    ours = memory_per_gpu(layout, model, hw).breakdown_gb["logits"] * GIB
    theirs = memory_per_gpu(layout, model, hw, kernels=MEGATRON_DEEPSPEED).breakdown_gb["logits"] * GIB
    assert theirs == pytest.approx(6 * 4096 * 62720, rel=1e-12)
    assert ours == pytest.approx(4096 * 62720 * 2 + 2 * 4096 * 14336, rel=1e-12)


def test_overlap_comm_is_credited_only_when_the_config_turns_it_on(monkeypatch: pytest.MonkeyPatch) -> None:
    for dtype in ("bf16", "fp16", "fp32"):
        for zero in (0, 1, 2):
            config = deepspeed_config(
                global_batch_size=64, micro_batch_size=1, dp=8, zero_stage=zero, dtype=dtype, grad_clip=1.0
            )
            assert config["zero_optimization"]["overlap_comm"] is False
    hw, model = load_hardware("a100-80gb-x8-node"), load_model_shape("bloom-1b7")
    layout = Layout(1, 1, 8, 1, 64, 2, "none")
    assert not timing.overlap_comm_configured(layout, "bf16")
    plain = step_time(layout, model, hw).breakdown_s["dp_reduce"]

    monkeypatch.setattr(train_settings, "overlap_comm", lambda zero_stage, dtype: True)
    assert timing.overlap_comm_configured(layout, "bf16")
    assert step_time(layout, model, hw).breakdown_s["dp_reduce"] < plain


def test_the_parameter_gather_hides_under_the_next_forward() -> None:
    # Gathers shorter than forwards: only the first layer's gather shows.
    assert timing._exposed_gather([1.0, 1.0, 1.0], [2.0, 2.0, 2.0]) == 1.0
    # Longer: the forwards wait for the gathers; 3 + 3 gathered by 6, the last forward ends at 7 of 2 forward s.
    assert timing._exposed_gather([3.0, 3.0], [1.0, 1.0]) == 5.0
    hw, model = load_hardware("jean-zay-a100-48n"), load_model_shape("bloom-176b")
    layout = Layout(4, 12, 8, 2, 2048, 1, "full")
    ours = step_time(layout, model, hw).breakdown_s["param_gather"]
    waited = step_time(layout, model, hw, kernels=MEGATRON_DEEPSPEED).breakdown_s["param_gather"]
    # Stage 0 waits for its embedding shard's gather (its first "layer", 0.9 of 4.0 B parameters), not the blocks'.
    assert 0 < ours < 0.9 * waited


def test_precision_follows_the_hardware_and_the_override() -> None:
    a100, cpu = load_hardware("a100-80gb-x1"), load_hardware("cpu-laptop-2core")
    v100 = replace(a100, gpu="V100-SXM2-32GB", gpu_memory_gb=32.0)
    assert (make_device(a100, 1).dtype, make_device(v100, 1).dtype, make_device(cpu, 2).dtype) == (
        "bf16",
        "fp16",
        "fp32",
    )
    assert make_device(a100, 1, "fp16").dtype == "fp16"
    with pytest.raises(BadInput, match="V100-SXM2-32GB has no bf16"):
        make_device(v100, 1, "bf16")
    with pytest.raises(BadInput, match="precision=fp8"):
        make_device(a100, 1, "fp8")


def test_fp16_states_have_no_accumulation_buffer() -> None:
    p = 1e9
    # fp16 gradients accumulate in place: 2 + 2 + 12/dp, no 4-byte buffer.
    assert state_bytes(p, 1, 8, "fp16") == {
        "weights": 2e9,
        "gradients": 2e9,
        "grad_accumulation": 0.0,
        "optimizer": 1.5e9,
    }
    # ZeRO-2: the fp16 gradient partition (2/dp), and one 5e8-element reduce bucket a rank.
    assert state_bytes(p, 2, 8, "fp16")["gradients"] == pytest.approx(2e9 / 8)
    assert reduce_bucket_bytes(2, "fp16") == 2 * 5e8


def test_a_layout_bf16_accounting_rejects_fits_in_fp16() -> None:
    """BLOOM-176B on Jean Zay's 384 A100-80GB at tp 4, pp 6, dp 16, mbs 2. Stage 0 holds 11 blocks and the
    embedding shard: P = 11 x ((12 h^2 + 3h + f)/4 + 6h) + 250880 h / 4 + 2h = 7,682,594,304 parameters. bf16 adds
    the fp32 accumulation buffer, 4P = 28.62 GiB; fp16 runs DeepSpeed's ZeRO optimizer, whose reduce bucket (5e8
    fp16 elements, 1 GB) bf16's BF16_Optimizer does not have: (4P - 1e9) x 1.15 allocator margin = 31.84 GiB."""
    hw, model = load_hardware("jean-zay-a100-48n"), load_model_shape("bloom-176b")
    layout = parse_layout("tp=4,pp=6,dp=16,mbs=2,gbs=2048")
    h, f = 14336, 4 * 14336
    params = 11 * ((12 * h * h + 3 * h + f) / 4 + 6 * h) + 250880 * h / 4 + 2 * h
    assert params == 7_682_594_304
    bf16 = make_plan(hw, model, layout=layout, precision="bf16")
    fp16 = make_plan(hw, model, layout=layout, precision="fp16")
    assert bf16.memory.stage == fp16.memory.stage == 0
    assert bf16.memory.total_gb - fp16.memory.total_gb == pytest.approx(
        (4 * params - 1e9) * (1 + cal.ALLOCATOR_MARGIN) / GIB, rel=1e-12
    )
    assert not bf16.feasible and bf16.memory.total_gb > 80  # 85.5 GB
    assert fp16.feasible and fp16.memory.total_gb < 60  # 52.6 GB
    assert fp16.train.dtype == fp16.device.dtype == "fp16"


def test_the_time_model_follows_the_precision() -> None:
    """fp16 adds each micro-batch's gradients in place (6 bytes per parameter against bf16's 10 into its fp32
    buffer) and reduces them over DP in fp16 (2 bytes against bf16's fp32 4)."""
    hw, model = load_hardware("a100-80gb-x8-node"), load_model_shape("bloom-1b7")
    layout = Layout(1, 1, 8, 1, 64, 0, "none")
    bf16 = step_time(layout, model, hw, precision="bf16").breakdown_s
    fp16 = step_time(layout, model, hw, precision="fp16").breakdown_s
    assert fp16["grad_accumulation"] == pytest.approx(0.6 * bf16["grad_accumulation"], rel=1e-12)
    assert fp16["dp_reduce"] < 0.51 * bf16["dp_reduce"]  # half the bytes; ring latencies stay


def test_reference_run_states_its_precision_and_kernels(tmp_path: Path) -> None:
    ref = load_reference("bloom-176b-jean-zay")
    assert (ref.precision, ref.kernels) == ("bf16", MEGATRON_DEEPSPEED)
    text = (ROOT / "presets/reference/bloom-176b-jean-zay.toml").read_text()
    broken = tmp_path / "ref.toml"
    broken.write_text(text.replace('kernels = "megatron-deepspeed"', 'kernels = "cudnn"'))
    with pytest.raises(BadInput, match="kernels 'cudnn' is not one of megatron-deepspeed"):
        load_reference(str(broken))
