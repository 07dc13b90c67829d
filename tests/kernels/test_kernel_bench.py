"""bench/kernels.py without a GPU (any GPU of the machine hidden from it): a clear refusal, or with --allow-cpu a
smoke run that writes its JSON."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from appliance.parallel.testing import RANK_ENVIRONMENT

BENCH = Path(__file__).resolve().parents[2] / "bench" / "kernels.py"


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, **RANK_ENVIRONMENT}  # no CUDA device visible, on any machine
    env.pop("TRITON_INTERPRET", None)  # bench/kernels.py sets it itself for --allow-cpu
    return subprocess.run([sys.executable, str(BENCH), *args], capture_output=True, text=True, timeout=300, env=env)


def test_refuses_without_gpu() -> None:
    result = _run()
    assert result.returncode == 1
    assert "needs a CUDA GPU" in result.stderr and "--allow-cpu" in result.stderr


def test_cpu_smoke_run_writes_results(tmp_path: Path) -> None:
    result = _run("--allow-cpu", "--out", str(tmp_path))
    assert result.returncode == 0, result.stdout + result.stderr
    (path,) = tmp_path.glob("*-cpu-interpreter-kernels.json")
    payload = json.loads(path.read_text())
    assert payload["device"] == "cpu-interpreter" and payload["date"] in path.name
    assert set(payload["ceilings"]) == {"copy_gbps", "matmul_tflops", "matmul_dtype"}
    kernels = {(r["kernel"], r["pass"]) for r in payload["records"]}
    names = ["layer_norm", "bias_gelu", "alibi_softmax", "flash_attention_d64", "flash_attention_d128",
             "vocab_cross_entropy"]  # fmt: skip
    assert kernels == {(name, passes) for name in names for passes in ("fwd", "fwd+bwd")}
    for record in payload["records"]:
        assert record["correct"], record
        assert record["ms"] > 0 and record["pct_of_ceiling"] > 0
        assert "torch_compile_ms" in record or "torch_compile_sdpa_ms" in record
