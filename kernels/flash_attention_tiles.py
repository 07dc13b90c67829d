"""Which tiles flash attention's kernels launch with: the configuration per head dim, dtype and GPU
(`launch_config`), the ones the measured selection found fastest at a run's shape (`TUNED_TILES`, filled by
kernels/selection.py), and the list it times (`tile_candidates`). kernels/flash_attention.py's launchers ask
`tiles` on every call; launch_config is cached, so that costs two dictionary lookups."""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import cache

import torch
import triton


@dataclass(frozen=True)
class FlashConfig:
    """Tile sizes per kernel (queries x keys): fwd_m x fwd_n forward, dkdv_m x dkdv_n and dq_m x dq_n backward."""

    fwd_m: int
    fwd_n: int
    dkdv_m: int
    dkdv_n: int
    dq_m: int
    dq_n: int
    block_d: int
    warps: int
    stages: int  # forward; the backward kernels pipeline at most 2 stages (see bwd_stages)
    dot_fp32: bool  # dots on fp32 copies of the tiles (the interpreter's dot has no bf16)
    precision: str | None  # tl.dot input_precision: "ieee" for fp32 inputs (exact, not tf32), else the default

    @property
    def bwd_stages(self) -> int:
        return min(self.stages, 2)


@cache  # pure: asked on every launch, at a handful of arguments
def launch_config(head_dim: int, dtype: torch.dtype, capability: int | None, documents: bool = False) -> FlashConfig:
    """The tiles the launchers use for this head dim and dtype on a GPU of this compute capability (None: the
    CPU interpreter).

    GPU, bf16/fp16: FA2-style 128 x 64 forward, 64 x 64 backward, narrowed where ptxas spills. Measured with
    `python -m bench.kernels_compile` (docs/PERFORMANCE.md; 255 registers per thread at most): dk/dv at 64 x 64
    spills 24 bytes per thread at head dim 64 on sm_80 (4 warps), so before sm_90 its query block is 32 (242
    registers). At head dim 128 (8 warps) the blocks narrowed to 32 (forward and dk/dv before sm_90, dq) were
    expected to spill at full size; compiled with real-launch specialisations they do not (forward 128 x 64:
    220 registers on sm_80; dk/dv 64 x 64: 238; dq 64 x 64: 170 on sm_80, 156 on sm_90). They stay narrow until
    timings on the GPUs decide.
    fp32 (exact ieee dots, no tensor cores): 64 x 32 forward tiles spilled on both targets (16 to 648 bytes per
    thread), 32 x 16 do not; the backward's 32 x 32 tiles do not; two stages.
    Interpreter: 16 queries x 8 keys, so tiny test shapes still cross block borders and ragged tails.
    With document ids (`documents`) every key block is masked and loads its ids: on sm_80 at head dim 64 the
    forward (128 x 64) spilled 40 bytes per thread and dq (64 x 64) 16 bytes, so there their key blocks are 32
    (no spill); every other documents build compiled without spills at the tiles above (2026-11-24).
    """
    # fp32 inputs use exact ieee dots, not tf32; other dtypes keep Triton's default.
    precision = "ieee" if dtype == torch.float32 else None
    if capability is None:
        # The interpreter's dot mishandles bf16 (numpy has no bf16), so there tiles go through fp32, which is
        # exact for bf16 inputs and matches the GPU's fp32 accumulation.
        return FlashConfig(16, 8, 16, 8, 16, 8, triton.next_power_of_2(head_dim), 1, 1, True, precision)
    block_d = max(16, triton.next_power_of_2(head_dim))  # tensor-core dots need K >= 16
    warps = 4 if block_d <= 64 else 8
    if dtype == torch.float32:
        return FlashConfig(32, 16, 32, 32, 32, 32, block_d, warps, 2, False, precision)
    wide = block_d > 64
    before_hopper = capability < 90
    narrow_keys = wide or (documents and before_hopper)
    return FlashConfig(
        fwd_m=128, fwd_n=32 if narrow_keys and before_hopper else 64, dkdv_m=32 if before_hopper else 64,
        dkdv_n=64, dq_m=64, dq_n=32 if narrow_keys else 64, block_d=block_d, warps=warps, stages=3,
        dot_fp32=False, precision=precision,
    )  # fmt: skip


