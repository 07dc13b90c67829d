"""Long sequences through the real engine: peak activation memory per rank and step time at cp=1, and at cp=4 with
Ulysses and with ring attention.

    .venv/bin/python -m bench.long_context                              # seq 16384, 3 measured steps per mode
    .venv/bin/python -m bench.long_context --seq-len 4096 --steps 2 --out long_context.json

A tiny BLOOM (``CONFIG``: 2 layers, hidden 64, 4 heads of 16, vocab 256) trains on one micro-batch of one sequence
of random tokens per step, fp32, ZeRO 0, through ``build_engine`` on gloo ranks (appliance.parallel.testing): one
rank at cp=1, then four ranks holding a cp=4 Ulysses engine and a cp=4 ring engine side by side, whose steps
alternate (ulysses, ring, ulysses, ...) so both see the same load on the machine; each mode's step time is the
median of its steps (the slowest rank's, as the step ends with collectives every rank waits for).

Why 4 heads: Ulysses at cp=4 needs heads divisible by cp (tp=1), and each head costs memory on CPU, where there is no
flash kernel: whole [S, S] fp32 scores would take 16384^2 x 4 bytes = 1 GiB per head and tensor, about five of them
at once. Past 2^23 scores per head the attention runs in blocks of query rows instead (ops.blocked_attention: 512
rows at S = 16384, 32 MiB per head and tensor). Ulysses gives each of the 4 ranks one whole head, blocked the same
way; ring gives each rank 2 of 8 zigzag pieces, so its largest tensors are [H, S/8, S/8] per pair of pieces.

How peak memory is measured, and what it includes: torch keeps no allocator statistics on the CPU, so each rank reads
the kernel's high-water mark of its resident set. Before a measured step the rank returns the heap's free pages to
the kernel (glibc malloc_trim; otherwise memory freed by the previous step would stay resident, be reused, and hide
part of the rise), reads VmRSS, and resets VmHWM to it (writing 5 to /proc/self/clear_refs); after the step the
rise is VmHWM - VmRSS before. The ranks start with glibc's mmap threshold fixed at 1 MiB
(MALLOC_MMAP_THRESHOLD_): by default glibc raises it after each large free, up to 32 MiB, so the many attention
temporaries of 8-32 MiB come from the heap, whose fragments stay resident; measured at seq 8192, one head's blocked
attention then rose 700-890 MiB instead of the 178 MiB it holds with the threshold fixed (and Ulysses at seq
16384 rose above cp=1). With it fixed, every tensor of 1 MiB or more is its own mapping, returned when freed.
The rise counts everything the step held at its peak beyond what was resident before:
activations kept for backward, the transient attention tensors, gradients' temporaries, communication buffers
(all-to-all outputs, ring receive buffers), the loss's logits chunks. The weights, the optimizer state and the
gradient buffers exist before the step (a warm-up step on a short sequence allocates them), so they are not
counted; for this model they are a few hundred KiB anyway. Page granularity and allocator slack add a few MiB.
"""

from __future__ import annotations

import os

# The ranks are gloo processes on this CPU whatever the machine has.
os.environ.setdefault("DS_ACCELERATOR", "cpu")

import argparse
import contextlib
import ctypes
import datetime
import gc
import io
import json
import platform
import re
import statistics
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from appliance.model.config import BloomConfig
from appliance.parallel.testing import build_test_engine, run_distributed
from appliance.parallel.topology import ParallelTopology

# 2 layers x (12 x 64^2 + 13 x 64) + 256 x 64 + 4 x 64 = 116.5 K parameters: the [S, S] attention tensors are all
# that is large. Heads 4 = the smallest count Ulysses can split over cp=4.
CONFIG = BloomConfig(vocab_size=256, hidden_size=64, n_layer=2, n_head=4)
CP = 4
MODES = ("ulysses", "ring")
SEED = 1234
WARMUP_SEQ = 256  # the warm-up step's length: allocates gradients and optimizer state, divisible by 2 x cp
MiB = 2**20
MMAP_THRESHOLD = MiB  # glibc: allocations from this size on are mappings of their own (module docstring)


