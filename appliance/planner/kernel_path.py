"""Which attention, loss and LayerNorm kernels a rank runs: the one place the memory and time models ask.

Our training path (after appliance/kernels/registry.py picks a backend per tensor):
- GPU ranks (CUDA, Triton): the fused causal ALiBi flash kernel (kernels/flash_attention.py) for heads up to
  FLASH_MAX_HEAD_DIM wide, with or without sequence parallelism, whenever attention dropout is off (BLOOM: 0).
  It streams key blocks past each query block with an online softmax, so no [s, s] tensor is ever allocated,
  stored or differentiated; model/bloom.py then skips selective recompute (there is nothing to drop). Wider
  heads fall back to the materialised torch path below rather than being rejected.
- CPU ranks: the materialised torch path (model/ops.py attention_core): [s, s] scores, an fp32 softmax whose
  output is kept for backward, and its cast back to the compute dtype that the AV product keeps.
- Loss: one chunked vocab-parallel cross entropy everywhere (kernels.chunked_ce.chunked_vocab_ce; Triton row
  kernels on GPUs, the torch twin on CPU): logits exist one token chunk at a time, never more than one chunk's
  [chunk, V/t] at once. GPU ranks take the whole micro-batch as one chunk when its logits fit 2 GiB (else chunks of
  at least 1024 tokens), so the [V/t, H] weight is read twice and its gradient written once per micro-batch; CPU
  ranks take chunks of about s b h logits (loss_chunks).
- LayerNorm: the fused kernel for rows up to LAYER_NORM_MAX_ROW, the torch twin beyond (no rejection either way);
  the elementwise traffic coefficients in calibration.py are not split by it.
- Bias + GeLU: the fused Triton kernel on GPU ranks (it keeps its input for backward); the torch twin of
  model/ops.py bias_gelu on CPU ranks, whose chain of elementwise ops keeps intermediates of its own (memory.py).
- Blocks: each dense block under torch.compile on GPU ranks (TrainSettings.compile, `auto` by default), eager on CPU
  ranks; the host time model (host_time.py) counts the compiled block's launches.
- ZeRO >= 1 with dp > 1: the engine issues the post-step parameter all-gather per layer, asynchronously, and each
  layer's next forward waits only for its own parameters (TrainSettings.overlap_param_gather, on by default).

BLOOM-176B's own run used Megatron-DeepSpeed's kernels (MEGATRON_DEEPSPEED): the fused causal softmax over
materialised bf16 scores with Korthikanti et al.'s saved tensors (dropout masks included), a vocab-parallel
cross entropy over the full logits, and the parameter all-gather after the step, waited for in full. The reference
comparison (reference.py reference_estimate) evaluates that run with those.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from appliance.planner.device import Device
from appliance.planner.model_shape import ModelShape
from kernels.chunk_rule import auto_chunk_size

# The kernels' own limits, restated so the planner does not import torch or Triton; tests/unit/
# test_planner_kernel_path.py reads the kernel modules and checks these equal theirs.
FLASH_MAX_HEAD_DIM = 128  # kernels/flash_attention.py MAX_HEAD_DIM
LAYER_NORM_MAX_ROW = 16384  # kernels/layer_norm.py MAX_ROW
# TrainSettings.overlap_param_gather (the engine's cross-step all-gather) is on by default; plans assume it.
OVERLAP_PARAM_GATHER = True

FLASH = "flash"
MATERIALISED = "materialised"
MEGATRON_SOFTMAX = "megatron-fused-softmax"
CHUNKED_CE = "chunked"
FULL_LOGITS_CE = "full-logits"


@dataclass(frozen=True)
class KernelPath:
    attention: str  # FLASH, MATERIALISED or MEGATRON_SOFTMAX
    loss: str  # CHUNKED_CE or FULL_LOGITS_CE
    layer_norm: str  # "fused" or "torch"
    triton: bool  # the loss's row kernels run in Triton (fp32 in registers) rather than as torch ops
    dropout_masks: bool = False  # 1-byte dropout masks kept per block (Megatron's run); BLOOM's dropout is 0 here
    overlap_param_gather: bool = True  # ZeRO's post-step all-gather hidden under the next forward, layer by layer
    compiled_blocks: bool = False  # each dense block under torch.compile (compile=auto on CUDA ranks, the default)
    gelu: str = "fused"  # "fused" (Triton, or Megatron's bias_gelu: its input kept) or "torch" (model/ops.py's twin)

    @property
    def scores_materialised(self) -> bool:
        """Whether [s, s] attention scores exist at all (stored, as workspace, or differentiated)."""
        return self.attention != FLASH

    @property
    def selective_recompute_helps(self) -> bool:
        """Selective recompute drops the [s, s] tensors; under flash there are none and model/bloom.py skips it."""
        return self.scores_materialised

    def describe(self) -> str:
        attention = {
            FLASH: "flash attention (no [s, s] scores)",
            MATERIALISED: "materialised torch attention ([s, s] scores, fp32 softmax)",
            MEGATRON_SOFTMAX: "Megatron's fused causal softmax over [s, s] scores",
        }[self.attention]
        loss = "chunked vocab-parallel cross entropy" if self.loss == CHUNKED_CE else "cross entropy on full logits"
        return f"{attention}, {loss}, {self.layer_norm} LayerNorm"


# BLOOM-176B as BigScience ran it (bigscience-workshop/Megatron-DeepSpeed): scaled_upper_triang_masked_softmax
# over bf16 scores, vocab_parallel_cross_entropy over the whole [s b, V/t] logits, apex's fused LayerNorm.
MEGATRON_DEEPSPEED = KernelPath(
    attention=MEGATRON_SOFTMAX,
    loss=FULL_LOGITS_CE,
    layer_norm="fused",
    triton=False,
    dropout_masks=True,
    overlap_param_gather=False,
)


# The kernels a reference run (presets/reference/*.toml, key `kernels`) executed.
REFERENCE_KERNELS = {"megatron-deepspeed": MEGATRON_DEEPSPEED}


def kernels_for(device: Device, model: ModelShape) -> KernelPath:
    """The kernels our appliance runs for `model` on `device` (the rules in the module docstring)."""
    gpu = device.kind == "gpu"
    flash = gpu and model.head_dim <= FLASH_MAX_HEAD_DIM
    return KernelPath(
        attention=FLASH if flash else MATERIALISED,
        loss=CHUNKED_CE,
        layer_norm="fused" if gpu and model.hidden <= LAYER_NORM_MAX_ROW else "torch",
        triton=gpu,
        overlap_param_gather=OVERLAP_PARAM_GATHER,
        compiled_blocks=gpu,
        gelu="fused" if gpu else "torch",
    )


@dataclass(frozen=True)
class LossChunks:
    """How the chunked loss cuts one micro-batch's tokens on one rank."""

    tokens: int  # per chunk
    count: int

    @property
    def deferred(self) -> bool:
        """One chunk keeps its gradient logits (in place of its logits) and runs both gradient GEMMs in backward."""
        return self.count == 1

    @property
    def weight_passes(self) -> int:
        """[V/t, H] weights moved per micro-batch (kernels.chunked_ce.chunked_vocab_ce). One chunk: 3, W read by the
        forward GEMM and by the hidden-gradient GEMM, the weight gradient written once. n chunks: 4n + 1, per chunk
        W read twice, the gradient written by the first chunk and read and written by each later one, then read and
        written once more when backward scales it by the incoming gradient."""
        return 3 if self.deferred else 4 * self.count + 1


def loss_chunks(kernels: KernelPath, tokens: float, hidden: int, vocab_local: int, logit_bytes: int) -> LossChunks:
    """The chunks of the chunked loss for a micro-batch of `tokens` on one rank: GPU ranks (the Triton path) by the
    GPU rule, CPU ranks by the CPU rule (kernels/chunk_rule.py, the rule the loss itself runs)."""
    whole = math.ceil(tokens)
    chunk = auto_chunk_size(whole, hidden, vocab_local, gpu=kernels.triton, logit_bytes=logit_bytes)
    return LossChunks(chunk, math.ceil(whole / chunk))
