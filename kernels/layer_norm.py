"""Fused LayerNorm: whole rows per Triton program, fp32 statistics, any input dtype.

Layers: `_layer_norm_fwd_kernel` and the backward kernels -> `layer_norm_fwd` / `layer_norm_bwd` launchers ->
the custom ops bloom::layer_norm and bloom::layer_norm_backward, the first differentiated through the second
(kernels.custom_ops) -> `layer_norm` -> `FusedLayerNorm` (module). The torch twin is `kernels.reference.layer_norm`.

The backward has two schedules. Rows up to FUSED_BWD_MAX wide: one kernel keeps a row tile and the running
dw, db in registers (x and dy read once). Wider rows (BLOOM-176B's 14336) would spill registers, so there the
row terms of dx come from a first, chunked pass over each row, and a second kernel walks column blocks
computing dx and dw, db (x and dy read twice, the second time mostly from L2).
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

from kernels.custom_ops import kernel_op, on_device
from kernels.launch import compute_capability, gpu_target, launch

# The forward holds a whole row in registers: 16384 fp32 at 16 warps is 32 per thread, no spills (checked
# with ptxas for sm_80 and sm_90). The fused backward holds ~4 row-wide arrays, so it stops at 8192.
MAX_ROW = 16384
FUSED_BWD_MAX = 8192


@triton.jit
def _layer_norm_fwd_kernel(
    X, W, B, Y, Mean, Rstd,
    stride_x, stride_y, n_rows, N, eps,
    BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    # One program normalizes BLOCK_R whole rows (1 for wide rows; several when rows are short).
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.arange(0, BLOCK_N)
    mask = (rows < n_rows)[:, None] & (cols < N)[None, :]
    rows64 = rows.to(tl.int64)[:, None]
    x = tl.load(X + rows64 * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    mean = tl.sum(x, axis=1) / N
    centered = tl.where(mask, x - mean[:, None], 0.0)
    var = tl.sum(centered * centered, axis=1) / N  # biased variance, as torch.nn.LayerNorm
    rstd = 1.0 / tl.sqrt(var + eps)
    w = tl.load(W + cols, mask=cols < N, other=0.0).to(tl.float32)
    b = tl.load(B + cols, mask=cols < N, other=0.0).to(tl.float32)
    y = centered * rstd[:, None] * w[None, :] + b[None, :]
    tl.store(Y + rows64 * stride_y + cols[None, :], y.to(Y.dtype.element_ty), mask=mask)
    tl.store(Mean + rows, mean, mask=rows < n_rows)
    tl.store(Rstd + rows, rstd, mask=rows < n_rows)


@triton.jit
def _layer_norm_bwd_kernel(
    X, W, DY, DX, Mean, Rstd, DW_partial, DB_partial,
    stride_x, stride_dy, stride_dx, n_rows, N,
    BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    # Program p takes row tiles p, p + P, p + 2P, ... (P programs), writing dx and keeping its share of dw, db
    # in registers; the launcher sums the [P, N] partials (deterministic two-level reduction, no atomics).
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    cols = tl.arange(0, BLOCK_N)
    in_row = cols < N
    w = tl.load(W + cols, mask=in_row, other=0.0).to(tl.float32)
    dw = tl.zeros([BLOCK_N], dtype=tl.float32)
    db = tl.zeros([BLOCK_N], dtype=tl.float32)
    for tile in range(pid, tl.cdiv(n_rows, BLOCK_R), programs):
        rows = tile * BLOCK_R + tl.arange(0, BLOCK_R)
        mask = (rows < n_rows)[:, None] & in_row[None, :]
        rows64 = rows.to(tl.int64)[:, None]
        x = tl.load(X + rows64 * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(DY + rows64 * stride_dy + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        mean = tl.load(Mean + rows, mask=rows < n_rows, other=0.0)
        rstd = tl.load(Rstd + rows, mask=rows < n_rows, other=0.0)
        xhat = tl.where(mask, (x - mean[:, None]) * rstd[:, None], 0.0)
        # dw, db first, so dy is dead once g exists: fewer full-row arrays live at once (wide rows fill registers)
        dw += tl.sum(dy * xhat, axis=0)
        db += tl.sum(dy, axis=0)
        g = dy * w[None, :]
        # dx = rstd * (g - mean(g) - xhat * mean(g * xhat)), means over the N real columns of each row
        c1 = tl.sum(xhat * g, axis=1) / N
        c2 = tl.sum(g, axis=1) / N
        dx = (g - (xhat * c1[:, None] + c2[:, None])) * rstd[:, None]
        tl.store(DX + rows64 * stride_dx + cols[None, :], dx.to(DX.dtype.element_ty), mask=mask)
    tl.store(DW_partial + pid * N + cols, dw, mask=in_row)
    tl.store(DB_partial + pid * N + cols, db, mask=in_row)


@triton.jit
def _layer_norm_bwd_row_terms_kernel(
    X, W, DY, Mean, Rstd, C1, C2, stride_x, stride_dy, N,
    BLOCK_N: tl.constexpr,
):  # fmt: skip
    # Wide rows, pass 1: per row c1 = mean(xhat * g), c2 = mean(g), g = dy * w, in BLOCK_N-column chunks.
    row = tl.program_id(0).to(tl.int64)
    mean = tl.load(Mean + row)
    rstd = tl.load(Rstd + row)
    acc1 = tl.zeros([BLOCK_N], dtype=tl.float32)
    acc2 = tl.zeros([BLOCK_N], dtype=tl.float32)
    for start in range(0, N, BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N)
        in_row = cols < N
        x = tl.load(X + row * stride_x + cols, mask=in_row, other=0.0).to(tl.float32)
        dy = tl.load(DY + row * stride_dy + cols, mask=in_row, other=0.0).to(tl.float32)
        w = tl.load(W + cols, mask=in_row, other=0.0).to(tl.float32)
        g = dy * w
        acc1 += tl.where(in_row, (x - mean) * rstd, 0.0) * g
        acc2 += g
    tl.store(C1 + row, tl.sum(acc1, axis=0) / N)
    tl.store(C2 + row, tl.sum(acc2, axis=0) / N)


@triton.jit
def _layer_norm_bwd_columns_kernel(
    X, W, DY, DX, Mean, Rstd, C1, C2, DW_partial, DB_partial,
    stride_x, stride_dy, stride_dx, n_rows, N,
    BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
):  # fmt: skip
    # Wide rows, pass 2: program (c, p) owns columns block c and row tiles p, p + P, ...; dx from the row terms,
    # dw and db for its columns summed over its rows into partial slot p.
    cols = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)
    in_cols = cols < N
    pid = tl.program_id(1)
    w = tl.load(W + cols, mask=in_cols, other=0.0).to(tl.float32)
    dw = tl.zeros([BLOCK_C], dtype=tl.float32)
    db = tl.zeros([BLOCK_C], dtype=tl.float32)
    for tile in range(pid, tl.cdiv(n_rows, BLOCK_R), tl.num_programs(1)):
        rows = tile * BLOCK_R + tl.arange(0, BLOCK_R)
        row_ok = rows < n_rows
        mask = row_ok[:, None] & in_cols[None, :]
        rows64 = rows.to(tl.int64)[:, None]
        x = tl.load(X + rows64 * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(DY + rows64 * stride_dy + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        mean = tl.load(Mean + rows, mask=row_ok, other=0.0)[:, None]
        rstd = tl.load(Rstd + rows, mask=row_ok, other=0.0)[:, None]
        c1 = tl.load(C1 + rows, mask=row_ok, other=0.0)[:, None]
        c2 = tl.load(C2 + rows, mask=row_ok, other=0.0)[:, None]
        xhat = tl.where(mask, (x - mean) * rstd, 0.0)
        dw += tl.sum(dy * xhat, axis=0)
        db += tl.sum(dy, axis=0)
        dx = (dy * w[None, :] - (xhat * c1 + c2)) * rstd
        tl.store(DX + rows64 * stride_dx + cols[None, :], dx.to(DX.dtype.element_ty), mask=mask)
    tl.store(DW_partial + pid * N + cols, dw, mask=in_cols)
    tl.store(DB_partial + pid * N + cols, db, mask=in_cols)


def launch_config(n: int, capability: int | None) -> tuple[int, int, int]:
    """(rows per tile, block width, warps) for rows of n elements, forward and fused backward, on a GPU of this
    compute capability (None: the CPU interpreter). GPU: a tile of ~4096 elements, enough threads that each holds
    at most ~32 fp32 of it. Interpreter: 16 rows per tile, since its cost is per program, not per element."""
    block = triton.next_power_of_2(n)
    rows = max(1, min(16, 4096 // block)) if capability is not None else 16
    warps = 4 if rows * block < 2048 else 8 if rows * block < 8192 else 16
    return rows, block, warps


def wide_bwd_config(capability: int | None) -> tuple[int, int, int, int]:
    """(row-terms chunk, column-pass rows, column-pass columns, warps) of the backward for rows wider than
    FUSED_BWD_MAX. GPU: 2048-column chunks at 8 warps (8 values per thread per array); 16 x 256 tiles in the
    column pass. Interpreter: 256-column chunks and 16 x 256 tiles, so a 1023-wide test row takes several of each."""
    chunk, warps = (2048, 8) if capability is not None else (256, 1)
    return chunk, 16, 256, warps


def layer_norm_fwd(
    x2d: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """y, mean, rstd for a [rows, N] tensor whose rows are unit-stride."""
    rows, n = x2d.shape
    if n > MAX_ROW:
        raise ValueError(f"layer_norm: rows of {n} elements exceed the fused kernel's limit of {MAX_ROW}")
    y = torch.empty_like(x2d)
    mean = torch.empty(rows, dtype=torch.float32, device=x2d.device)
    rstd = torch.empty(rows, dtype=torch.float32, device=x2d.device)
    block_r, block_n, warps = launch_config(n, compute_capability(x2d))
    launch(
        _layer_norm_fwd_kernel, (triton.cdiv(rows, block_r),),
        x2d, weight, bias, y, mean, rstd, x2d.stride(0), y.stride(0), rows, n, eps,
        BLOCK_R=block_r, BLOCK_N=block_n, num_warps=warps,
    )  # fmt: skip
    return y, mean, rstd


def layer_norm_bwd(
    dy2d: torch.Tensor, x2d: torch.Tensor, weight: torch.Tensor, mean: torch.Tensor, rstd: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """dx, dweight, dbias (dweight/dbias in the weight's dtype)."""
    rows, n = x2d.shape
    target = gpu_target(x2d)
    block_r, block_n, warps = launch_config(n, None if target is None else target.capability)
    # A few programs per SM keep the GPU busy while the [programs, N] partials stay small; the interpreter
    # runs programs one after another, so there a handful suffices.
    slots = 4 * target.multiprocessors if target is not None else 2
    if block_n > FUSED_BWD_MAX:
        return _layer_norm_bwd_wide(dy2d, x2d, weight, mean, rstd, slots)
    programs = max(1, min(triton.cdiv(rows, block_r), slots))
    dx = torch.empty_like(x2d)
    dw_partial = torch.empty(programs, n, dtype=torch.float32, device=x2d.device)
    db_partial = torch.empty(programs, n, dtype=torch.float32, device=x2d.device)
    launch(
        _layer_norm_bwd_kernel, (programs,),
        x2d, weight, dy2d, dx, mean, rstd, dw_partial, db_partial,
        x2d.stride(0), dy2d.stride(0), dx.stride(0), rows, n,
        BLOCK_R=block_r, BLOCK_N=block_n, num_warps=warps,
    )  # fmt: skip
    return dx, dw_partial.sum(0).to(weight.dtype), db_partial.sum(0).to(weight.dtype)


def _layer_norm_bwd_wide(
    dy2d: torch.Tensor, x2d: torch.Tensor, weight: torch.Tensor, mean: torch.Tensor, rstd: torch.Tensor, slots: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    rows, n = x2d.shape
    gpu = compute_capability(x2d)
    chunk, block_r, block_c, warps = wide_bwd_config(gpu)
    c1 = torch.empty(rows, dtype=torch.float32, device=x2d.device)
    c2 = torch.empty_like(c1)
    launch(
        _layer_norm_bwd_row_terms_kernel, (rows,),
        x2d, weight, dy2d, mean, rstd, c1, c2, x2d.stride(0), dy2d.stride(0), n, BLOCK_N=chunk, num_warps=warps,
    )  # fmt: skip
    col_blocks = triton.cdiv(n, block_c)
    programs = max(1, min(triton.cdiv(rows, block_r), slots // col_blocks if gpu is not None else 2))
    dx = torch.empty_like(x2d)
    dw_partial = torch.empty(programs, n, dtype=torch.float32, device=x2d.device)
    db_partial = torch.empty(programs, n, dtype=torch.float32, device=x2d.device)
    launch(
        _layer_norm_bwd_columns_kernel, (col_blocks, programs),
        x2d, weight, dy2d, dx, mean, rstd, c1, c2, dw_partial, db_partial,
        x2d.stride(0), dy2d.stride(0), dx.stride(0), rows, n,
        BLOCK_R=block_r, BLOCK_C=block_c, num_warps=warps,
    )  # fmt: skip
    return dx, dw_partial.sum(0).to(weight.dtype), db_partial.sum(0).to(weight.dtype)


def _rows(t: torch.Tensor) -> torch.Tensor:
    """t as [rows, N] with unit-stride rows (a view when it already has them)."""
    t2d = t.reshape(-1, t.shape[-1])
    return t2d if t2d.stride(-1) == 1 else t2d.contiguous()


def _statistics(x: torch.Tensor) -> torch.Tensor:
    return torch.empty(x.numel() // x.shape[-1], dtype=torch.float32, device=x.device)


def _layer_norm_fake(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return torch.empty(x.shape, dtype=x.dtype, device=x.device), _statistics(x), _statistics(x)


@kernel_op("layer_norm", _layer_norm_fake)
def layer_norm_op(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """y (x's shape and dtype, contiguous), and the mean and rstd of each row ([rows] fp32) the backward reuses."""
    with on_device(x):
        y, mean, rstd = layer_norm_fwd(_rows(x), weight.contiguous(), bias.contiguous(), eps)
    return y.view(x.shape), mean, rstd


def _layer_norm_backward_fake(
    dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, mean: torch.Tensor, rstd: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return torch.empty(x.shape, dtype=x.dtype, device=x.device), torch.empty_like(weight), torch.empty_like(weight)


@kernel_op("layer_norm_backward", _layer_norm_backward_fake)
def layer_norm_backward_op(
    dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, mean: torch.Tensor, rstd: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """dx (x's shape and dtype, contiguous), dweight and dbias (the weight's dtype)."""
    with on_device(x):
        dx, dw, db = layer_norm_bwd(_rows(dy), _rows(x), weight.contiguous(), mean, rstd)
    return dx.view(x.shape), dw, db


def _layer_norm_setup(ctx: Any, inputs: tuple[Any, ...], output: tuple[torch.Tensor, ...]) -> None:
    x, weight, _bias, _eps = inputs
    _y, mean, rstd = output
    ctx.save_for_backward(x, weight, mean, rstd)


def _layer_norm_backward(ctx: Any, dy: torch.Tensor, *_statistics_grads: Any) -> tuple[torch.Tensor | None, ...]:
    """y = (x - mean) * rstd * w + b over the last dim, rstd = 1 / sqrt(var + eps).

    With xhat = (x - mean) * rstd and g = dy * w (per row, means over the N columns):
      dx = rstd * (g - mean(g) - xhat * mean(g * xhat))
      dw = sum over rows of dy * xhat,   db = sum over rows of dy
    mean and rstd are saved statistics, not results anyone differentiates: their gradients are ignored.
    """
    x, weight, mean, rstd = ctx.saved_tensors
    dx, dw, db = layer_norm_backward_op(dy, x, weight, mean, rstd)
    return dx, dw, db, None


layer_norm_op.register_autograd(_layer_norm_backward, setup_context=_layer_norm_setup)


def layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float = 1e-5) -> torch.Tensor:
    """Fused LayerNorm over the last dim; output in x's dtype, statistics in fp32."""
    return layer_norm_op(x, weight, bias, eps)[0]


class FusedLayerNorm(torch.nn.Module):
    """Drop-in for torch.nn.LayerNorm(hidden) running the fused kernel."""

    def __init__(self, hidden: int, eps: float = 1e-5, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.ones(hidden, dtype=dtype))
        self.bias = torch.nn.Parameter(torch.zeros(hidden, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return layer_norm(x, self.weight, self.bias, self.eps)
