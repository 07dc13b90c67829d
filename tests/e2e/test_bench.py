"""`bench --quick` end to end on bloom-micro-test, on the CPU (GPUs hidden): the three contenders, the kernel table and
the ceilings, measured in one run, with the FLOP convention the step events use; its JSON read back. The sizing
flags and --profile; bad flags; the one-after-the-other order a GPU uses, with a contender out of memory. No speed
is asserted (a shared 2-core machine is too noisy for that): docs/PERFORMANCE.md records the measured figures. On a
GPU, `bench --quick --profile` itself (marked gpu)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from appliance_cli import cpu_only_env

from appliance import cli
from appliance.benchmark.report import REQUIRED_KEYS, read_json

ROOT = Path(__file__).resolve().parents[2]
# bloom-micro-test: L=2, h=64, f=256, padded V=512, s=32. 6N + 6 L s h (test_planner_layout.py writes N out).
MICRO_FLOPS_PER_TOKEN = 6 * 131072 + 6 * 2 * 32 * 64
# `bench --quick` took 6 s on the idle 2-core VM and 21-29 s with its load average at 6-10 (2026-11-26): the bound
# leaves room for a busier shared machine and still fails a smoke run that grew into a benchmark.
QUICK_SECONDS = 120


def _bench(*args: str, env: dict[str, str] | None = None, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    """`bench` in a subprocess, on the CPU unless `env` shows it a GPU."""
    command = [sys.executable, str(ROOT / "bloom_appliance.py"), "bench", *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=timeout, cwd=ROOT, env=env or cpu_only_env())


@pytest.fixture(scope="module")
def result(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, str]:
    out = tmp_path_factory.mktemp("bench") / "bench.json"
    started = time.monotonic()
    done = _bench("--quick", "--out", str(out))
    seconds = time.monotonic() - started
    assert done.returncode == 0, done.stdout + done.stderr
    assert seconds < QUICK_SECONDS, f"bench --quick took {seconds:.0f} s on CPU"
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
        assert contender["status"] == "ok" and contender["steps_timed"] == work["steps"]
        assert contender["peak_memory_gb"] is None  # CPU: no device allocator
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
        assert fwd["correct"] and fwd["ms"] > 0 and fwd["cpu_us"] > 0 and fwd["torch_eager_sdpa_cpu_us"] > 0
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


def test_sizing_flags_and_profile(tmp_path: Path) -> None:
    out = tmp_path / "sized.json"
    done = _bench("--quick", "--micro-batch", "2", "--micro-batches", "2", "--steps", "2", "--profile",
                  "--out", str(out))  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    payload = read_json(out)
    work = payload["workload"]
    assert (work["micro_batch_size"], work["micro_batches"], work["steps"]) == (2, 2, 2)
    assert work["tokens_per_step"] == 2 * 2 * 32 and work["warmup_steps"] == 1
    for key, (name, contender) in zip(("trainer", "hf-eager", "hf-compile"), payload["contenders"].items(),
                                      strict=True):  # fmt: skip
        assert contender["steps_timed"] == 2
        profile = contender["profile"]
        assert Path(profile["trace"]) == tmp_path / f"sized-{key}.trace.json"
        assert json.loads(Path(profile["trace"]).read_text())["traceEvents"]
        assert profile["steps"] == 3 and profile["gpu_idle_share"] is None and profile["top_kernels"] == []
        assert profile["top_ops"] and profile["host_syncs_per_step"] >= 1, name  # each step reads its loss
        assert f"profile of {name}" in done.stdout


@pytest.mark.parametrize("flag", ["--micro-batch", "--steps", "--micro-batches"])
def test_a_bad_size_exits_2_naming_the_flag(flag: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["bench", flag, "0"]) == 2
    assert f"{flag} 0: must be a whole number of at least 1" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exited:
        cli.main(["bench", flag, "two"])
    assert exited.value.code == 2 and f"argument {flag}: invalid int value: 'two'" in capsys.readouterr().err


# The GPU's order on the CPU: one contender after the other, the trainer released once (the peers used to release
# it again, each) and its parameters freed by then (on a GPU, its device memory); transformers eager runs out of
# memory at its first timed step, and the others are reported.
ONE_AFTER_THE_OTHER = """
import gc
import sys
import weakref
from collections import Counter
from pathlib import Path

