"""The kernels compile for real GPUs, with the tile sizes the launchers pick there, without a GPU.

Triton ships ptxas, so each kernel is compiled ahead of time for sm_90 (H100) and sm_80 (A100): that catches
what the CPU interpreter cannot (an op the GPU backend rejects, a tile over the shared-memory limit) and checks
that ptxas spills no registers. The compile runs in a subprocess, because this directory's conftest switches
@triton.jit to the interpreter.
"""

from __future__ import annotations

import inspect
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SHARED_MEMORY_LIMIT = {90: 232448, 80: 166912}  # bytes of dynamic shared memory per block (H100, A100)


def _signature(fn, dtype: str, fp32: tuple[str, ...], floats: tuple[str, ...], constexprs: dict) -> dict[str, str]:
    """Kernel argument types: capitalized names are pointers (fp32 for `fp32`, int64 for Labels), `floats` are fp32
    scalars, other names int32."""
    types = {}
    for name in inspect.signature(fn.fn).parameters:
        if name in constexprs:
            types[name] = "constexpr"
        elif name[0].isupper() and name != "N":
            types[name] = "*i64" if name == "Labels" else "*fp32" if name in fp32 else f"*{dtype}"
        else:
            types[name] = "fp32" if name in floats else "i32"
    return types


def _compile_matrix() -> list[dict]:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from kernels import bias_gelu, cross_entropy, flash_attention, layer_norm, softmax

    ptxas = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
    results = []

    def build(cc: int, name: str, fn, fp32=(), floats=(), constexprs=None, warps=4, stages=3, dtype="bf16") -> None:
        constexprs = constexprs or {}
        source = ASTSource(fn=fn, signature=_signature(fn, dtype, fp32, floats, constexprs), constexprs=constexprs)
        compiled = triton.compile(source, target=GPUTarget("cuda", cc, 32),
                                  options={"num_warps": warps, "num_stages": stages})  # fmt: skip
        ptx = Path(os.environ["COMPILE_TMP"]) / f"{name}-{cc}.ptx"
        ptx.write_text(compiled.asm["ptx"])
        arch = "sm_90a" if cc == 90 else f"sm_{cc}"
        report = subprocess.run([str(ptxas), f"-arch={arch}", "-v", str(ptx), "-o", os.devnull],
                                capture_output=True, text=True, check=True).stderr  # fmt: skip
        # ptxas -v prints e.g. "0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads"
        spills = sum(int(part.split()[0]) for line in report.splitlines() for part in line.split(",")
                     if part.strip().endswith("bytes spill stores"))  # fmt: skip
        results.append({"cc": cc, "kernel": name, "shared": compiled.metadata.shared, "spill_bytes": spills})

    for cc in (90, 80):
        for d in (64, 128) if cc == 90 else (128,):  # before sm_90, head dim 128 is the tight one for registers
            cfg = _gpu_flash_blocks(flash_attention, d, cc)
            common = {"CAUSAL": True, "DOT_FP32": False, "PRECISION": None, "BLOCK_D": cfg["block_d"]}
            build(cc, f"flash_fwd_d{d}", flash_attention._flash_fwd_kernel, ("Slopes", "LSE"), ("scale2",),
                  common | {"BLOCK_M": cfg["fwd_m"], "BLOCK_N": cfg["fwd_n"]}, cfg["warps"], cfg["stages"])  # fmt: skip
            for part in ("dkdv", "dq"):
                build(cc, f"flash_{part}_d{d}", getattr(flash_attention, f"_flash_bwd_{part}_kernel"),
                      ("Slopes", "LSE", "Delta"), ("scale", "scale2"),
                      common | {"BLOCK_M": cfg[f"{part}_m"], "BLOCK_N": cfg[f"{part}_n"]}, cfg["warps"], 2)  # fmt: skip
        if cc == 80:
            continue  # the memory-bound kernels below compile alike on both; sm_90 is enough for them
        rows, block, warps = layer_norm._tile(14336, True)
        build(cc, "layer_norm_fwd", layer_norm._layer_norm_fwd_kernel, ("Mean", "Rstd"), ("eps",),
              {"BLOCK_R": rows, "BLOCK_N": block}, warps)  # fmt: skip
        rows, block, warps = layer_norm._tile(layer_norm.FUSED_BWD_MAX, True)
        build(cc, "layer_norm_bwd_fused", layer_norm._layer_norm_bwd_kernel,
              ("Mean", "Rstd", "DW_partial", "DB_partial"), (), {"BLOCK_R": rows, "BLOCK_N": block}, warps)  # fmt: skip
        build(cc, "layer_norm_bwd_row_terms", layer_norm._layer_norm_bwd_row_terms_kernel,
              ("Mean", "Rstd", "C1", "C2"), (), {"BLOCK_N": 2048}, 8)  # fmt: skip
        partials = ("Mean", "Rstd", "C1", "C2", "DW_partial", "DB_partial")
        build(cc, "layer_norm_bwd_columns", layer_norm._layer_norm_bwd_columns_kernel, partials, (),
              {"BLOCK_R": 16, "BLOCK_C": 256}, 8)  # fmt: skip
        build(cc, "bias_gelu_fwd", bias_gelu._bias_gelu_fwd_kernel, (), (), {"BLOCK_M": 64, "BLOCK_N": 128}, 8)
        build(cc, "bias_gelu_bwd", bias_gelu._bias_gelu_bwd_kernel, ("DB_partial",), (),
              {"BLOCK_M": 64, "BLOCK_N": 128}, 8)  # fmt: skip
        rows, block, warps = softmax._tile(2048, 2048, True)
        build(cc, "alibi_softmax_fwd", softmax._alibi_softmax_fwd_kernel, ("Slopes", "KeyPos"), ("scale",),
              {"CAUSAL": True, "HAS_PADDING": True, "BLOCK_R": rows, "BLOCK_K": block}, warps)  # fmt: skip
        build(cc, "alibi_softmax_bwd", softmax._alibi_softmax_bwd_kernel, (), ("scale",),
              {"BLOCK_R": rows, "BLOCK_K": block}, warps)  # fmt: skip
        rows, block, warps = cross_entropy._tile(62720, True)
        build(cc, "ce_stats", cross_entropy._ce_stats_kernel, ("RowMax", "SumExp", "Target"), (),
              {"BLOCK_R": rows, "BLOCK_V": block}, warps)  # fmt: skip
        build(cc, "ce_grad", cross_entropy._ce_grad_kernel, ("LSE",), ("inv_count",),
              {"BLOCK_R": rows, "BLOCK_V": block}, warps)  # fmt: skip
    return results