@dataclass(frozen=True)
class StepMeasure:
    """One training step on one rank."""

    rise_mib: float  # peak resident set during the step above the resident set before it
    wall_s: float
    loss: float


def _kib(field: str) -> int:
    match = re.search(rf"^{field}:\s+(\d+) kB", Path("/proc/self/status").read_text(), re.MULTILINE)
    if match is None:
        raise RuntimeError(f"/proc/self/status has no {field}")
    return int(match[1])


def _release_free_heap() -> None:
    """Hand the heap's free pages back to the kernel, so that the next step's rise counts what it allocates."""
    gc.collect()
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def batch(seq_len: int, seed: int = SEED) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """One micro-batch of one sequence of random tokens, labels shifted by one (the last one ignored)."""
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, CONFIG.vocab_size, (1, seq_len + 1), generator=generator)
    return [(tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous())]


def build(cp: int, mode: str, recompute: str) -> Any:
    """This rank's engine for the tiny model at cp (every rank of the world in the cp group)."""
    topology = ParallelTopology(tp=1, pp=1, dp=1, cp=cp, world_size=dist.get_world_size())
    topology.init_process_groups()
    with contextlib.redirect_stdout(io.StringIO()):  # DeepSpeed's start-up prints
        return build_test_engine(
            CONFIG, topology, micro_batch_size=1, global_batch_size=1, recompute=recompute, seed=SEED, cp_mode=mode
        )


def measured_step(engine: Any, micro_batches: list[tuple[torch.Tensor, torch.Tensor]]) -> StepMeasure:
    """Train one step and measure this rank's peak resident-set rise (see the module docstring) and wall time."""
    _release_free_heap()
    dist.barrier()
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
    before = _kib("VmRSS")
    start = time.perf_counter()
    result = engine.train_batch(micro_batches)
    wall = time.perf_counter() - start
    return StepMeasure(rise_mib=(_kib("VmHWM") - before) / 1024, wall_s=wall, loss=result.loss)


def train_modes(_: ParallelTopology, seq_len: int, cp: int, modes: tuple[str, ...], steps: int, recompute: str) -> Any:
    """On each rank: one engine per mode at cp, a short warm-up step each, then ``steps`` measured steps per mode,
    alternating between the modes. Returns {mode: [StepMeasure, ...]}."""
    os.environ.setdefault("LOCAL_RANK", "0")  # read by DeepSpeed (one process per rank, all on this CPU)
    engines = {mode: build(cp, mode, recompute) for mode in modes}
    for engine in engines.values():
        engine.train_batch(batch(WARMUP_SEQ))
    micro_batches = batch(seq_len)
    out: dict[str, list[StepMeasure]] = {mode: [] for mode in modes}
    for _step in range(steps):
        for mode, engine in engines.items():
            out[mode].append(measured_step(engine, micro_batches))
    for engine in engines.values():
        engine.close()
    return out


@contextlib.contextmanager
def _fixed_mmap_threshold() -> Iterator[None]:
    """MALLOC_MMAP_THRESHOLD_ in the environment the ranks are spawned with (glibc reads it when a process starts)."""
    before = os.environ.get("MALLOC_MMAP_THRESHOLD_")
    os.environ["MALLOC_MMAP_THRESHOLD_"] = str(MMAP_THRESHOLD)
    try:
        yield
    finally:
        if before is None:
            del os.environ["MALLOC_MMAP_THRESHOLD_"]
        else:
            os.environ["MALLOC_MMAP_THRESHOLD_"] = before