import torch

from appliance.benchmark import command, trainer_speed
from appliance.benchmark.workload import Workload

Workload.interleaved = property(lambda self: False)
released = Counter()
release = trainer_speed.TrainerContender.release
def counted(self):
    released["trainer"] += 1
    parameters = [weakref.ref(p) for _, p in self.engine.named_parameters()]
    release(self)
    gc.collect()
    print("trainer parameters alive after its release:", sum(p() is not None for p in parameters))
trainer_speed.TrainerContender.release = counted

class EagerOutOfMemory(command.PeerContender):
    steps = 0
    def __call__(self, micro_batches):
        self.steps += 1
        if not self.compiled and self.steps == 2:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 9.00 GiB (injected)")
        return super().__call__(micro_batches)
command.PeerContender = EagerOutOfMemory

command.run_bench(None, Path(sys.argv[1]), quick=True)
print("trainer released", released["trainer"], "times")
"""


def test_one_after_the_other_with_a_contender_out_of_memory(tmp_path: Path) -> None:
    out = tmp_path / "sequential.json"
    done = subprocess.run([sys.executable, "-c", ONE_AFTER_THE_OTHER, str(out)], capture_output=True, text=True,
                          timeout=300, cwd=ROOT, env=cpu_only_env())  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    assert "trainer released 1 times" in done.stdout
    assert "trainer parameters alive after its release: 0" in done.stdout
    payload = read_json(out)
    assert payload["workload"]["interleaved"] is False
    trainer, eager, compiled = payload["contenders"].values()
    assert eager["status"] == "out_of_memory" and "9.00 GiB (injected)" in eager["error"]
    assert (eager["micro_batch_size"], eager["tokens_per_step"]) == (4, payload["workload"]["tokens_per_step"])
    assert trainer["status"] == compiled["status"] == "ok"
    assert trainer["steps_timed"] == compiled["steps_timed"] == payload["workload"]["steps"]
    assert payload["tokens_per_s_hf_eager"] is None and payload["ratio_vs_hf_eager"] is None
    assert payload["ratio_vs_hf_compile"] == pytest.approx(payload["tokens_per_s"] / compiled["tokens_per_s"])
    assert "out of memory" in done.stdout  # the table's row


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_quick_profile_on_the_gpu(tmp_path: Path) -> None:
    """The GPU check's bench: bloom-560m at micro-batch 2, the three contenders one after the other, profiled."""
    out = tmp_path / "gpu.json"
    done = _bench("--quick", "--profile", "--out", str(out), env=dict(os.environ), timeout=600)
    assert done.returncode == 0, done.stdout[-5000:] + done.stderr[-5000:]
    payload = read_json(out)
    assert payload["model"] == "bloom-560m" and payload["workload"]["interleaved"] is False
    for name, contender in payload["contenders"].items():
        assert contender["peak_memory_gb"] > 0, name
        if contender["status"] == "ok":
            profile = contender["profile"]
            assert profile["top_kernels"] and 0 <= profile["gpu_idle_share"] <= 1, name
            assert profile["launches_per_step"] > 0 and Path(profile["trace"]).exists(), name
    assert all(r["cpu_us"] > 0 for r in payload["kernels"] if r["correct"])


def test_contenders_and_the_kernel_table_can_be_left_out(tmp_path: Path) -> None:
    """--contenders runs only the named ones (the others recorded as skipped, no ratio against them) and
    --no-kernel-table leaves the kernel rows out: what a GPU check with minutes to spare runs."""
    out = tmp_path / "bench.json"
    done = _bench("--quick", "--contenders", "trainer,hf-compile", "--no-kernel-table", "--out", str(out))
    assert done.returncode == 0, done.stderr[-2000:]
    written = json.loads(out.read_text())
    statuses = {name: c.get("status", "ok") for name, c in written["contenders"].items()}
    assert list(statuses.values()) == ["ok", "skipped", "ok"], statuses
    assert written["tokens_per_s_hf_eager"] is None and written["ratio_vs_hf_eager"] is None
    assert written["ratio_vs_hf_compile"] is not None and written["kernels"] == []
    bad = _bench("--quick", "--contenders", "trainer,nobody", timeout=120)
    assert bad.returncode == 2 and "--contenders" in bad.stderr