def _gpu_flash_blocks(flash_attention, d: int, cc: int) -> dict[str, int]:
    """The launcher's GPU tile sizes for compute capability cc (it asks the device, which is absent here)."""
    import torch

    real = torch.cuda.get_device_capability
    torch.cuda.get_device_capability = lambda device=None: (cc // 10, cc % 10)
    try:
        return flash_attention._blocks(d, torch.bfloat16, torch.device("cuda"))
    finally:
        torch.cuda.get_device_capability = real


def test_kernels_compile_for_sm90_and_sm80(tmp_path: Path) -> None:
    import triton

    if not (Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas").exists():
        pytest.skip("this triton build ships no ptxas")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env |= {"COMPILE_TMP": str(tmp_path), "TRITON_CACHE_DIR": str(tmp_path / "cache")}
    run = subprocess.run([sys.executable, __file__], capture_output=True, text=True, env=env, cwd=ROOT, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    results = json.loads(run.stdout.splitlines()[-1])
    assert len(results) == 19  # 6 flash kernels on sm_90, 3 on sm_80, 10 memory-bound kernels on sm_90
    for r in results:
        assert r["shared"] <= SHARED_MEMORY_LIMIT[r["cc"]], r
        assert r["spill_bytes"] == 0, r


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    print(json.dumps(_compile_matrix()))
