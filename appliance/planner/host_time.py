"""The host's share of a GPU training step: the kernels a rank launches in a step, at the host's cost per launch,
and what of it the step shows.

A GPU rank's host queues kernels and the device runs them behind it. The single-replica step reads one figure on the
host per step, at its end (`bench --profile` of bloom-560m on an H200: one cudaStreamSynchronize and one
device-to-host copy a step), so host and device overlap within a step and never across steps. The optimizer comes
last: a handful of multi-tensor launches, each far longer on the device than on the host, with the step's one sync
right behind them, so its device time runs after the host has queued everything and is never hidden:

    step = max(device time - optimizer, host time) + optimizer

A device-bound step (host time below the rest of the device time) is its device time; a host-bound one is the host
time plus the optimizer's tail. timing.py adds the difference as the breakdown's "host".

The launch count follows the step's path, as the code issues it now: per micro-batch, each compiled block's GEMMs,
flash attention and inductor's fused kernels, the edges (embedding, LayerNorms, the loss's small ops, the embedding's
backward), the chunked loss's kernels per chunk, and the fold of the gradients into the flat buffer (one multi-tensor
copy and one cast); per step, the norm and clipping's small kernels, fused AdamW's multi-tensor launches per
weight-decay group and the copy of the masters back to the weights (parallel/step/flat_optimizer.py).

Only the compiled dense block's count was measured (the bloom-560m profile), so the term covers the path that runs
it: GPU ranks with compiled blocks (kernel_path.KernelPath.compiled_blocks), no context or 2D tensor parallelism and
no MoE blocks (those stay eager, parallel/parallelize.py). Elsewhere, and on CPU ranks, where the host runs the
kernels itself and the fitted CPU rates already hold its time, the host term is zero.
"""

from __future__ import annotations

import math

from appliance.planner import calibration as cal
from appliance.planner.device import Device
from appliance.planner.kernel_path import KernelPath, loss_chunks
from appliance.planner.layout import Layout
from appliance.planner.model_shape import ModelShape

# Per compiled dense block, forward + backward, one micro-batch. Counted from the code: the block's GEMMs (the
# aten::mm/addmm a BloomBlock's forward and backward dispatch) and the flash attention launches (what
# kernels/flash_attention.py's launchers issue for one forward and its backward, the backward's preprocess of
# delta = rowsum(O * dO) included), both checked against the code by tests/unit/test_planner_host_time.py. Only
# inductor's fused kernels are fitted: the bloom-560m profile at micro-batch 2 (bench/results/2026-11-26-h200-
# bloom-560m-mb2-trainer.json) gives them only inside its total of 1,381 launches a step, so they are the remainder
# after everything counted: (1381 - 24 x 12 GEMMs - the loss's 3 GEMMs - 24 x 4 flash - 1 loss row kernel - 293
# gradient adds (AccumulateGrad's, one per parameter: 879 over 3 steps; removed since) - 2 of the old fold (a cast
# and a zero) - 28 AdamW - 22 step - 24 edges) / 24 = 26. The profile agrees where it itemises: 801 aten::mm and 72
# aten::addmm over 3 steps = 24 x 12 + 3 a step; 24 launches each of the forward, dK/dV and dQ kernels (the
# preprocess, too short for the profile's top kernels, is not listed).
GEMMS_PER_BLOCK = 12  # QKV, dense, h -> 4h, 4h -> h forward; the input and weight gradients of each backward
FLASH_LAUNCHES_PER_BLOCK = 4  # forward; backward: the preprocess (delta), dK/dV and dQ
FUSED_LAUNCHES_PER_COMPILED_BLOCK = 26  # inductor's kernels, forward and backward (the remainder above: fitted)
LAUNCHES_PER_COMPILED_BLOCK = GEMMS_PER_BLOCK + FLASH_LAUNCHES_PER_BLOCK + FUSED_LAUNCHES_PER_COMPILED_BLOCK
# A forward repeated under full recompute: its 4 of the 12 GEMMs and 1 of the 4 flash kernels, so about a third.
RECOMPUTED_FORWARD_SHARE = 1 / 3
# Per micro-batch outside the blocks, forward + backward: the embedding gather and its LayerNorm, ln_f, the loss's
# reductions and scaling, the LayerNorms' backwards, the embedding's backward (its index sort and scatter) and the
# tied weight's two gradients summed.
EDGE_LAUNCHES = 24
# Per chunk of the chunked loss (kernels/chunked_ce.py): the logits GEMM, the fused row kernel, the hidden- and
# weight-gradient GEMMs.
LAUNCHES_PER_LOSS_CHUNK = 4
# Per step in FlatAdamW.step besides AdamW itself: per group the squares and their sum, the stack, sum, sqrt, the
# finiteness verdicts of the norm and the loss, the clipping scale and its guard, the step count, the master copy.
STEP_LAUNCHES = 22
# torch's multi-tensor apply (ATen MultiTensorApply.cuh): chunks of 65,536 elements, at most 320 blocks a launch.
MULTI_TENSOR_CHUNK = 65536
MULTI_TENSOR_BLOCKS_PER_LAUNCH = 320


