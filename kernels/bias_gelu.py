"""Fused bias + GeLU (tanh approximation), as in BLOOM's MLP: y = gelu_tanh(x + bias).

Layers: `_bias_gelu_fwd_kernel` / `_bias_gelu_bwd_kernel` -> `bias_gelu_fwd` / `bias_gelu_bwd` launchers ->
the custom ops bloom::bias_gelu and bloom::bias_gelu_backward, the first differentiated through the second
(kernels.custom_ops) -> `bias_gelu` -> `FusedBiasGelu` (module). The torch twin is `kernels.reference.bias_gelu`.
Math in fp32 whatever the storage dtype.
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

from kernels.custom_ops import kernel_op, on_device
from kernels.launch import compute_capability, launch


@triton.jit
def _tanh(u):
    # tanh(|u|) = (1 - e) / (1 + e) with e = exp(-2|u|) <= 1: never overflows, saturates to 1 as e -> 0.
    e = tl.exp(-2.0 * tl.abs(u))
    t = (1.0 - e) / (1.0 + e)
    return tl.where(u >= 0, t, -t)


@triton.jit
def _gelu_inner(z):
    # sqrt(2/pi) * (z + 0.044715 z^3), the argument of tanh in gelu_tanh
    return 0.7978845608028654 * (z + 0.044715 * z * z * z)


@triton.jit
def _bias_gelu_fwd_kernel(
    X, B, Y, n_rows, N, stride_x, stride_y,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (rows < n_rows)[:, None] & (cols < N)[None, :]
    rows64 = rows.to(tl.int64)[:, None]
    x = tl.load(X + rows64 * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    z = x + tl.load(B + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
    t = _tanh(_gelu_inner(z))
    y = 0.5 * z * (1.0 + t)
    tl.store(Y + rows64 * stride_y + cols[None, :], y.to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _bias_gelu_bwd_kernel(
    DY, X, B, DX, DB_partial, n_rows, N, stride_dy, stride_x, stride_dx,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    # dx for the tile, plus this tile's column sums of dx (= its share of d bias) written to a per-row-block slot.
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (rows < n_rows)[:, None] & (cols < N)[None, :]
    rows64 = rows.to(tl.int64)[:, None]
    x = tl.load(X + rows64 * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    dy = tl.load(DY + rows64 * stride_dy + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    z = x + tl.load(B + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
    t = _tanh(_gelu_inner(z))
    # d/dz [0.5 z (1 + t)] = 0.5 (1 + t) + 0.5 z (1 - t^2) * sqrt(2/pi) * (1 + 3 * 0.044715 z^2),
    # with 3 * 0.044715 = 0.134145
    dgelu = 0.5 * (1.0 + t) + 0.5 * z * (1.0 - t * t) * 0.7978845608028654 * (1.0 + 0.134145 * z * z)
    dx = tl.where(mask, dy * dgelu, 0.0)
    tl.store(DX + rows64 * stride_dx + cols[None, :], dx.to(DX.dtype.element_ty), mask=mask)
    tl.store(DB_partial + tl.program_id(0) * N + cols, tl.sum(dx, axis=0), mask=cols < N)


def launch_config(capability: int | None) -> tuple[int, int, int]:
    """(rows, columns, warps) of a tile on a GPU of this compute capability (None: the CPU interpreter).

    GPU: 64x128 tiles (8192 elements, 32 per thread at 8 warps) keep loads wide. The interpreter pays per
    program; 16 x 64 tiles keep programs few while tiny test shapes still cross row and column tile borders."""
    return (64, 128, 8) if capability is not None else (16, 64, 1)


def bias_gelu_fwd(x2d: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    rows, n = x2d.shape
    y = torch.empty_like(x2d)
    block_m, block_n, warps = launch_config(compute_capability(x2d))
    launch(
        _bias_gelu_fwd_kernel, (triton.cdiv(rows, block_m), triton.cdiv(n, block_n)),
        x2d, bias, y, rows, n, x2d.stride(0), y.stride(0), BLOCK_M=block_m, BLOCK_N=block_n, num_warps=warps,
    )  # fmt: skip
    return y


def bias_gelu_bwd(dy2d: torch.Tensor, x2d: torch.Tensor, bias: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    rows, n = x2d.shape
    dx = torch.empty_like(x2d)
    block_m, block_n, warps = launch_config(compute_capability(x2d))
    grid = (triton.cdiv(rows, block_m), triton.cdiv(n, block_n))
    db_partial = torch.empty(grid[0], n, dtype=torch.float32, device=x2d.device)
    launch(
        _bias_gelu_bwd_kernel, grid,
        dy2d, x2d, bias, dx, db_partial, rows, n, dy2d.stride(0), x2d.stride(0), dx.stride(0),
        BLOCK_M=block_m, BLOCK_N=block_n, num_warps=warps,
    )  # fmt: skip
    return dx, db_partial.sum(0).to(bias.dtype)


def _rows(t: torch.Tensor) -> torch.Tensor:
    t2d = t.reshape(-1, t.shape[-1])
    return t2d if t2d.stride(-1) == 1 else t2d.contiguous()


def _bias_gelu_fake(x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    return torch.empty(x.shape, dtype=x.dtype, device=x.device)


@kernel_op("bias_gelu", _bias_gelu_fake)
def bias_gelu_op(x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """gelu_tanh(x + bias), x's shape and dtype, contiguous."""
    with on_device(x):
        return bias_gelu_fwd(_rows(x), bias.contiguous()).view(x.shape)


def _bias_gelu_backward_fake(
    dy: torch.Tensor, x: torch.Tensor, bias: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.empty(x.shape, dtype=x.dtype, device=x.device), torch.empty_like(bias)


@kernel_op("bias_gelu_backward", _bias_gelu_backward_fake)
def bias_gelu_backward_op(dy: torch.Tensor, x: torch.Tensor, bias: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """dx (x's shape and dtype, contiguous) and dbias (the bias's dtype)."""
    with on_device(x):
        dx, db = bias_gelu_bwd(_rows(dy), _rows(x), bias.contiguous())
    return dx.view(x.shape), db


def _bias_gelu_setup(ctx: Any, inputs: tuple[torch.Tensor, torch.Tensor], output: torch.Tensor) -> None:
    ctx.save_for_backward(*inputs)


def _bias_gelu_backward(ctx: Any, dy: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """y = gelu_tanh(x + b), gelu_tanh(z) = 0.5 z (1 + tanh(sqrt(2/pi) (z + 0.044715 z^3))).

    dz = dy * gelu_tanh'(z); dx = dz; db = sum of dz over all rows. Only x and b are saved; z and tanh are
    recomputed (cheaper than storing them: the kernel is memory-bound).
    """
    x, bias = ctx.saved_tensors
    return bias_gelu_backward_op(dy, x, bias)


bias_gelu_op.register_autograd(_bias_gelu_backward, setup_context=_bias_gelu_setup)


def bias_gelu(x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """gelu_tanh(x + bias) over the last dim; output in x's dtype."""
    if bias.shape != (x.shape[-1],):
        raise ValueError(f"bias_gelu: bias shape {tuple(bias.shape)} does not match last dim {x.shape[-1]}")
    return bias_gelu_op(x, bias)


class FusedBiasGelu(torch.nn.Module):
    """Holds the bias of the preceding bias-free linear layer and applies gelu_tanh(x + bias)."""

    def __init__(self, features: int, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.bias = torch.nn.Parameter(torch.zeros(features, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return bias_gelu(x, self.bias)
