"""`./bloom_appliance.py bench`: the contenders, the kernel table and the ceilings, measured in one run.

Order: the machine's ceilings; the contenders, built in this order: the trainer (its first weights seed the peers),
transformers eager, transformers compiled (taking turns step by step on CPU, one after the other on a GPU;
contenders.py); the kernel table at the trained model's rank shapes. Everything runs in this process, on the device
the plan targets (workload.py says what every contender shares and how the flags size it, hf_peers.py what is
equal). --profile adds a trace of each contender (profile.py).
MFU = model FLOPs per token (report.FLOP_CONVENTION) x tokens/s / the plan's peak per device.
"""

from __future__ import annotations

import datetime
import os
import platform
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import torch

from appliance.benchmark.ceilings import Timer, machine_ceilings
from appliance.benchmark.contenders import Contender, Outcome, Running, run_contenders
from appliance.benchmark.hf_peers import PeerContender, compile_backend
from appliance.benchmark.kernel_table import HEAD_DIMS, KernelCases, RankShapes, kernel_records
from appliance.benchmark.report import FLOP_CONVENTION, format_table, is_result, write_json
from appliance.benchmark.trainer_speed import TrainerContender, one_rank_group
from appliance.benchmark.workload import BenchSize, Progress, Workload, plan_workload
from appliance.output_dirs import claim_file

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


CONTENDER_KEYS = ("trainer", "hf-eager", "hf-compile")


def _claim_out(path: Path) -> None:
    """--out: a new file or an earlier bench result; anything else is not the bench's to replace."""
    claim_file(path, flag="--out", what="an earlier bench result", ours=is_result)


