"""One-pass AdamW over flat fp32 state, reading each parameter's gradient where autograd left it.

The optimizer's state lives in flat buffers (fp32 masters, both moments, the bf16 weights), but autograd hands every
parameter a gradient tensor of its own. Copying those into a flat buffer first costs a write and a read of every
gradient; here the kernels read them in place, through a table of their addresses (the way torch's multi-tensor
kernels take theirs), in chunks of BLOCK elements of one tensor each:

    norm      partial[chunk] = sum of g^2 over the chunk, g = the step's gradient, then one torch sum over the
              partials (read-only: no write-back, no temporary the size of the gradients, a fixed order)
    update    g = (grad_sum + grad) * clip, and AdamW on master, exp_avg, exp_avg_sq in one pass, the bf16 weights
              rounded from the new masters (round to nearest even), nothing stored where `skip` is set
    fold      grad_sum (+)= grad, for the micro-batches before a step's last (DeepSpeed's fp32 accumulation)

`grad_sum` is the fp32 sum of the step's earlier micro-batches (absent with one micro-batch a step), `clip` DeepSpeed's
clipping factor min(1, max_norm / (norm + 1e-6)) and `skip` its verdict on a non-finite norm or loss, both 0-d
tensors on the device, as are the learning rate per group and the step count: nothing a step reads comes from the
host. The update is torch's fused AdamW (ATen's fused_adam_utils.cuh, ADAMW mode) in fp32, with bias corrections from
the step count on the device.

Layers: `_sum_squares_kernel`, `_adamw_kernel`, `_fold_kernel` -> the launchers `sum_of_squares`, `adamw_` and `fold_`
over a `FlatGradients` (the map of tensors and chunks, and the gradients' addresses). No autograd: the optimizer calls
the launchers. The torch twins are kernels.reference.flat_gradient_, flat_sum_of_squares and flat_adamw_.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels.launch import compute_capability, launch
from kernels.reference import FLAT_ALIGNMENT

_ALIGNED_OFFSET = tl.constexpr(FLAT_ALIGNMENT)  # what the kernels may assume of every tensor's flat offset


@triton.jit
def _chunk(CHUNK_TENSOR, CHUNK_START, OFFSETS, NUMELS, GRAD_ADDRESSES,
           GRAD_FP32: tl.constexpr, GRADS_ALIGNED: tl.constexpr, BLOCK: tl.constexpr):  # fmt: skip
    # This program's chunk: BLOCK elements of one tensor from `start` within it, at `flat` in the flat buffers; its
    # gradient through the address table. Returns the tensor's index, the chunk's flat and in-tensor indices, the
    # tensor's size, the gradient's pointers and how many of its elements have a gradient (0 where the backward did
    # not reach the parameter: it adds nothing).
    tensor = tl.load(CHUNK_TENSOR + tl.program_id(0))
    start = tl.multiple_of(tl.load(CHUNK_START + tl.program_id(0)), BLOCK)
    inner = start + tl.arange(0, BLOCK)
    numel = tl.load(NUMELS + tensor)
    flat = tl.multiple_of(tl.load(OFFSETS + tensor), _ALIGNED_OFFSET) + inner
    address = tl.load(GRAD_ADDRESSES + tensor)
    grad = address.to(tl.pointer_type(tl.float32 if GRAD_FP32 else tl.bfloat16))
    if GRADS_ALIGNED:
        grad = tl.multiple_of(grad, 16)
    return tensor, start, flat, inner, numel, grad + inner, tl.where(address != 0, numel, 0)


@triton.jit
def _load(pointer, mask):
    # A whole chunk (mask None) loads whole vectors: a mask from a size read at run time would split every load into
    # single elements. A chunk at a tensor's end, or without a gradient, masks (0 past the end).
    return tl.load(pointer) if mask is None else tl.load(pointer, mask=mask, other=0.0)


@triton.jit
def _step_gradient(grad, grad_mask, SUM, flat, mask, HAS_SUM: tl.constexpr):
    # fp32(the earlier micro-batches' sum) + fp32(this micro-batch's gradient): DeepSpeed's accumulation, one add.
    g = _load(grad, grad_mask).to(tl.float32)
    if HAS_SUM:
        g = _load(SUM + flat, mask) + g
    return g


@triton.jit
def _sum_squares_kernel(
    CHUNK_TENSOR, CHUNK_START, OFFSETS, NUMELS, GRAD_ADDRESSES, SUM, PARTIALS,
    HAS_SUM: tl.constexpr, GRAD_FP32: tl.constexpr, GRADS_ALIGNED: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    _, start, flat, inner, numel, grad, grad_numel = _chunk(
        CHUNK_TENSOR, CHUNK_START, OFFSETS, NUMELS, GRAD_ADDRESSES, GRAD_FP32, GRADS_ALIGNED, BLOCK
    )
    if start + BLOCK <= grad_numel:
        g = _step_gradient(grad, None, SUM, flat, None, HAS_SUM)
    else:
        g = _step_gradient(grad, inner < grad_numel, SUM, flat, inner < numel, HAS_SUM)
    tl.store(PARTIALS + tl.program_id(0), tl.sum(g * g, axis=0))


@triton.jit
def _fold_kernel(
    CHUNK_TENSOR, CHUNK_START, OFFSETS, NUMELS, GRAD_ADDRESSES, SUM,
    ACCUMULATE: tl.constexpr, GRAD_FP32: tl.constexpr, GRADS_ALIGNED: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    _, start, flat, inner, numel, grad, grad_numel = _chunk(
        CHUNK_TENSOR, CHUNK_START, OFFSETS, NUMELS, GRAD_ADDRESSES, GRAD_FP32, GRADS_ALIGNED, BLOCK
    )
    if start + BLOCK <= grad_numel:
        tl.store(SUM + flat, _step_gradient(grad, None, SUM, flat, None, ACCUMULATE))
    else:
        mask = inner < numel
        tl.store(SUM + flat, _step_gradient(grad, inner < grad_numel, SUM, flat, mask, ACCUMULATE), mask=mask)


@triton.jit
def _round_to_bf16(x):
    # fp32 -> bf16, round to nearest even, in integer arithmetic: what torch's cast and the GPU's cvt.rn give, and
    # the same in Triton's interpreter (whose own cast truncates). The masters are finite wherever this is stored.
    bits = x.to(tl.uint32, bitcast=True)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    return rounded.to(tl.uint16).to(tl.bfloat16, bitcast=True)


@triton.jit
def _adamw_elements(
    grad, grad_mask, SUM, MASTER, EXP_AVG, EXP_AVG_SQ, WEIGHTS, flat, mask, clip, lr, weight_decay,
    bias_correction1, bias_correction2_sqrt, beta1, one_minus_beta1, beta2, one_minus_beta2, eps,
    HAS_SUM: tl.constexpr, HAS_WEIGHTS: tl.constexpr,
):  # fmt: skip
    g = _step_gradient(grad, grad_mask, SUM, flat, mask, HAS_SUM) * clip
    param = _load(MASTER + flat, mask)
    exp_avg = _load(EXP_AVG + flat, mask)
    exp_avg_sq = _load(EXP_AVG_SQ + flat, mask)
    param -= lr * weight_decay * param  # decoupled weight decay (ADAMW mode)
    exp_avg = beta1 * exp_avg + one_minus_beta1 * g
    exp_avg_sq = beta2 * exp_avg_sq + one_minus_beta2 * g * g
    denom = tl.div_rn(tl.sqrt_rn(exp_avg_sq), bias_correction2_sqrt) + eps
    param -= tl.div_rn(tl.div_rn(lr, bias_correction1) * exp_avg, denom)
    tl.store(MASTER + flat, param, mask=mask)
    tl.store(EXP_AVG + flat, exp_avg, mask=mask)
    tl.store(EXP_AVG_SQ + flat, exp_avg_sq, mask=mask)
    if HAS_WEIGHTS:
        tl.store(WEIGHTS + flat, _round_to_bf16(param), mask=mask)


@triton.jit
def _adamw_kernel(
    CHUNK_TENSOR, CHUNK_START, OFFSETS, NUMELS, GROUPS, GRAD_ADDRESSES, SUM,
    MASTER, EXP_AVG, EXP_AVG_SQ, WEIGHTS, LR, WEIGHT_DECAY, STEP, CLIP, SKIP,
    beta1, one_minus_beta1, beta2, one_minus_beta2, log2_beta1, log2_beta2, eps,
    HAS_SUM: tl.constexpr, HAS_WEIGHTS: tl.constexpr, GRAD_FP32: tl.constexpr, GRADS_ALIGNED: tl.constexpr,
    BLOCK: tl.constexpr,
):  # fmt: skip
    tensor, start, flat, inner, numel, grad, grad_numel = _chunk(
        CHUNK_TENSOR, CHUNK_START, OFFSETS, NUMELS, GRAD_ADDRESSES, GRAD_FP32, GRADS_ALIGNED, BLOCK
    )
    # A skipped step (found_inf in torch's kernel) loads and stores nothing: masters, moments and weights stay.
    if tl.load(SKIP) == 0:
        group = tl.load(GROUPS + tensor)
        lr = tl.load(LR + group)
        step = tl.load(STEP)
        # 1 - beta^step from the device's step count: beta^step = 2^(step log2 beta)
        bias_correction1 = 1.0 - tl.exp2(step * log2_beta1)
        bias_correction2_sqrt = tl.sqrt_rn(1.0 - tl.exp2(step * log2_beta2))
        scalars = (tl.load(CLIP), lr, tl.load(WEIGHT_DECAY + group), bias_correction1, bias_correction2_sqrt,
                   beta1, one_minus_beta1, beta2, one_minus_beta2, eps)  # fmt: skip
        if start + BLOCK <= grad_numel:
            _adamw_elements(grad, None, SUM, MASTER, EXP_AVG, EXP_AVG_SQ, WEIGHTS, flat, None, *scalars,
                            HAS_SUM, HAS_WEIGHTS)  # fmt: skip
        else:
            _adamw_elements(grad, inner < grad_numel, SUM, MASTER, EXP_AVG, EXP_AVG_SQ, WEIGHTS, flat, inner < numel,
                            *scalars, HAS_SUM, HAS_WEIGHTS)  # fmt: skip


def _log2(beta: float) -> float:
    return math.log2(beta) if beta > 0 else -math.inf  # beta = 0: beta^step = 2^-inf = 0 from the first step


def launch_config(capability: int | None) -> tuple[int, int]:
    """(elements per program, warps) on a GPU of this compute capability (None: the CPU interpreter).

    GPU: 1024 elements at 8 warps, 4 per thread: one 16-byte vector of each fp32 buffer per thread, 44 registers
    (ptxas, sm_80 and sm_90), so every SM keeps its full count of warps in flight. Measured on one H200 at bloom-560m's
    559M parameters (bench/optimizer_step.py --configs), the region took 5.0, 5.1 and 5.5 ms at 4 elements per thread
    (512 x 4, 1024 x 8, 2048 x 16), 5.9, 6.2 and 7.9 at 8 (1024 x 4, 4096 x 16, 2048 x 8: 146-158 registers, the bf16
    loads and the fp32 ones laid out apart). A program's table reads
    (tensor, start, offset, size, address, group, lr, weight decay, step, clip, skip: ~60 bytes) cost 0.06 bytes per
    element. The interpreter pays per program (about 4 ms for the update), so it takes 2048 a program: a test's
    4097-element tensor is still two whole chunks and an edge."""
    return (1024, 8) if capability is not None else (2048, 1)


@dataclass(frozen=True)
class Chunks:
    """One grid over the tensors: per program its tensor and first element within it, and a partial sum each."""

    tensor: torch.Tensor  # int32 [count]
    start: torch.Tensor  # int64 [count], multiples of the block
    partials: torch.Tensor  # fp32 [count]: the norm's per-chunk sums (persistent: no allocation per step)
    count: int


class FlatGradients:
    """The kernels' map of the flat buffers and of the gradients autograd left.

    Per tensor, in flat order: its offset in the flat buffers (a multiple of FLAT_ALIGNMENT), its size, its
    weight-decay group and whether this rank counts it in the gradient norm; the gradients' addresses (`point_at`,
    before each launch that reads them); per block size, the chunks of every tensor and of the counted ones. All of it
    on the device, made once: a step's launches take the same tensors every time.
    """

    def __init__(
        self,
        offsets: Sequence[int],
        numels: Sequence[int],
        groups: Sequence[int],
        counted: Sequence[bool],
        weight_decay: Sequence[float],
        grad_dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        if any(o % FLAT_ALIGNMENT for o in offsets):
            raise ValueError(f"FlatGradients: tensor offsets must be multiples of {FLAT_ALIGNMENT} elements")
        if grad_dtype not in (torch.float32, torch.bfloat16):
            raise ValueError(f"FlatGradients: gradients in fp32 or bf16, got {grad_dtype}")
        self.device, self.grad_dtype = device, grad_dtype
        self._numels, self._counted = tuple(numels), tuple(counted)
        self.offsets = torch.tensor(offsets, dtype=torch.int64).to(device)
        self.numels = torch.tensor(numels, dtype=torch.int64).to(device)
        self.groups = torch.tensor(groups, dtype=torch.int32).to(device)
        self.weight_decay = torch.tensor(weight_decay, dtype=torch.float32).to(device)
        self.addresses = torch.zeros(len(offsets), dtype=torch.int64, device=device)
        self.aligned = True  # every gradient pointed at starts on a 16-byte boundary (the kernels' load width)
        self._staging: torch.Tensor | None = None
        self._chunks: dict[tuple[int, bool], Chunks] = {}

    def chunks(self, block: int, counted_only: bool) -> Chunks:
        """Every tensor's chunks of `block` elements, or only those of the tensors this rank counts in the norm."""
        key = (block, counted_only)
        if key not in self._chunks:
            sizes = [n if c or not counted_only else 0 for n, c in zip(self._numels, self._counted, strict=True)]
            per_tensor = torch.tensor([-(-n // block) for n in sizes], dtype=torch.int64)
            count = int(per_tensor.sum())
            first = torch.repeat_interleave(torch.cumsum(per_tensor, 0) - per_tensor, per_tensor)
            tensor = torch.repeat_interleave(torch.arange(len(per_tensor), dtype=torch.int32), per_tensor)
            start = (torch.arange(count, dtype=torch.int64) - first) * block
            partials = torch.zeros(count, dtype=torch.float32, device=self.device)
            self._chunks[key] = Chunks(tensor.to(self.device), start.to(self.device), partials, count)
        return self._chunks[key]

    def point_at(self, grads: Sequence[torch.Tensor | None]) -> None:
        """The addresses of these gradients (one per tensor, None where there is none) into the device's table.

        The addresses are the host's to know (no device read): one small host-to-device copy, through pinned memory
        on a GPU so the host does not wait. The staging tensor is kept until the next call, so a copy captured into a
        CUDA graph replays from memory that is still there. The kernels read the gradients after this returns; the
        tensors may be released then (a GPU's allocator reuses their memory in stream order)."""
        addresses = []
        for i, grad in enumerate(grads):
            if grad is None:
                addresses.append(0)
                continue
            if grad.dtype != self.grad_dtype or grad.numel() != self._numels[i] or not grad.is_contiguous():
                raise ValueError(
                    f"FlatGradients: gradient {i} is {grad.dtype} {tuple(grad.shape)} (contiguous: "
                    f"{grad.is_contiguous()}), expected {self._numels[i]} contiguous {self.grad_dtype} elements"
                )
            addresses.append(grad.data_ptr())
        self.aligned = all(a % 16 == 0 for a in addresses)
        staging = torch.tensor(addresses, dtype=torch.int64)
        if self.addresses.is_cuda:
            staging = staging.pin_memory()
        self.addresses.copy_(staging, non_blocking=True)
        self._staging = staging


def _common(layout: FlatGradients, counted_only: bool) -> tuple[Chunks, dict[str, int | bool]]:
    block, warps = launch_config(compute_capability(layout.addresses))
    options: dict[str, int | bool] = {"GRAD_FP32": layout.grad_dtype == torch.float32,
                                      "GRADS_ALIGNED": layout.aligned, "BLOCK": block, "num_warps": warps}  # fmt: skip
    return layout.chunks(block, counted_only), options


def _table(chunks: Chunks, layout: FlatGradients) -> tuple[torch.Tensor, ...]:
    return chunks.tensor, chunks.start, layout.offsets, layout.numels


def sum_of_squares(layout: FlatGradients, grad_sum: torch.Tensor | None) -> torch.Tensor:
    """Sum of squares of the step's gradient (grad_sum + the gradients pointed at) over the counted tensors: 0-d fp32
    on the device, unread."""
    chunks, options = _common(layout, counted_only=True)
    if chunks.count == 0:
        return torch.zeros((), dtype=torch.float32, device=layout.device)
    launch(
        _sum_squares_kernel, (chunks.count,), *_table(chunks, layout), layout.addresses,
        chunks.partials if grad_sum is None else grad_sum, chunks.partials, HAS_SUM=grad_sum is not None, **options,
    )  # fmt: skip
    return chunks.partials.sum()


def fold_(layout: FlatGradients, grad_sum: torch.Tensor, accumulate: bool) -> None:
    """grad_sum = (grad_sum if accumulate else 0) + the gradients pointed at, in fp32 (zero where there is none)."""
    chunks, options = _common(layout, counted_only=False)
    if chunks.count:
        launch(_fold_kernel, (chunks.count,), *_table(chunks, layout), layout.addresses, grad_sum,
               ACCUMULATE=accumulate, **options)  # fmt: skip


def adamw_(
    layout: FlatGradients,
    grad_sum: torch.Tensor | None,
    master: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    weights: torch.Tensor | None,
    *,
    lr: torch.Tensor,
    step: torch.Tensor,
    clip: torch.Tensor,
    skip: torch.Tensor,
    betas: tuple[float, float],
    eps: float,
) -> None:
    """One AdamW step of the flat fp32 state in place (the module docstring), the bf16 `weights` rounded from the new
    masters (None: fp32 weights, which are the masters). `lr`: fp32 [groups]; `step` (already counting this step),
    `clip` and `skip`: 0-d fp32; all on the device. `betas` and `eps` are the run's constants."""
    chunks, options = _common(layout, counted_only=False)
    if not chunks.count:
        return
    beta1, beta2 = betas
    launch(
        _adamw_kernel, (chunks.count,), *_table(chunks, layout), layout.groups, layout.addresses,
        master if grad_sum is None else grad_sum, master, exp_avg, exp_avg_sq, master if weights is None else weights,
        lr, layout.weight_decay, step, clip, skip,
        beta1, 1.0 - beta1, beta2, 1.0 - beta2, _log2(beta1), _log2(beta2), eps,
        HAS_SUM=grad_sum is not None, HAS_WEIGHTS=weights is not None, **options,
    )  # fmt: skip