# (head dim, dtype, compute capability, documents, q_len, k_len) -> the tiles measured fastest at that shape on this
# GPU, filled by the measured kernel selection (kernels/selection.py tune_flash_tiles); launch_config elsewhere.
TUNED_TILES: dict[tuple[int, torch.dtype, int, bool, int, int], FlashConfig] = {}


def tiles(
    head_dim: int, dtype: torch.dtype, capability: int | None, documents: bool, q_len: int, k_len: int
) -> FlashConfig:
    """The tiles a launch uses: the tuned ones for this shape where the selection measured some, else
    launch_config's (always on the interpreter)."""
    if capability is not None:
        tuned = TUNED_TILES.get((head_dim, dtype, capability, documents, q_len, k_len))
        if tuned is not None:
            return tuned
    return launch_config(head_dim, dtype, capability, documents)


def tile_candidates(
    head_dim: int, dtype: torch.dtype, capability: int | None, documents: bool = False
) -> tuple[FlashConfig, ...]:
    """The tiles the measured selection times at a run's shape, launch_config's first. Only for 16-bit inputs on a
    GPU (fp32's tiles are bounded by spills, the interpreter's by test shapes). Each variation compiles without
    spills for every head dim it is offered at, with and without documents, on sm_80 and sm_90
    (`python -m bench.kernels_compile --tile-candidates`, tests/kernels/test_kernel_compile.py); those that
    spilled there are left out: FA2's 128 x 128 forward at head dim 64 (64-392 bytes per thread), Triton's tutorial
    dk/dv tile 32 x 128 (80-1072 bytes), 16 warps at head dim 128 (8-216 bytes), and 4 stages at head dim 64 with
    documents (16 bytes on sm_90).

    On Hopper (sm_90 and later) three more, with 128-key blocks, which the 227 KiB of shared memory a block may
    use there hold: the forward at 128 x 128 (two warp groups at head dim 64, where 4 warps spilled; two stages at
    head dims above 64, 161 KiB of shared memory), Triton's tutorial dk/dv tile 32 x 128 (8 warps at head dim 64),
    and both with the tutorial's dq tile 128 x 32. Compiled for sm_90 with triton 3.7.1's ptxas without spills,
    with and without documents (2026-11-28; 243-255 registers per thread in the 128 x 128 forwards, the closest to
    the limit)."""
    default = launch_config(head_dim, dtype, capability, documents)
    if capability is None or dtype == torch.float32:
        return (default,)
    narrow_head = default.block_d <= 64
    variants = [
        replace(default, fwd_m=64),  # half the forward's query block: twice the programs to fill 132 SMs
        replace(default, dq_m=128, dq_n=32),  # dq over wide query blocks and narrow key blocks (the tutorial's)
    ]
    if narrow_head:
        variants.append(replace(default, warps=8))  # more warps on the same tiles
    if not narrow_head or not documents:
        variants.append(replace(default, stages=4))  # a deeper software pipeline for the forward's K/V loads
    if capability >= 90:
        # Two warp groups at head dim 64 (4 warps spilled); two stages above it (shared memory).
        wide_keys = replace(default, fwd_n=128, warps=8) if narrow_head else replace(default, fwd_n=128, stages=2)
        tutorial_dkdv = replace(default, dkdv_m=32, dkdv_n=128, warps=8 if narrow_head else default.warps)
        variants += [wide_keys, tutorial_dkdv, replace(wide_keys, dkdv_m=32, dkdv_n=128, dq_m=128, dq_n=32)]
    return tuple(dict.fromkeys([default, *variants]))
