"""`bench --quick` end to end on bloom-micro-test: the three contenders, the kernel table and the ceilings, measured in
one run, with the FLOP convention the step events use; its JSON read back. No speed is asserted (a shared 2-core
machine is too noisy for that): docs/PERFORMANCE.md records the measured figures."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from appliance.benchmark.report import REQUIRED_KEYS, read_json

ROOT = Path(__file__).resolve().parents[2]
# bloom-micro-test: L=2, h=64, f=256, padded V=512, s=32. 6N + 6 L s h (test_planner_layout.py writes N out).
MICRO_FLOPS_PER_TOKEN = 6 * 131072 + 6 * 2 * 32 * 64


@pytest.fixture(scope="module")
def result(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, str]:
    out = tmp_path_factory.mktemp("bench") / "bench.json"
    done = subprocess.run(
        [sys.executable, str(ROOT / "bloom_appliance.py"), "bench", "--quick", "--out", str(out)],
        capture_output=True, text=True, timeout=300, cwd=ROOT,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    return read_json(out), done.stdout


def test_writes_the_public_keys(result):
    payload, _ = result
    assert set(REQUIRED_KEYS) <= set(payload)
    for key in ("tokens_per_s", "tokens_per_s_hf_eager", "tokens_per_s_hf_compile"):
        assert payload[key] > 0
    assert payload["ratio_vs_hf_eager"] == pytest.approx(payload["tokens_per_s"] / payload["tokens_per_s_hf_eager"])
    assert payload["ratio_vs_hf_compile"] == pytest.approx(payload["tokens_per_s"] / payload["tokens_per_s_hf_compile"])
    assert payload["date"] and payload["versions"]["torch"] and payload["versions"]["transformers"]
    assert payload["model"] == "bloom-micro-test"


def test_every_contender_trains_the_same_tokens(result):
    payload, _ = result
    work = payload["workload"]
    assert work["tokens_per_step"] == work["micro_batches"] * work["micro_batch_size"] * work["seq_len"]
    assert len(payload["contenders"]) == 3
    for contender in payload["contenders"].values():
        assert contender["steps_timed"] == work["steps"]
        assert contender["tokens_per_s"] == pytest.approx(work["tokens_per_step"] / contender["median_step_s"])


def test_mfu_uses_the_flop_convention_of_the_step_events(result):
    payload, _ = result
    assert payload["model_flops_per_token"] == MICRO_FLOPS_PER_TOKEN
    tflops = payload["tokens_per_s"] * MICRO_FLOPS_PER_TOKEN / 1e12
    assert payload["tflops_per_device"] == pytest.approx(tflops)
    assert payload["mfu"] == pytest.approx(tflops / payload["peak_tflops_per_device"])


def test_kernel_table_at_every_head_dim_with_ceilings(result):
    payload, stdout = result
    assert payload["ceilings"]["copy_gbps"] > 0 and payload["ceilings"]["matmul_tflops"] > 0
    rows = {(r["kernel"], r["pass"]): r for r in payload["kernels"]}
    for d in (64, 80, 96, 128):
        fwd = rows[(f"flash_attention_d{d}", "fwd")]
        assert fwd["correct"] and fwd["ms"] > 0
        assert isinstance(fwd["flex_attention_ms"], float)  # FlexAttention with the ALiBi score_mod, measured
    # One training step calls LayerNorm 2 per block + the embedding's + the final one: 6 for 2 blocks, forward only
    # (the backward runs through autograd, not through the registry).
    assert rows[("layer_norm", "fwd")]["calls_per_step"] == 6
    assert "transformers eager" in stdout and "flash_attention_d80" in stdout


def test_read_json_names_the_missing_keys(tmp_path):
    path = tmp_path / "other.json"
    path.write_text(json.dumps({"device": "cpu", "tokens_per_s": 1.0}))
    with pytest.raises(ValueError, match=r"other\.json.*tokens_per_s_hf_eager, tokens_per_s_hf_compile, mfu"):
        read_json(path)
