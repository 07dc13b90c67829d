"""The host term's launch count (planner/host_time.py): the parts the code issues counted from the code (the block's
GEMMs by a dispatch count, flash attention's launches from its launchers), the one fitted part (inductor's fused
kernels) as the remainder of the bloom-560m profile on one H200 (bench/results/2026-11-26-h200-bloom-560m-mb2-
trainer.json) after them, and where the term applies. Each counter has a positive control: a path it must count
differently."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from appliance.hardware import load_hardware
from appliance.model.bloom import BloomBlock
from appliance.model.config import BloomConfig
from appliance.planner import host_time, load_model_shape, parse_layout
from appliance.planner.device import make_device
from appliance.planner.kernel_path import kernels_for
from appliance.planner.memory import stage_parameters
from appliance.planner.timing import step_time
from kernels import flash_attention
from kernels.launch import H100, recording

PROFILE = Path(__file__).resolve().parents[2] / "bench" / "results" / "2026-11-26-h200-bloom-560m-mb2-trainer.json"
# Launches the profiled step issued that the code issues no more (flat_optimizer.py): AccumulateGrad's in-place add
# per parameter (879 evaluate_function calls over 3 steps), and the old fold's zero of the flat gradients.
REMOVED_ADDS, REMOVED_ZERO = 293, 1


def _launches(mb: int, **layout_keys: str) -> int:
    hardware, model = load_hardware("h200-x1"), load_model_shape("bloom-560m")
    keys = {"tp": "1", "pp": "1", "dp": "1", "mbs": str(mb), "gbs": str(mb), "recompute": "none", "zero": "0"}
    layout = parse_layout(",".join(f"{k}={v}" for k, v in (keys | layout_keys).items()))
    device = make_device(hardware, 1, "bf16")
    return host_time.launches_per_step(
        model, layout, device, kernels_for(device, model), layers=model.layers,
        params=stage_parameters(model, layout, 0), last_stage=True, tokens=mb * 2048,
    )  # fmt: skip


class _Gemms(TorchDispatchMode):
    """Counts the aten::mm and aten::addmm calls dispatched inside it: the GEMM launches of a GPU run."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        if func.overloadpacket in (torch.ops.aten.mm, torch.ops.aten.addmm):
            self.count += 1
        return func(*args, **(kwargs or {}))


def _block_gemms(backward: bool = True) -> int:
    block = BloomBlock(BloomConfig(vocab_size=64, hidden_size=32, n_layer=1, n_head=2))
    x = torch.randn(2, 8, 32, requires_grad=True)
    with _Gemms() as gemms:
        out = block(x)
        if backward:
            torch.autograd.grad(out.square().sum(), [x, *block.parameters()])
    return gemms.count


def _flash_launches(chunk_backward: bool = False) -> list[str]:
    """The kernels flash attention's launchers start for one forward and its backward (autograd through the custom
    ops, as a compiled block's graph calls them), or for context parallel's chunk backward, which is handed delta;
    on meta tensors at bloom-560m's shape, recorded as if on an H100."""
    q, k, v = (torch.empty(2, 16, 2048, 64, dtype=torch.bfloat16, device="meta", requires_grad=True) for _ in "qkv")
    slopes = torch.empty(16, device="meta")
    with recording(H100) as launches:
        if chunk_backward:
            lse, delta = torch.empty(2, 16, 2048, device="meta"), torch.empty(2, 16, 2048, device="meta")
            flash_attention.flash_alibi_attention_backward(torch.empty_like(q), q, k, v, lse, delta, slopes, 0.125)
        else:
            out = flash_attention.flash_alibi_attention(q, k, v, slopes, True)
            torch.autograd.grad(out, (q, k, v), torch.empty_like(out))
    kernels = {
        flash_attention._flash_fwd_kernel: "forward", flash_attention._flash_bwd_preprocess_kernel: "preprocess",
        flash_attention._flash_bwd_dkdv_kernel: "dkdv", flash_attention._flash_bwd_dq_kernel: "dq",
    }  # fmt: skip
    return [kernels[launch.kernel] for launch in launches]


