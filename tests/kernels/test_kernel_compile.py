"""The kernels compile for real GPUs, as real launches specialise them, without a GPU.

`python -m bench.kernels_compile` runs the launchers on meta tensors laid out as training lays them out (every
GPU model preset), as if on sm_80 (A100) and sm_90 (H100), and compiles what they launch with the ptxas Triton
ships (kernels.aot). That catches what the CPU interpreter cannot: an op the GPU backend rejects, a tile over
the shared-memory limit, register spills. It runs in a subprocess because this directory's conftest switches
@triton.jit to the interpreter. The unmarked test compiles one launch per kernel and target (the largest model
that launches it); the slow one the whole matrix (every preset, bf16, and fp32 for flash attention).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from bench.kernels_compile import training_shapes
from kernels import flash_attention, layer_norm
from kernels.aot import REGISTERS_PER_SM, REGISTERS_PER_THREAD, SHARED_MEMORY_PER_BLOCK
from kernels.launch import A100, H100, recording

ROOT = Path(__file__).resolve().parents[2]
KERNELS = {
    "_layer_norm_fwd_kernel", "_layer_norm_bwd_kernel", "_layer_norm_bwd_row_terms_kernel",
    "_layer_norm_bwd_columns_kernel", "_bias_gelu_fwd_kernel", "_bias_gelu_bwd_kernel", "_flash_fwd_kernel",
    "_flash_bwd_preprocess_kernel", "_flash_bwd_dkdv_kernel", "_flash_bwd_dq_kernel", "_alibi_softmax_fwd_kernel",
    "_alibi_softmax_bwd_kernel", "_ce_stats_kernel", "_ce_grad_kernel", "_ce_fused_kernel",
}  # fmt: skip


def _ptxas_shipped() -> bool:
    import triton

    return (Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas").exists()


needs_ptxas = pytest.mark.skipif(not _ptxas_shipped(), reason="this triton build ships no ptxas")


@pytest.fixture(scope="session")
def triton_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One Triton cache for the session: the full matrix reuses the quick run's builds."""
    return tmp_path_factory.mktemp("triton-cache")


def _compile(cache: Path, out: Path, *flags: str) -> list[dict]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"} | {"TRITON_CACHE_DIR": str(cache)}
    run = subprocess.run(
        [sys.executable, "-m", "bench.kernels_compile", "--json", str(out), *flags],
        capture_output=True, text=True, env=env, cwd=ROOT, timeout=900,
    )  # fmt: skip
    # exit status 1 only flags problems, which the assertions below name; anything else is a failed compile
    assert run.returncode in (0, 1) and out.exists(), run.stdout[-2000:] + run.stderr[-4000:]
    return json.loads(out.read_text())


