"""`./bloom_appliance.py bench`: the contenders, the kernel table and the ceilings, measured in one run.

Order: the machine's ceilings; the contenders, built in this order: the trainer (its first weights seed the peers),
transformers eager, transformers compiled (taking turns step by step on CPU, one after the other on a GPU); the
kernel table at the trained model's rank shapes. Everything runs in this process, on the device the plan targets
(workload.py says what every contender shares, hf_peers.py what is equal).
MFU = model FLOPs per token (report.FLOP_CONVENTION) x tokens/s / the plan's peak per device.
"""

from __future__ import annotations

import datetime
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any

import torch

from appliance.benchmark.ceilings import Timer, machine_ceilings
from appliance.benchmark.hf_peers import compile_backend, hf_contender
from appliance.benchmark.kernel_table import KernelCases, RankShapes, kernel_records
from appliance.benchmark.report import FLOP_CONVENTION, format_table, write_json
from appliance.benchmark.trainer_speed import TrainerContender, one_rank_group
from appliance.benchmark.workload import (
    Batch,
    Progress,
    StepFn,
    StepTimes,
    Workload,
    plan_workload,
    time_contenders,
)

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def default_out(device_name: str) -> Path:
    slug = "".join(c if c.isalnum() else "-" for c in device_name.lower()).strip("-")
    return Path("runs") / "bench" / f"{datetime.date.today().isoformat()}-{slug}.json"


_STARTED = time.monotonic()


def _progress(line: str) -> None:
    print(f"[{time.monotonic() - _STARTED:6.1f} s] {line}", file=sys.stderr, flush=True)


def _versions() -> dict[str, str]:
    from importlib.metadata import version

    from appliance import __version__

    found = {"bloom-appliance": __version__, "python": platform.python_version()}
    for dist in ("torch", "deepspeed", "transformers", "triton"):
        try:
            found[dist] = version(dist)
        except Exception:  # not installed: say so rather than fail the bench
            found[dist] = "not installed"
    return found


def run_bench(model: str | None, out: Path | None, *, quick: bool = False, progress: Progress = _progress) -> dict:
    load_before = os.getloadavg()  # the machine may be shared: the JSON says how busy it was
    work = plan_workload(model, quick=quick)
    spec, train = work.spec, work.spec.train
    cuda = work.device.type == "cuda"
    device_name = (
        torch.cuda.get_device_name(work.device) if cuda else f"{platform.machine()} CPU ({work.threads} threads)"
    )
    if not cuda:
        from appliance.train.cpu_memory import keep_freed_memory

        keep_freed_memory()  # as every CPU rank of `train` does; the peers in this process get it too
    previous_threads = torch.get_num_threads()
    torch.set_num_threads(work.threads)
    try:
        progress(f"bench: {spec.model.name}, {work.tokens_per_step} tokens per step, {train.dtype}, on {device_name}")
        dtype = DTYPES[train.dtype]
        timer = Timer(cuda, warmup=1 if quick else 3, iters=2 if quick else (20 if cuda else 5))
        ceiling = machine_ceilings(timer, work.device, dtype, small=quick)
        progress(f"  ceilings: copy {ceiling['copy_gbps']:.1f} GB/s, matmul {ceiling['matmul_tflops']:.3f} TFLOP/s")
        batches = work.batches()
        times, ours, hf_attention = _run_contenders(work, batches, progress)
        shapes = RankShapes(batch=train.micro_batch_size, seq=train.seq_len, hidden=spec.model.hidden,
                            heads=spec.model.heads, ffn=spec.model.ffn_hidden, vocab=spec.model.padded_vocab(),
                            dtype=dtype)  # fmt: skip
        progress("  kernels (ours = what kernels.registry runs on this device):")
        kernels = kernel_records(KernelCases(work.device, shapes), timer, ceiling, calls=ours.calls_per_step,
                                 progress=lambda line: progress("    " + line))  # fmt: skip
    finally:
        torch.set_num_threads(previous_threads)
    result = _result(work, device_name, ceiling, {name: t.to_json() for name, t in times.items()}, kernels)
    result["workload"]["hf_attention"] = hf_attention
    result["first_loss"] = ours.first_loss
    result["calls_per_step"] = dict(ours.calls_per_step)
    result["load_average_1min"] = {"start": load_before[0], "end": os.getloadavg()[0]}
    print(format_table(result))
    path = out or default_out(device_name)
    write_json(result, path)
    print(f"wrote {path}")
    return result


