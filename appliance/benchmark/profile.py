"""`bench --profile`: a torch.profiler trace of PROFILE_STEPS steps of each contender, after its timed steps (so after
warm-up, and not timed), written as a Chrome trace beside the JSON (chrome://tracing or ui.perfetto.dev open it),
and a summary of it in the JSON and the printed table.

The summary is read from the trace file's events, so the file and the figures agree:
- top_kernels: CUDA kernels (category "kernel") by total time: name, calls, ms, share of all kernel time;
- top_ops: CPU operators (category "cpu_op") by self time (time not spent in an operator nested inside), the same
  columns; on CPU the operators are the work, on a GPU the host side of it;
- gpu_idle_share: the share of the profiled wall time (the first step's start to the later of the last step's end
  and the last device event's end) in which no kernel, copy or memset ran; None without a GPU;
- kernels_per_step (kernels run) and launches_per_step (launch calls: cudaLaunchKernel and its driver and Ex
  forms; a cudaGraphLaunch counts one, however many kernels its graph holds);
- host_syncs_per_step: the times the host waited for the device. On a GPU: cudaStreamSynchronize,
  cudaDeviceSynchronize and cudaEventSynchronize calls and blocking copies (cudaMemcpy); a .item() or a nonzero()
  waits through one of those. On CPU nothing waits, so it counts the operators that would wait on a GPU:
  aten::_local_scalar_dense (what .item(), float() and bool() of a tensor call) and aten::nonzero. sync_events_per_step
  gives every one of these names' counts, device-to-host copies ("Memcpy DtoH") and aten::item too, on any device.
"""

from __future__ import annotations

import gzip
import json
import re
import shutil
from collections import defaultdict
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import torch

PROFILE_STEPS = 3
TOP = 15  # rows of each top table
GZIP_ABOVE_BYTES = 4 << 20  # a bloom-560m step is ~10k kernel events; gzip shrinks a trace about tenfold
STEP_ANNOTATION = "bench step"
DEVICE_WORK = ("kernel", "gpu_memcpy", "gpu_memset")
LAUNCHES = ("cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx", "cudaGraphLaunch")
API_VERSION = re.compile(r"_v\d+$")  # CUPTI may name a call by its versioned entry point (cudaLaunchKernel_v7000)
GPU_WAITS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy")
CPU_WAITS = ("aten::_local_scalar_dense", "aten::nonzero")  # each one host sync on a GPU
ALSO_COUNTED = ("aten::item", "Memcpy DtoH")  # in sync_events_per_step only (item calls _local_scalar_dense)


def trace_path(out: Path, contender_key: str) -> Path:
    """`<out stem>-<contender>.trace.json` beside the JSON result."""
    return out.with_name(f"{out.stem}-{contender_key}.trace.json")


def profile_steps(step: Callable[[Any], Any], batches: Sequence[Any], device: torch.device, path: Path) -> dict:
    """Runs step(batch) for each of `batches` under torch.profiler, writes the Chrome trace to `path` (gzipped to
    path + ".gz" when large) and returns summarize_trace's summary with "trace": the file written."""
    from torch.profiler import ProfilerActivity, profile, record_function

    cuda = device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    if cuda:
        torch.cuda.synchronize(device)  # earlier work stays out of the trace (a sync inside would be counted)
    with profile(activities=activities) as prof:
        for i, batch in enumerate(batches):
            with record_function(f"{STEP_ANNOTATION} {i}"):
                step(batch)
        if cuda:  # outside the steps' ranges, so not counted: the last step's device work ends inside the trace
            torch.cuda.synchronize(device)
    path.parent.mkdir(parents=True, exist_ok=True)
    prof.export_chrome_trace(str(path))
    trace = json.loads(path.read_text())
    if path.stat().st_size > GZIP_ABOVE_BYTES:
        with path.open("rb") as plain, gzip.open(f"{path}.gz", "wb") as packed:
            shutil.copyfileobj(plain, packed)
        path.unlink()
        path = Path(f"{path}.gz")
    return summarize_trace(trace, steps=len(batches), cuda=cuda) | {"trace": str(path)}