@pytest.fixture(scope="session")
def quick_builds(triton_cache: Path, tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    return _compile(triton_cache, tmp_path_factory.mktemp("compile") / "quick.json", "--quick")


def _check_limits(builds: list[dict]) -> None:
    # CUDA C++ Programming Guide, "Technical Specifications per Compute Capability": shared memory per thread
    # block with opt-in 163 KiB on 8.0 (A100), 227 KiB on 9.0 (H100); 255 registers per thread and 64 Ki
    # registers per SM on both.
    assert SHARED_MEMORY_PER_BLOCK == {80: 166912, 90: 232448}
    assert (REGISTERS_PER_THREAD, REGISTERS_PER_SM) == (255, 65536)
    for b in builds:
        where = f"{b['kernel']} sm_{b['capability']} {b['dtype']} {b['sizes']} {b['constexprs']}"
        assert b["stack_bytes"] == 0, f"{where}: spills {b['stack_bytes']} bytes per thread"
        assert 0 < b["registers"] <= REGISTERS_PER_THREAD, where
        assert b["registers"] * 32 * b["num_warps"] <= REGISTERS_PER_SM, where
        assert b["shared_bytes"] <= SHARED_MEMORY_PER_BLOCK[b["capability"]], where
        assert b["problems"] == [], where


def _check_specialised(builds: list[dict]) -> None:
    """Pointers 16-byte aligned and strides divisible by 16 (or the constant 1), as on a real launch with
    contiguous bf16 tensors whose last dimension is a multiple of 8; inputs in the dtype trained with."""
    for b in builds:
        pointers = [name for name, ty in b["signature"].items() if ty.startswith("*")]
        assert set(pointers) <= set(b["divisible"]), b
        strides = [name for name in b["signature"] if name.startswith("stride")]
        assert all(name in b["divisible"] or name in b["ones"] for name in strides), b
        first = b["signature"][pointers[0]]
        assert first == {"bfloat16": "*bf16", "float32": "*fp32"}[b["dtype"]], b


@needs_ptxas
def test_each_kernel_compiles_for_sm80_and_sm90_without_spills(quick_builds: list[dict]) -> None:
    assert {(b["kernel"], b["capability"]) for b in quick_builds} == {(k, cc) for k in KERNELS for cc in (80, 90)}
    assert len(quick_builds) == 2 * len(KERNELS)
    _check_limits(quick_builds)
    _check_specialised(quick_builds)


@needs_ptxas
def test_compiled_tiles_are_the_launchers_choice_per_target(quick_builds: list[dict]) -> None:
    for cc in (80, 90):
        cfg = flash_attention.launch_config(128, torch.bfloat16, cc)
        (fwd,) = [b for b in quick_builds if b["kernel"] == "_flash_fwd_kernel" and b["capability"] == cc]
        assert fwd["sizes"] == ["d=128"]
        assert (fwd["constexprs"]["BLOCK_M"], fwd["constexprs"]["BLOCK_N"]) == (cfg.fwd_m, cfg.fwd_n)
        assert (fwd["num_warps"], fwd["num_stages"]) == (cfg.warps, cfg.stages)
        assert fwd["constexprs"]["DOT_FP32"] is False  # tensor-core dots, not the interpreter's fp32 copies
        (ln,) = [b for b in quick_builds if b["kernel"] == "_layer_norm_fwd_kernel" and b["capability"] == cc]
        rows, block, warps = layer_norm.launch_config(14336, cc)
        assert (ln["constexprs"]["BLOCK_R"], ln["constexprs"]["BLOCK_N"], ln["num_warps"]) == (rows, block, warps)


def test_launchers_pick_tiles_for_the_recorded_target() -> None:
    qkv = torch.empty(1, 64, 4, 3, 128, dtype=torch.bfloat16, device="meta")
    q, k, v = (qkv[..., i, :].transpose(1, 2) for i in range(3))
    slopes = torch.empty(4, device="meta")
    for target in (A100, H100):
        with recording(target) as launches:
            flash_attention.flash_fwd(q, k, v, slopes, True, 0.1)
        (launch,) = launches
        expected = flash_attention.launch_config(128, torch.bfloat16, target.capability)
        assert launch.options["BLOCK_N"] == expected.fwd_n and launch.options["DOT_FP32"] is False
    # sm_80 narrows the forward's key block at head dim 128; sm_90 keeps 64
    assert flash_attention.launch_config(128, torch.bfloat16, 80).fwd_n == 32
    assert flash_attention.launch_config(128, torch.bfloat16, 90).fwd_n == 64
    with pytest.raises(RuntimeError, match="already recording"), recording(A100), recording(H100):
        pass


def test_matrix_covers_every_gpu_preset_head_dim() -> None:
    # BLOOM-560m 64, 1b1 96, 1b7 128, 3b 80, 7b1 128, 176b 128 (hidden / heads in presets/models); BLOOM-MoE-176b
    # has 176b's attention (its experts are BLOOM MLPs: the same GeLU and GEMM shapes)
    shapes = {s.model: s for s in training_shapes()}
    assert {name: s.head_dim for name, s in shapes.items()} == {
        "bloom-560m": 64, "bloom-1b1": 96, "bloom-1b7": 128, "bloom-3b": 80, "bloom-7b1": 128, "bloom-176b": 128,
        "bloom-moe-176b": 128,
    }  # fmt: skip
    # BLOOM-176B per rank at its reference layout (tp=4): 28 heads, a quarter of the padded vocabulary
    assert (shapes["bloom-176b"].tp, shapes["bloom-176b"].heads, shapes["bloom-176b"].vocab) == (4, 28, 62720)


@needs_ptxas
@pytest.mark.slow
def test_whole_matrix_compiles_without_spills(triton_cache: Path, tmp_path: Path) -> None:
    builds = _compile(triton_cache, tmp_path / "full.json")
    assert {b["kernel"] for b in builds} == KERNELS and {b["capability"] for b in builds} == {80, 90}
    flash = [b for b in builds if b["kernel"] == "_flash_fwd_kernel"]
    for cc in (80, 90):
        for dtype in ("bfloat16", "float32"):
            sizes = {s for b in flash if (b["capability"], b["dtype"]) == (cc, dtype) for s in b["sizes"]}
            assert sizes == {"d=64", "d=80", "d=96", "d=128"}, (cc, dtype)
    _check_limits(builds)
    _check_specialised(builds)


@needs_ptxas
@pytest.mark.slow
def test_flash_tile_candidates_compile_without_spills(triton_cache: Path, tmp_path: Path) -> None:
    # Every tile configuration the measured selection may time and install (kernels/selection.py), at each GPU
    # preset's head dim, without and with documents, as the launchers launch it once installed.
    builds = _compile(triton_cache, tmp_path / "tiles.json", "--tile-candidates")
    _check_limits(builds)
    _check_specialised(builds)
    for cc in (80, 90):
        for d in (64, 80, 96, 128):
            for documents in (False, True):
                candidates = flash_attention.tile_candidates(d, torch.bfloat16, cc, documents)
                assert len(candidates) >= 4
                compiled = {
                    (b["constexprs"]["BLOCK_M"], b["constexprs"]["BLOCK_N"], b["num_warps"], b["num_stages"])
                    for b in builds
                    if b["kernel"] == "_flash_fwd_kernel" and b["capability"] == cc and f"d={d}" in b["sizes"]
                    and b["constexprs"]["HAS_DOCS"] is documents
                }  # fmt: skip
                assert compiled == {(c.fwd_m, c.fwd_n, c.warps, c.stages) for c in candidates}, (cc, d, documents)