def _run_contenders(
    work: Workload, batches: list[list[Batch]], progress: Progress
) -> tuple[dict[str, StepTimes], TrainerContender, str]:
    """(each contender's step times, the trainer contender, the attention implementation transformers chose)."""
    built: dict[str, Any] = {}

    def trainer() -> StepFn:
        built["trainer"] = TrainerContender(work)
        return built["trainer"]

    def peer(compiled: bool) -> StepFn:
        ours = built["trainer"]
        if not work.interleaved:
            ours.release()  # its steps are done; its weights stay
        step, built["hf_attention"] = hf_contender(work, ours.weights, compiled=compiled)
        return step

    names = contender_names(work)
    makers = {names[0]: trainer, names[1]: lambda: peer(False), names[2]: lambda: peer(True)}
    with one_rank_group("nccl" if work.device.type == "cuda" else "gloo"):
        times = time_contenders(makers, work, batches, progress)
    return times, built["trainer"], built["hf_attention"]


def contender_names(work: Workload) -> tuple[str, str, str]:
    return (
        "trainer (DeepSpeed engine)",
        "transformers eager",
        f"transformers torch.compile ({compile_backend(work)})",
    )


def _result(work: Workload, device_name: str, ceiling: dict[str, Any], contenders: dict[str, dict[str, Any]],
            kernels: list[dict[str, Any]]) -> dict[str, Any]:  # fmt: skip
    spec, train = work.spec, work.spec.train
    ours, eager, compiled = (contenders[name] for name in contender_names(work))
    flops_per_token = spec.model.flops_per_token(train.seq_len)
    peak = spec.device.peak_tflops  # the plan's per-rank peak: dense bf16 on GPUs, fp32 FMA of the cores on CPU
    tflops = ours["tokens_per_s"] * flops_per_token / 1e12
    return {
        "device": device_name,
        "date": datetime.date.today().isoformat(),
        "versions": _versions(),
        "model": spec.model.name,
        "workload": {
            "tokens_per_step": work.tokens_per_step,
            "micro_batches": work.micro_batches,
            "micro_batch_size": train.micro_batch_size,
            "seq_len": train.seq_len,
            "dtype": train.dtype,
            "recompute": spec.layout.recompute,
            "zero_stage": spec.layout.zero_stage,
            "threads": work.threads,
            "warmup_steps": work.warmup_steps,
            "steps": work.steps,
            "planned_layout": work.planned,
            "quick": work.quick,
            "interleaved": work.interleaved,
            "hf_compile_backend": compile_backend(work),
        },
        "flop_convention": FLOP_CONVENTION,
        "model_flops_per_token": flops_per_token,
        "peak_tflops_per_device": peak,
        "tokens_per_s": ours["tokens_per_s"],
        "tokens_per_s_hf_eager": eager["tokens_per_s"],
        "tokens_per_s_hf_compile": compiled["tokens_per_s"],
        "ratio_vs_hf_eager": ours["tokens_per_s"] / eager["tokens_per_s"],
        "ratio_vs_hf_compile": ours["tokens_per_s"] / compiled["tokens_per_s"],
        "tflops_per_device": tflops,
        "mfu": tflops / peak if peak else None,
        "contenders": contenders,
        "ceilings": ceiling,
        "kernels": kernels,
    }