def measure(seq_len: int, steps: int, recompute: str = "none", timeout_s: float = 1800) -> dict[str, Any]:
    """cp=1 on one rank, then cp=4 Ulysses and ring on four: per configuration, each rank's largest peak rise and
    median step time, the step time of the slowest rank, and the ratios the table reports."""
    configurations: dict[str, Any] = {}
    launches = [(1, ("ulysses",)), (CP, MODES)]  # cp=1 ignores the mode: plain attention on the whole sequence
    for cp, modes in launches:
        with _fixed_mmap_threshold():
            ranks = run_distributed(train_modes, cp, seq_len, cp, modes, steps, recompute, dp=cp, timeout_s=timeout_s)
        for mode in modes:
            name = "cp1" if cp == 1 else f"cp{cp}-{mode}"
            per_rank = [r[mode] for r in ranks]
            # A step ends when its slowest rank does (the optimizer step's collectives): per step, the largest
            # wall time over the ranks.
            step_s = [max(r[i].wall_s for r in per_rank) for i in range(steps)]
            configurations[name] = {
                "cp": cp,
                "mode": None if cp == 1 else mode,
                "ranks": cp,
                "peak_rise_mib_per_rank": [max(s.rise_mib for s in r) for r in per_rank],
                "step_s": step_s,
                "median_step_s": statistics.median(step_s),
                "loss": [s.loss for s in per_rank[0]],
            }
    base = max(configurations["cp1"]["peak_rise_mib_per_rank"])
    for config in configurations.values():
        config["peak_vs_cp1"] = max(config["peak_rise_mib_per_rank"]) / base
    ring, ulysses = configurations[f"cp{CP}-ring"], configurations[f"cp{CP}-ulysses"]
    return {
        "configurations": configurations,
        "ring_over_ulysses_step": ring["median_step_s"] / ulysses["median_step_s"],
    }


def _versions() -> dict[str, str]:
    import deepspeed

    return {"python": platform.python_version(), "torch": torch.__version__, "deepspeed": deepspeed.__version__}


def _cpu_name() -> str:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def format_table(result: dict[str, Any]) -> str:
    rows = [
        f"seq {result['seq_len']}, {result['model']}, {result['steps']} measured steps per configuration, "
        f"recompute {result['recompute']}, load average {result['load_before']:.2f} before / "
        f"{result['load_after']:.2f} after",
        "| configuration | ranks | peak activation rise per rank (MiB) | vs cp=1 | median step (s) | steps (s) |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for name, c in result["configurations"].items():
        peaks = " / ".join(f"{p:.0f}" for p in c["peak_rise_mib_per_rank"])
        steps = " ".join(f"{s:.2f}" for s in c["step_s"])
        rows.append(
            f"| {name} | {c['ranks']} | {peaks} | {c['peak_vs_cp1']:.3f} | {c['median_step_s']:.2f} | {steps} |"
        )
    rows.append(f"ring / Ulysses median step time at cp={CP}: {result['ring_over_ulysses_step']:.3f}")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seq-len", type=int, default=16384, help="tokens per sequence (divisible by 2 x cp = 8)")
    parser.add_argument("--steps", type=int, default=3, help="measured steps per configuration")
    parser.add_argument("--recompute", default="none", choices=("none", "selective", "full"))
    parser.add_argument("--out", type=Path, help="write the result as JSON here")
    args = parser.parse_args(argv)
    load_before = os.getloadavg()[0]
    started = datetime.datetime.now(datetime.UTC)
    measured = measure(args.seq_len, args.steps, args.recompute)
    result = {
        "device": f"{_cpu_name()} ({os.cpu_count()} cores, no GPU), one thread per rank",
        "date": started.strftime("%Y-%m-%d %H:%M UTC"),
        "versions": _versions(),
        "command": "python -m bench.long_context " + " ".join(argv if argv is not None else sys.argv[1:]),
        "model": f"BLOOM {CONFIG.n_layer} layers, hidden {CONFIG.hidden_size}, {CONFIG.n_head} heads, "
        f"vocab {CONFIG.vocab_size}, fp32, micro-batch 1",
        "seq_len": args.seq_len,
        "steps": args.steps,
        "recompute": args.recompute,
        "load_before": load_before,
        "load_after": os.getloadavg()[0],
        "memory_measure": "per rank: VmHWM rise over VmRSS before the step, after malloc_trim, glibc mmap threshold "
        f"{MMAP_THRESHOLD} bytes; see the docstring",
        **measured,
    }
    print(format_table(result))
    if args.out is not None:
        args.out.write_text(json.dumps(result, indent=2) + "\n")
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