def summarize_trace(trace: dict[str, Any], *, steps: int, cuda: bool) -> dict[str, Any]:
    """The summary (module docstring) of a Chrome trace of `steps` steps, each inside a STEP_ANNOTATION range."""
    events = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X" and "dur" in e]
    spans = [e for e in events if e.get("cat") == "user_annotation" and e["name"].startswith(STEP_ANNOTATION)]
    device = [e for e in events if e.get("cat") in DEVICE_WORK]
    start = min((e["ts"] for e in spans), default=min((e["ts"] for e in events), default=0.0))
    end = max((e["ts"] + e["dur"] for e in [*spans, *device]), default=start)
    wall_us = max(end - start, 1e-9)
    kernels = [e for e in device if e["cat"] == "kernel"]
    busy_us = _union_length(((e["ts"], e["ts"] + e["dur"]) for e in device), start, end)
    names: dict[str, int] = defaultdict(int)  # host-side events inside a step's range, by name
    for e in events:
        if e.get("cat") not in DEVICE_WORK and any(s["ts"] <= e["ts"] <= s["ts"] + s["dur"] for s in spans):
            names[API_VERSION.sub("", e["name"])] += 1
    memcpy_dtoh = sum(1 for e in device if e["cat"] == "gpu_memcpy" and "DtoH" in e["name"])
    waits = GPU_WAITS if cuda else CPU_WAITS
    counted = {name: names[name] for name in (*GPU_WAITS, *CPU_WAITS, "aten::item") if names[name]}
    if memcpy_dtoh:
        counted["Memcpy DtoH"] = memcpy_dtoh
    return {
        "steps": steps,
        "wall_ms": wall_us / 1e3,
        "device_busy_ms": busy_us / 1e3 if cuda else None,
        "gpu_idle_share": 1 - busy_us / wall_us if cuda else None,
        "kernels_per_step": len(kernels) / steps,
        "launches_per_step": sum(names[name] for name in LAUNCHES) / steps,
        "host_syncs_per_step": sum(names[name] for name in waits) / steps,
        "sync_events_per_step": {name: count / steps for name, count in counted.items()},
        "top_kernels": _top(((e["name"], e["dur"]) for e in kernels), "ms"),
        "top_ops": _top(_self_times([e for e in events if e.get("cat") == "cpu_op"]), "self_ms"),
    }


def _top(timed: Iterable[tuple[str, float]], column: str) -> list[dict[str, Any]]:
    """[{name, calls, <column>, share}] of the TOP names by summed microseconds; share: of all names' sum."""
    calls: dict[str, int] = defaultdict(int)
    total_us: dict[str, float] = defaultdict(float)
    for name, us in timed:
        calls[name] += 1
        total_us[name] += us
    whole = sum(total_us.values()) or 1.0
    ranked = sorted(total_us, key=lambda name: -total_us[name])[:TOP]
    return [{"name": n, "calls": calls[n], column: total_us[n] / 1e3, "share": total_us[n] / whole} for n in ranked]


def _self_times(ops: list[dict[str, Any]]) -> list[tuple[str, float]]:
    """(name, self microseconds) of each operator: its duration less its direct children's, per thread (an
    operator's children lie inside it on its own thread; autograd's backward runs on another)."""
    by_thread: dict[tuple[Any, Any], list[dict[str, Any]]] = defaultdict(list)
    for e in ops:
        by_thread[(e.get("pid"), e.get("tid"))].append(e)
    result = []
    for thread in by_thread.values():
        thread.sort(key=lambda e: (e["ts"], -e["dur"]))  # a parent before the children that start with it
        stack: list[list[Any]] = []  # [event end, name, self time so far]
        for e in thread:
            while stack and e["ts"] >= stack[-1][0]:
                _, name, own = stack.pop()
                result.append((name, own))
            if stack:
                stack[-1][2] -= e["dur"]
            stack.append([e["ts"] + e["dur"], e["name"], e["dur"]])
        result += [(name, own) for _, name, own in stack]
    return result


def _union_length(intervals: Iterable[tuple[float, float]], lo: float, hi: float) -> float:
    """Length of the union of [a, b) intervals, clipped to [lo, hi] (kernels of several streams overlap)."""
    covered, reach = 0.0, lo
    for a, b in sorted((max(a, lo), min(b, hi)) for a, b in intervals):
        if b <= reach:
            continue
        covered += b - max(a, reach)
        reach = b
    return covered