def test_gemms_per_block_are_what_a_block_dispatches() -> None:
    assert _block_gemms() == host_time.GEMMS_PER_BLOCK == 12
    assert _block_gemms(backward=False) == 4  # the positive control: the forward's four projections alone


def test_flash_launches_per_block_are_what_the_launchers_issue() -> None:
    assert _flash_launches() == ["forward", "preprocess", "dkdv", "dq"]
    assert len(_flash_launches()) == host_time.FLASH_LAUNCHES_PER_BLOCK
    # The positive control: the chunk backward is handed delta, so it has no preprocess.
    assert _flash_launches(chunk_backward=True) == ["dkdv", "dq"]


def test_inductors_kernels_are_what_the_profile_leaves_after_the_counted_launches() -> None:
    """The one fitted count: 1,381 launches profiled at micro-batch 2, less everything counted from the code (the
    blocks' GEMMs and flash launches as the tests above count them, the loss's 3 GEMMs and row kernel, the removed
    adds and old fold, AdamW's 28, the step's and the edges'), over 24 blocks."""
    profile = json.loads(PROFILE.read_text())["contenders"]["trainer (the run's engine)"]["profile"]
    blocks = load_model_shape("bloom-560m").layers
    counted = (
        blocks * (_block_gemms() + len(_flash_launches())) + 3 + 1 + REMOVED_ADDS + REMOVED_ZERO + 1 + 28
        + host_time.STEP_LAUNCHES + host_time.EDGE_LAUNCHES
    )  # fmt: skip
    remainder = profile["launches_per_step"] - counted
    assert remainder % blocks == 0 and remainder // blocks == host_time.FUSED_LAUNCHES_PER_COMPILED_BLOCK == 26


def test_adamw_launches_match_the_profile() -> None:
    """The fused AdamW kernel ran 84 times over the profile's 3 steps: 27 launches for the decayed matrices and 1
    for the biases and LayerNorm weights, 65,536-element chunks, 320 a launch."""
    profile = json.loads(PROFILE.read_text())["contenders"]["trainer (the run's engine)"]["profile"]
    adam = next(k for k in profile["top_kernels"] if "FusedAdamMathFunctor" in k["name"])
    model = load_model_shape("bloom-560m")
    no_decay = model.layers * 13 * model.hidden + 2 * model.hidden + 2 * model.hidden
    decayed = model.parameters() - no_decay
    assert host_time.multi_tensor_launches(decayed) + host_time.multi_tensor_launches(no_decay) == adam["calls"] / 3


def test_more_loss_chunks_and_micro_batches_launch_more() -> None:
    """Micro-batch 16's logits exceed 2 GiB: 8 loss chunks of 4 launches where micro-batch 2 has 1."""
    assert _launches(16) - _launches(2) == 7 * host_time.LAUNCHES_PER_LOSS_CHUNK
    two = _launches(2, gbs="4")  # two micro-batches a step: the blocks, edges, loss and fold twice
    assert two - _launches(2) == _launches(2) - host_time.STEP_LAUNCHES - 28


def test_no_host_term_on_cpu_or_off_the_compiled_path() -> None:
    """CPU ranks' host time is their compute (the fitted CPU rates); paths whose blocks stay eager were not measured."""
    model = load_model_shape("bloom-560m")
    layout = parse_layout("tp=1,pp=1,dp=1,mbs=2,gbs=2,recompute=none,zero=0")
    cpu = step_time(layout, load_model_shape("bloom-micro-test"), load_hardware("cpu-laptop-2core"))
    assert cpu.breakdown_s["host"] == 0.0
    device = make_device(load_hardware("h200-x1"), 1, "bf16")
    kernels = kernels_for(device, model)
    assert host_time.host_term_applies(model, layout, device, kernels)
    assert not host_time.host_term_applies(model, layout, device, replace(kernels, compiled_blocks=False))
    assert not host_time.host_term_applies(model, replace(layout, cp=2), device, kernels)