def run_bench(model: str | None, out: Path | None, *, quick: bool = False, size: BenchSize | None = None,
              profile: bool = False, contenders: tuple[str, ...] = CONTENDER_KEYS, kernel_table: bool = True,
              progress: Progress = _progress) -> dict:  # fmt: skip
    """`contenders`: the keys of those to run (the others are recorded as skipped); `kernel_table`: time each op."""
    load_before = os.getloadavg()  # the machine may be shared: the JSON says how busy it was
    work = plan_workload(model, quick=quick, size=size or BenchSize())
    spec, train = work.spec, work.spec.train
    cuda = work.device.type == "cuda"
    device_name = (
        torch.cuda.get_device_name(work.device) if cuda else f"{platform.machine()} CPU ({work.threads} threads)"
    )
    path = out or default_out(device_name)
    _claim_out(path)  # before the minutes of measuring
    if not cuda:
        from appliance.train.cpu_memory import keep_freed_memory

        keep_freed_memory()  # as every CPU rank of `train` does; the peers in this process get it too
    previous_threads = torch.get_num_threads()
    torch.set_num_threads(work.threads)
    try:
        progress(f"bench: {spec.model.name}, {work.tokens_per_step} tokens per step ({work.micro_batches} x"
                 f" micro-batch {train.micro_batch_size} x {train.seq_len}), {train.dtype}, on {device_name}; per"
                 f" contender {work.warmup_steps} warm-up steps (not timed: torch.compile and Triton autotuning"
                 f" happen there) and {work.steps} timed")  # fmt: skip
        dtype = DTYPES[train.dtype]
        # GPU: 20 calls back to back per timed loop, --quick too: fewer would leave the first launch's gap unamortized
        timer = Timer(cuda, warmup=1 if quick else 3, iters=20 if cuda else (2 if quick else 5))
        # Full size on a GPU (tiny buffers would measure its L2 cache): a 1 GiB copy moves 2 GiB, ~0.6 ms at H100
        # rates, and an 8192^3 bf16 matmul is ~1.4 ms, so 63 calls of each take well under a second.
        ceiling = machine_ceilings(timer, work.device, dtype, small=quick and not cuda)
        progress(f"  ceilings: copy {ceiling['copy_gbps']:.1f} GB/s, matmul {ceiling['matmul_tflops']:.3f} TFLOP/s")
        built: dict[str, Any] = {}
        with one_rank_group("nccl" if cuda else "gloo"):
            every = bench_contenders(work, built)
            ran = run_contenders([c for c in every if c.key in contenders], work, work.batches(), progress,
                                 profile_out=path if profile else None)  # fmt: skip
            outcomes = {c.name: ran.get(c.name, Outcome(skipped=True)) for c in every}
        ours: TrainerContender | None = built.get("trainer")
        calls = ours.calls_per_step if ours is not None else Counter[str]()
        shapes = RankShapes(batch=train.micro_batch_size, seq=train.seq_len, hidden=spec.model.hidden,
                            heads=spec.model.heads, ffn=spec.model.ffn_hidden, vocab=spec.model.padded_vocab(),
                            dtype=dtype)  # fmt: skip
        # A quick GPU run times attention at the model's own head dim: each head dim compiles its peers anew.
        head_dims = (spec.model.hidden // spec.model.heads,) if quick and cuda else HEAD_DIMS
        kernels: list[dict[str, Any]] = []
        if kernel_table:
            progress("  kernels (ours = what kernels.registry runs on this device):")
            kernels = kernel_records(KernelCases(work.device, shapes, head_dims), timer, ceiling, calls=calls,
                                     progress=lambda line: progress("    " + line))  # fmt: skip
    finally:
        torch.set_num_threads(previous_threads)
    result = bench_result(work, device_name, ceiling, outcomes, kernels)
    result["workload"]["hf_attention"] = built.get("hf_attention")
    result["workload"]["hf_weights"] = (
        "the trainer's first weights" if ours is not None else "transformers' own (the trainer never built)"
    )
    result["first_loss"] = ours.first_loss if ours is not None else None
    result["calls_per_step"] = dict(calls)
    result["workload"]["kernels"] = ours.kernels if ours is not None else None  # what the trainer ran, and why
    result["load_average_1min"] = {"start": load_before[0], "end": os.getloadavg()[0]}
    print(format_table(result))
    _claim_out(path)  # again: the file may have appeared meanwhile
    write_json(result, path)
    print(f"wrote {path}")
    return result


def bench_contenders(work: Workload, built: dict[str, Any]) -> list[Contender]:
    """The three contenders, in build order; `built` receives the trainer ("trainer") and the attention
    implementation transformers chose ("hf_attention")."""

    def trainer() -> Running:
        built["trainer"] = TrainerContender(work)
        return built["trainer"]

    def peer(compiled: bool) -> Running:
        ours = built.get("trainer")  # absent when the trainer ran out of memory while building
        made = PeerContender(work, ours.weights if ours is not None else None, compiled=compiled)
        built["hf_attention"] = made.attention
        return made

    names = contender_names(work)
    return [
        Contender("trainer", names[0], trainer),
        Contender("hf-eager", names[1], lambda: peer(False)),
        Contender("hf-compile", names[2], lambda: peer(True)),
    ]


def contender_names(work: Workload) -> tuple[str, str, str]:
    return (
        "trainer (the run's engine)",
        "transformers eager",
        f"transformers torch.compile ({compile_backend(work)})",
    )


def _ratio(ours: Outcome, peer: Outcome) -> float | None:
    """ours / it in tokens/s, only where both ran."""
    if ours.times is None or peer.times is None:
        return None
    return ours.times.tokens_per_s / peer.times.tokens_per_s


def bench_result(work: Workload, device_name: str, ceiling: dict[str, Any], outcomes: dict[str, Outcome],
            kernels: list[dict[str, Any]]) -> dict[str, Any]:  # fmt: skip
    spec, train = work.spec, work.spec.train
    ours, eager, compiled = (outcomes[name] for name in contender_names(work))
    flops_per_token = spec.model.flops_per_token(train.seq_len)
    peak = spec.device.peak_tflops  # the plan's per-rank peak: dense bf16 on GPUs, fp32 FMA of the cores on CPU
    tokens_per_s = ours.times.tokens_per_s if ours.times is not None else None
    tflops = tokens_per_s * flops_per_token / 1e12 if tokens_per_s is not None else None
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
        "tokens_per_s": tokens_per_s,
        "tokens_per_s_hf_eager": eager.times.tokens_per_s if eager.times is not None else None,
        "tokens_per_s_hf_compile": compiled.times.tokens_per_s if compiled.times is not None else None,
        "ratio_vs_hf_eager": _ratio(ours, eager),
        "ratio_vs_hf_compile": _ratio(ours, compiled),
        "tflops_per_device": tflops,
        "mfu": tflops / peak if peak and tflops is not None else None,
        "contenders": {name: outcome.to_json(work) for name, outcome in outcomes.items()},
        "ceilings": ceiling,
        "kernels": kernels,
    }
