"""`bench --profile` and the kernel table's timer, on CPU: the profile of real steps (operators, host syncs, the
trace file), the summary of a CUDA trace written out by hand (kernels, idle share, launches, syncs), and the
timer's back-to-back CUDA timing with stand-in events."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest
import torch

from appliance.benchmark import ceilings, profile
from appliance.benchmark.ceilings import Timer
from appliance.benchmark.profile import profile_steps, summarize_trace, trace_path


def _step(batch: torch.Tensor) -> None:
    """Two host syncs on a GPU (.item() and a nonzero's size) besides a matmul and its backward."""
    weight = torch.ones(8, 8, requires_grad=True)
    loss = (batch @ weight).square().mean()
    loss.backward()
    float(loss.detach())
    torch.nonzero(batch > 0)


def test_profile_of_cpu_steps_counts_operators_and_syncs(tmp_path: Path) -> None:
    path = trace_path(tmp_path / "bench.json", "trainer")
    assert path.name == "bench-trainer.trace.json"
    summary = profile_steps(_step, [torch.randn(4, 8) for _ in range(3)], torch.device("cpu"), path)

    assert summary["trace"] == str(path)
    assert json.loads(path.read_text())["traceEvents"]  # a Chrome trace that loads
    assert summary["steps"] == 3 and summary["wall_ms"] > 0
    assert summary["gpu_idle_share"] is None and summary["device_busy_ms"] is None
    assert summary["top_kernels"] == [] and summary["kernels_per_step"] == 0 and summary["launches_per_step"] == 0
    assert summary["host_syncs_per_step"] == 2  # _local_scalar_dense (from float) and nonzero, once a step each
    assert summary["sync_events_per_step"] == {"aten::_local_scalar_dense": 1, "aten::nonzero": 1, "aten::item": 1}
    ops = {row["name"]: row for row in summary["top_ops"]}
    assert ops["aten::mm"]["calls"] >= 3 and ops["aten::mm"]["self_ms"] > 0  # forward and backward matmuls
    assert sum(row["share"] for row in summary["top_ops"]) <= 1 + 1e-9


def test_a_large_trace_is_gzipped(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(profile, "GZIP_ABOVE_BYTES", 0)
    path = tmp_path / "bench-hf-eager.trace.json"
    summary = profile_steps(_step, [torch.randn(4, 8)], torch.device("cpu"), path)
    assert summary["trace"] == f"{path}.gz" and not path.exists()
    with gzip.open(f"{path}.gz", "rt") as f:
        assert json.load(f)["traceEvents"]


def _event(cat: str, name: str, ts: float, dur: float, tid: int = 1) -> dict:
    return {"ph": "X", "cat": cat, "name": name, "pid": 1, "tid": tid, "ts": ts, "dur": dur}


def test_summary_of_a_cuda_trace() -> None:
    """Two steps of 100 us each, ending at 200 us. Device work: gemm 10-40 and 110-140 (a second stream's copy
    overlaps it at 30-50), softmax 60-70, 160-170 and 180-200: busy 40 + 10 + 30 + 10 + 20 = 110 of 200 us."""
    events = [
        _event("user_annotation", "bench step 0", 0, 100),
        _event("user_annotation", "bench step 1", 100, 100),
        _event("kernel", "gemm", 10, 30),
        _event("gpu_memcpy", "Memcpy DtoH (Device -> Pageable)", 30, 20),
        _event("kernel", "softmax", 60, 10),
        _event("kernel", "gemm", 110, 30),
        _event("kernel", "softmax", 160, 10),
        _event("kernel", "softmax", 180, 20),
        *(_event("cuda_runtime", "cudaLaunchKernel", t, 1) for t in (5, 55, 105)),
        _event("cuda_runtime", "cudaLaunchKernel_v7000", 155, 1),  # a versioned entry point's name
        _event("cuda_driver", "cuLaunchKernelEx", 175, 1),  # a Triton kernel
        _event("cuda_runtime", "cudaMemcpyAsync", 29, 1),
        _event("cuda_runtime", "cudaStreamSynchronize", 31, 20),
        _event("cuda_runtime", "cudaStreamSynchronize", 150, 5),
        _event("cpu_op", "aten::_local_scalar_dense", 28, 25),
        _event("cuda_runtime", "cudaDeviceSynchronize", 201, 3),  # after the steps: not theirs
    ]
    summary = summarize_trace({"traceEvents": events}, steps=2, cuda=True)
    assert summary["wall_ms"] == pytest.approx(0.2)
    assert summary["device_busy_ms"] == pytest.approx(0.11)
    assert summary["gpu_idle_share"] == pytest.approx(0.45)
    assert summary["kernels_per_step"] == 2.5 and summary["launches_per_step"] == 2.5
    assert summary["host_syncs_per_step"] == 1  # the two stream syncs; the op waits through one of them
    assert summary["sync_events_per_step"] == {
        "cudaStreamSynchronize": 1,
        "aten::_local_scalar_dense": 0.5,
        "Memcpy DtoH": 0.5,
    }
    assert summary["top_kernels"] == [
        {"name": "gemm", "calls": 2, "ms": pytest.approx(0.06), "share": pytest.approx(0.6)},
        {"name": "softmax", "calls": 3, "ms": pytest.approx(0.04), "share": pytest.approx(0.4)},
    ]


class _Event:
    """torch.cuda.Event with the host clock: elapsed_time is what the timed loop took on the host, in ms."""

    made = 0

    def __init__(self, enable_timing: bool = False) -> None:
        _Event.made += 1
        self.at = 0.0

    def record(self) -> None:
        import time

        self.at = time.perf_counter()

    def elapsed_time(self, end: _Event) -> float:
        return (end.at - self.at) * 1e3


def test_gpu_timer_brackets_back_to_back_calls_with_one_pair_of_events(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ceilings.torch.cuda, "Event", _Event)
    monkeypatch.setattr(ceilings.torch.cuda, "synchronize", lambda: None)
    calls = []
    timing = Timer(cuda=True, warmup=2, iters=20).measure(lambda: calls.append(1))
    assert len(calls) == 2 + Timer.GPU_GROUPS * 20
    assert _Event.made == 2 * Timer.GPU_GROUPS  # one start and one end event per group of 20 calls, not per call
    assert 0 < timing.ms < 1 and 0 < timing.cpu_us < 1e3  # per call: the loop's time divided by 20