def multi_tensor_launches(elements: float) -> int:
    """Launches of one multi-tensor op (foreach copy, fused AdamW) over `elements` in 65,536-element chunks. Checked
    on the profile: AdamW over bloom-560m's 559M weights in two groups took 27 + 1 = 28 launches a step."""
    chunks = math.ceil(elements / MULTI_TENSOR_CHUNK)
    return math.ceil(chunks / MULTI_TENSOR_BLOCKS_PER_LAUNCH) if chunks else 0


def host_term_applies(model: ModelShape, layout: Layout, device: Device, kernels: KernelPath) -> bool:
    """Whether the rank runs the measured path: compiled dense blocks on a GPU (the module docstring)."""
    return (
        device.kind in cal.HOST_SECONDS_PER_LAUNCH
        and kernels.compiled_blocks
        and layout.cp == 1
        and layout.tp2d == 1
        and not model.moe_num_experts
    )


def launches_per_step(
    model: ModelShape,
    layout: Layout,
    device: Device,
    kernels: KernelPath,
    *,
    layers: int,
    params: float,
    last_stage: bool,
    tokens: float,
) -> int:
    """Kernel launches one rank issues in a step: `layers` blocks holding `params` parameters on this rank, with the
    loss when `last_stage`, for micro-batches of `tokens` tokens (the module docstring has the parts)."""
    per_block = LAUNCHES_PER_COMPILED_BLOCK
    if layout.recompute == "full":
        per_block += round(RECOMPUTED_FORWARD_SHARE * LAUNCHES_PER_COMPILED_BLOCK)
    per_micro_batch = layers * per_block + EDGE_LAUNCHES
    if last_stage:
        vocab_local = int(model.padded_vocab(layout.tp) / layout.tp)
        chunks = loss_chunks(kernels, tokens, model.hidden, vocab_local, device.act_bytes)
        per_micro_batch += chunks.count * LAUNCHES_PER_LOSS_CHUNK
    fold = multi_tensor_launches(params) + 1  # the gradients into the flat buffer, then its cast to the fp32 sum
    # AdamW's two groups: the matrices (decayed) and the biases and LayerNorm weights, 13 h a block and 2 h for each
    # of the two LayerNorms outside the blocks (one launch either way: far below a launch's 21M elements).
    no_decay = layers * 13 * model.hidden + 4 * model.hidden
    adamw = multi_tensor_launches(params - no_decay) + multi_tensor_launches(no_decay)
    return max(1, layout.micro_batches) * (per_micro_batch + fold) + STEP_LAUNCHES + adamw


def host_seconds(launches: int, device: Device) -> float:
    """Seconds the host spends issuing `launches` (zero on a device kind without a measured cost)."""
    return launches * cal.HOST_SECONDS_PER_LAUNCH.get(device.kind, 0.0)


def exposed_host_seconds(device_s: float, optimizer_s: float, host_s: float) -> float:
    """What the host adds to a step of `device_s` device seconds, of which `optimizer_s` is the optimizer's tail:
    max(device - optimizer, host) + optimizer - device (the module docstring)."""
    return max(0.0, host_s + optimizer_s - device_s)
