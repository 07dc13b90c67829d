"""The cost model's tunable constants, each with where it comes from. Facts about hardware live in
appliance/hardware/specs.py; this file holds what we assume or fitted on top of them.

The A100 numbers are fitted once against BLOOM-176B's published run (presets/reference/bloom-176b-jean-zay.toml:
TP4 PP12 DP8, micro-batch 2, global batch 2048, full recompute on 384 A100-80GB: 104.7 s per step, 149.8
TFLOPs per GPU, about 60 GB per GPU). Other GPU families scale from them as stated below, and the CPU rate was
measured with a tiny BLOOM block on one core of a 2-core AMD EPYC laptop-class VM (37 GFLOP/s at hidden 128,
54 GFLOP/s at hidden 256).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Efficiency:
    gemm: float  # fraction of the dense peak a large, well-shaped GEMM reaches in training
    gemm_half_width: float  # GEMM width (smallest dimension) at which the rate halves: eff = gemm * n / (n + this)
    attention: float  # the batched QK^T / AV products relative to `gemm` at head_dim 128 (smaller K, ALiBi bias)
    memory: float  # fraction of the memory bandwidth elementwise kernels reach


# A100: fitted to BLOOM-176B (see the module docstring). Other GPUs: the A100 figure times 0.9, an assumption.
A100_EFFICIENCY = Efficiency(gemm=0.76, gemm_half_width=256.0, attention=0.60, memory=0.80)
# H100/H200 (one compute die: the H200 adds memory, not tensor cores): fitted to bloom-560m's step on one H200 at
# micro-batches 2 and 16 (bench/results/2026-11-26-h200-bloom-560m-mb{2,16}-trainer.json, bf16, seq 2048, compiled
# blocks; micro-batch 8 is held out, tests/unit/test_planner_h200_steps.py), in three steps:
# - attention: the flash kernels took 7.356 ms a step at micro-batch 2 in the profile (forward 6.133, dK/dV 9.557,
#   dQ 6.379 ms over 3 steps); `attention` is set so the term gives that at head_dim 64 and width 2048.
# - the curve's width-1024 point: micro-batch 16 is device-bound (host_time.py), so its 274.6 ms step less the
#   attention (8 x 7.356), elementwise (47.67) and optimizer (5.53) terms leaves 162.5 ms for the GEMMs, all 1024
#   wide here: 0.684 of the 989 TFLOP/s peak. The profile's GEMM kernels alone ran at 0.75-0.78 at micro-batch 2 (17.8
#   ms a step for 1.37e13 FLOPs); the step's figure is lower because it also carries what the model does not itemise
#   on this path (the gradient norm's and casts' passes, the kernels between the GEMMs).
# - the width-8192 point: the 8192^3 bf16 matmul ceiling measured in the same two processes, 710.0 and 743.6
#   TFLOP/s, mean 0.735 of the peak. Through both points: 0.743 * 1024 / (1024 + 89) = 0.684, 0.743 * 8192 /
#   (8192 + 89) = 0.735. The old figures (0.65, 384) gave 0.47 at width 1024 and made these steps 19-26% slow.
H100_EFFICIENCY = Efficiency(gemm=0.743, gemm_half_width=89.0, attention=0.444, memory=0.80)
EFFICIENCY: dict[str, Efficiency] = {
    "A100": A100_EFFICIENCY,
    "H100": H100_EFFICIENCY,
    "H200": H100_EFFICIENCY,
}
DEFAULT_GPU_EFFICIENCY = Efficiency(gemm=0.68, gemm_half_width=256.0, attention=0.60, memory=0.75)
# CPU ranks (fp32, MKL/oneDNN GEMMs): eff = 0.77 * n / (n + 128) reproduces the measured 37 and 54 GFLOP/s per
# 96 GFLOP/s core at widths 128 and 256; memory streams at the spec's per-core bandwidth.
CPU_EFFICIENCY = Efficiency(gemm=0.77, gemm_half_width=128.0, attention=0.60, memory=0.80)

# Host seconds per kernel launch of a GPU rank's step, on the path host_time.py counts (compiled blocks, flash
# attention, the chunked loss, the flat AdamW step). An average over that mix: the compiled graphs' wrappers and
# guards, the Triton kernels launched from Python, autograd, the aten calls. Fitted to bloom-560m at micro-batch 2 on
# one H200 (bench/results/2026-11-26-h200-bloom-560m-mb2-trainer.json; 16-core host), which is host-bound (the GPU was
# idle 57% of the profiled step): the 79.32 ms step less the optimizer's tail (5.53 ms, timing.py) less the host time
# of the 293 per-parameter gradient adds since removed (aten::add_ self time 3.99 ms a step under the profiler,
# scaled by the profiler's slowdown 79.32 / 102.56: 3.07 ms), over the 1,114 launches the code issues now
# (host_time.launches_per_step; 1,381 then): 70.71 ms / 1,114 = 63.5 us. CPU ranks run their kernels on the host
# itself, inside the fitted CPU rates: no entry.
HOST_SECONDS_PER_LAUNCH = {"gpu": 63.5e-6}

# Tensor-core GEMMs lose rate when a per-rank width is not a multiple of 128 (tile quantization): the planner
# prefers hidden/tp % 128 == 0 and charges this factor otherwise.
MISALIGNED_GEMM_FACTOR = 0.85

# Elementwise traffic per block and micro-batch in the forward pass, in units of s*b*h elements, read or written
# (LayerNorms, bias+GeLU, dropouts, residual adds: Korthikanti et al.'s 34 s b h bytes of saved activations
# counts most of these once): 16 x s b h elements over the full width, plus 8 x s b f / t for the MLP's
# bias+GeLU on the TP-split width. Backward moves about twice as much.
ELEMENTWISE_FULL_WIDTH = 16.0
ELEMENTWISE_SPLIT_FFN = 2.0  # per element of s*b*f/t
# Megatron's fused causal softmax (BLOOM-176B's run): read bf16 scores, write bf16 probabilities, 1-byte dropout
# mask, and more. Fitted with the rest against that run.
SOFTMAX_BYTES_PER_SCORE = 6.0
# Our materialised torch attention (model/ops.py attention_probs), forward, per score: the upcast to fp32 (act
# read + 4 written; nothing for fp32 inputs), the scale (4 + 4), the ALiBi add (4 + 4), the causal mask fill
# (4 + 4 + 1-byte mask), the softmax (4 + 4), the cast back (4 + act; nothing for fp32). Flash attention moves
# no [s, s] bytes at all: its online softmax lives in registers, inside the attention term.
TORCH_SOFTMAX_BYTES_PER_SCORE = 33.0  # before the two casts
# Megatron's vocab-parallel cross entropy over full logits: fp32 upcast, max, exp, sum, gradient written back.
CROSS_ENTROPY_BYTES_PER_LOGIT = 16.0
# The chunked cross entropy moves, per logit of a chunk: with the Triton row kernels (fp32 in registers) one read
# for the statistics and a read + write for the in-place gradient: 3 x act bytes. With the torch twin (CPU,
# fp32 logits) the count is 83 bytes: statistics 24 (max 4, subtract 8, exp 8, sum 4), gradient 59 (subtract 8,
# exp 8, one-hot compare 1, its cast 5, subtract 12, scale 8, mask 9, copy back 8). Measured on one core of the
# 2-core VM (kernels.chunked_ce.chunked_vocab_ce at 1024 tokens x 8192 vocab, hidden 128, minus its three GEMMs):
# 12.5 to 15.6 ns per logit on quiet runs, 100 to 125 bytes at the 8 GB/s a core gets here (the exps are compute-
# bound), so the lower measured figure stands.
TORCH_CHUNKED_CE_BYTES_PER_LOGIT = 100.0

# Collectives and point-to-point: NCCL reaches ~80% of the link rate on large messages; each ring step costs a
# latency. gloo on loopback for CPU ranks: a larger latency.
LINK_EFFICIENCY = 0.80
RING_STEP_LATENCY_S = {"nvlink": 8e-6, "pcie": 15e-6, "fabric": 20e-6, "loopback": 60e-6}

# Where the DeepSpeed config turns overlap_comm on (pp == 1, ZeRO >= 1), the gradient reduce overlaps the last
# micro-batch's backward; this fraction of that backward can hide communication. The pipeline engine reduces after
# the last backward, so nothing overlaps when pp > 1. parallel/step/deepspeed_config.py leaves overlap_comm off today,
# so the credit is not taken (timing.py asks that config).
DP_OVERLAP_FRACTION = 0.8

# GPUs training in fp32: torch leaves TF32 off for matmuls, so GEMMs run on the CUDA cores' fp32 peak, a fraction
# of the bf16/fp16 tensor peak in the specs table: A100 19.5 of 312 TFLOPs, H100 SXM 67 of 989 (datasheets);
# V100 15.7 of 125.
GPU_FP32_PEAK_FRACTION = {"A100": 19.5 / 312, "H100": 67 / 989, "H200": 67 / 989, "V100": 15.7 / 125}
DEFAULT_GPU_FP32_PEAK_FRACTION = 1 / 16

# Memory beyond the tensors the model counts: CUDA context, cuBLAS workspaces and NCCL communicator buffers
# (a fixed amount per GPU), and the caching allocator's fragmentation (a fraction of everything allocated).
# nvidia-smi shows reserved memory, which is what the ~60 GB BLOOM figure is.
GPU_FIXED_OVERHEAD_GB = 2.5
CPU_FIXED_OVERHEAD_GB = 0.6  # a Python + torch + DeepSpeed rank process before any tensor
ALLOCATOR_MARGIN = 0.15
CPU_RAM_USABLE_FRACTION = 0.8  # leave the rest of RAM to the OS, data loaders and the head process

# Energy: GPUs average this fraction of their board power in steady training; the host (CPUs, RAM, NICs) adds
# a share per GPU. 0.75 x 400 W + 100 W = 400 W per A100 matches BLOOM's ~0.4 kWh per GPU-hour (Luccioni et
# al. 2022: 433 MWh over 1.08M GPU-hours).
GPU_POWER_FRACTION = 0.75
HOST_WATTS_PER_GPU = 100.0

# Indicative on-demand cloud prices in USD per GPU-hour (mid-2020s list prices, an assumption: set
# usd_per_gpu_hour in a hardware profile for your own). CPU runs on your own machine cost nothing here.
USD_PER_GPU_HOUR = {"A100": 2.0, "H100": 3.0, "H200": 3.8, "L40S": 1.0, "A10": 0.75, "L4": 0.7, "V100": 1.0}
DEFAULT_USD_PER_GPU_HOUR = 1.0


def gpu_efficiency(family: str) -> Efficiency:
    return EFFICIENCY.get(family, DEFAULT_GPU_EFFICIENCY)
