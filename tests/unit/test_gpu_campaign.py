"""bench/gpu_campaign.py without a GPU: the dry run's plan, the deadline's decisions on a fake clock, a run stopped at
its timeout, and what the campaign makes of the kernel measurements it leaves."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from bench import gpu_campaign as campaign
from kernels.selection_cache import SelectionCache, entry_key

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "bench" / "gpu_campaign.py"
BENCHES = {("bloom-560m", 2), ("bloom-560m", 8), ("bloom-1b7", 2), ("bloom-1b7", 8), ("bloom-1b7", 16)}


def _dry_run(tmp_path: Path, *flags: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(SCRIPT), "--out", str(tmp_path / "out"), "--dry-run", *flags],
        capture_output=True, text=True, timeout=60, cwd=tmp_path,
    )  # fmt: skip


def test_the_dry_run_prints_every_run_with_its_estimate_and_runs_nothing(tmp_path: Path) -> None:
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    done = _dry_run(tmp_path, "--wheels", str(wheels), "--deadline", "480")
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0] == "GPU campaign, deadline 480 s (5 s kept for the summary):"
    names = [line.split()[0] for line in lines[1:-1:2]]
    assert names == ["install-wheels", "kernels-gpu", "preflight-bloom-7b1", "flash-host-cost", "bloom-560m-mb2",
                     "bloom-560m-mb8", "bloom-1b7-mb8", "preflight-bloom-176b", "bloom-1b7-mb2",
                     "bloom-1b7-mb16"]  # fmt: skip
    commands = lines[2:-1:2]
    benches = [c for c in commands if " bloom_appliance.py bench " in c]
    assert {(c.split("--model ")[1].split()[0], int(c.split("--micro-batch ")[1].split()[0])) for c in benches} == (
        BENCHES
    )
    assert all("--contenders trainer,hf-compile" in c and str(tmp_path / "out") in c for c in benches)
    assert sum("--profile" in c for c in benches) == 1
    assert all("~" in line and " s (from " in line for line in lines[1:-1:2])
    assert lines[-1].startswith("estimated ") and "past the deadline: " in lines[-1]
    assert not (tmp_path / "out").exists()  # nothing written, nothing run


def test_the_dry_run_refuses_a_missing_wheel_folder_and_unknown_runs(tmp_path: Path) -> None:
    done = _dry_run(tmp_path, "--wheels", str(tmp_path / "nowhere"))
    assert done.returncode == 2 and "--wheels" in done.stderr and "not a folder" in done.stderr
    done = _dry_run(tmp_path, "--only", "bloom-1b7-mb8,bloom-7b1-mb2")
    assert done.returncode == 2 and "--only: no run named bloom-7b1-mb2 (the runs: kernels-gpu," in done.stderr


def test_a_second_call_takes_what_the_first_skipped(tmp_path: Path) -> None:
    done = _dry_run(tmp_path, "--only", "bloom-1b7-mb2, bloom-1b7-mb8", "--kernels-cache", str(SCRIPT))
    assert done.returncode == 0, done.stderr
    assert [line.split()[0] for line in done.stdout.splitlines()[1:-1:2]] == ["bloom-1b7-mb8", "bloom-1b7-mb2"]
    assert done.stdout.splitlines()[-1] == "estimated 210 s in all"  # with the selection read from the cache


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _run(name: str, estimate: float, floor: float) -> campaign.Run:
    return campaign.Run(name, ("true",), estimate, floor, name)


def test_runs_are_skipped_when_the_deadline_is_near() -> None:
    """Deadline 300 s, 5 kept for the summary: a takes 100 s, b is stopped at its 1.5 x 60 = 90 s, c would need
    100 s of the 105 left and runs, stopped at what is left; d (floor 10) finds 0 left and is skipped."""
    clock = FakeClock()
    durations = {"a": 100.0, "b": 500.0, "c": 500.0, "d": 1.0}
    given: dict[str, float] = {}

    def execute(run: campaign.Run, timeout: float) -> int:
        given[run.name] = timeout
        clock.now += min(durations[run.name], timeout)
        return 0 if durations[run.name] <= timeout else campaign.TIMED_OUT

    said: list[str] = []
    c = campaign.Campaign(300.0, execute, clock=clock, say=said.append)
    plan = [_run("a", 120, 30), _run("b", 60, 30), _run("c", 200, 100), _run("d", 50, 10)]
    results = [c.run(run) for run in plan]
    assert [r["status"] for r in results] == ["ok", "timed out", "timed out", "skipped"]
    assert given == {"a": 180.0, "b": 90.0, "c": 105.0}
    assert results[3] == {"name": "d", "status": "skipped", "left_s": 0.0, "floor_s": 10}
    assert said[-1] == "[  295 s] skip d: 0 s left, it needs 10"
    # The positive control: with a longer deadline the same plan runs d.
    clock.now = 0.0
    roomy = campaign.Campaign(2000.0, execute, clock=clock, say=said.append)
    assert [roomy.run(run)["status"] for run in plan] == ["ok", "timed out", "timed out", "ok"]


def test_the_plan_names_what_would_not_start() -> None:
    plan = [_run("a", 100, 30), _run("b", 100, 50), _run("c", 100, 60)]
    assert [r.name for r in campaign._beyond(plan, 250)] == ["c"]
    assert campaign._beyond(plan, 300) == []


def _running(pid: int) -> bool:
    """Whether the process is alive (a zombie left for a container's init to reap is not)."""
    try:
        return "State:\tZ" not in Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return False


def test_a_run_past_its_timeout_is_stopped_with_its_children(tmp_path: Path) -> None:
    child = (
        "import subprocess, sys, time; p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); "
        "print(p.pid, flush=True); time.sleep(60)"
    )
    run = campaign.Run("slow", (sys.executable, "-c", child), 1, 1, "")
    assert campaign.execute_in(tmp_path, {"PATH": ""})(run, 2.0) == campaign.TIMED_OUT
    grandchild = int((tmp_path / "slow.log").read_text().split()[0])
    for _ in range(50):  # SIGTERM is delivered at once; give the process a moment to go
        if not _running(grandchild):
            break
        time.sleep(0.05)
    assert not _running(grandchild)
    quick = campaign.Run("quick", (sys.executable, "-c", "raise SystemExit(3)"), 1, 1, "")
    assert campaign.execute_in(tmp_path, {"PATH": ""})(quick, 30.0) == 3


def _kernels_json(tmp_path: Path) -> Path:
    """kernels.json with bloom-560m's attention at micro-batch 2 on an H200, two tile configurations timed."""
    shapes = {"micro_batch_size": 2, "seq_len": 2048, "hidden": 1024, "heads": 16, "head_dim": 64, "ffn": 4096,
              "vocab": 250880, "dtype": "bfloat16", "documents": False}  # fmt: skip
    where = {"device": "NVIDIA H200", "capability": "9.0", "torch": "2.11.0", "triton": "3.6.0", "project": "0.1.0"}
    tiles = {"chosen": {}, "times_ms": {"fwd 128x64 ...": 0.5, "fwd 128x128 ...": 0.25}, "rejected": {}}
    cache = SelectionCache()
    cache.put(entry_key(where, "flash_alibi_attention", shapes),
              {"choice": "triton", "times_ms": {"triton": 0.25}, "rejected": {}, "flash_tiles": tiles})  # fmt: skip
    cache.put(entry_key(where, "layer_norm", shapes),
              {"choice": "reference", "times_ms": {}, "rejected": {}, "flash_tiles": None})  # fmt: skip
    path = tmp_path / "kernels.json"
    cache.save(path)
    return path


def test_attention_tflops_per_tile_configuration(tmp_path: Path) -> None:
    rows = campaign.attention_tflops(json.loads(_kernels_json(tmp_path).read_text()))
    assert [r["tiles"] for r in rows] == ["fwd 128x128 ...", "fwd 128x64 ..."]  # fastest first
    flops = 7 * 2 * 16 * 2048**2 * 64  # forward 2 products of 2 b h s^2 d, halved (causal); backward 2.5 x that
    assert rows[0]["tflops"] == pytest.approx(flops / 0.25e-3 / 1e12) == pytest.approx(240.5, abs=0.1)
    assert rows[0]["device"] == "NVIDIA H200" and rows[0]["head_dim"] == 64


def test_summary_and_seeding(tmp_path: Path) -> None:
    source = _kernels_json(tmp_path)
    out = tmp_path / "out"
    out.mkdir()
    summary = campaign.summarise(out, [{"name": "a", "status": "ok"}], 480.0, source)
    assert summary["runs"] == [{"name": "a", "status": "ok"}] and summary["deadline_s"] == 480.0
    assert json.loads((out / "campaign.json").read_text()) == summary
    assert (out / "kernels.json").read_text() == source.read_text()
    assert len(json.loads((out / "attention.json").read_text())) == 2
    # Seeding adds the earlier campaign's entries beside those the benches' file holds, replacing none.
    target = tmp_path / "runs" / "kernels.json"
    kept = SelectionCache()
    (key, record), _ = SelectionCache.load(source).items()
    kept.put(key, record | {"choice": "sdpa"})
    target.parent.mkdir()
    kept.save(target)
    campaign.seed_kernels(source, target)
    merged = dict(SelectionCache.load(target).items())
    assert len(merged) == 2 and merged[key]["choice"] == "sdpa"
