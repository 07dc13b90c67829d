"""Fused kernels against torch eager, torch.compile, FlexAttention (and flash-attn), measured in one run on one GPU.

    .venv/bin/python bench/kernels.py [--iters 50] [--warmup 10] [--out bench/results] [--only flash_attention ...]
    .venv/bin/python bench/kernels.py --allow-cpu     (no GPU: tiny shapes through Triton's interpreter, a smoke check)

For every kernel, first the correctness check against the fp32 torch twin (kernels/reference.py); a kernel that
fails it is not timed and the exit code is 1. Then, per pass (forward, forward+backward): the median of --iters
CUDA-event timings after --warmup calls; the achieved bandwidth (memory-bound kernels) or TFLOP/s (attention,
the LM head) and its share of a ceiling measured in this same run (a device-to-device copy; a large bf16
matmul); the speedup over each peer (peer time / ours). Shapes are BLOOM-176B's per-GPU shapes at tp=4,
micro-batch 2, sequence 2048. Results go to <out>/<date>-<device>-kernels.json, one record per kernel and pass.
"""

from __future__ import annotations

import sys
from pathlib import Path

# This file shares its name with the `kernels` package: drop its directory from the import path and put the
# repository root there, so `import kernels` finds the package.
_HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _HERE]
sys.path.insert(0, str(_HERE.parent))

import argparse  # noqa: E402
import datetime  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import re  # noqa: E402
from collections.abc import Sequence  # noqa: E402
from typing import Any  # noqa: E402

import torch  # noqa: E402

# The cases and their measurement live in the package (`./bloom_appliance.py bench` runs them at the trained
# model's shapes); this script runs them at BLOOM-176B's.
from appliance.benchmark.ceilings import Timer, machine_ceilings  # noqa: E402
from appliance.benchmark.kernel_table import KernelCases, RankShapes, kernel_records  # noqa: E402

# micro-batch 2 x seq 2048 tokens, hidden 14336, 112 / 4 = 28 heads of 128, MLP 4 * 14336 / 4 = 14336 columns per
# rank, vocab 250880 / 4 = 62720 rows per rank
BLOOM_176B_TP4 = RankShapes(batch=2, seq=2048, hidden=14336, heads=28, ffn=14336, vocab=62720)
TINY = RankShapes(batch=1, seq=17, hidden=40, heads=2, ffn=40, vocab=50)  # odd sizes: ragged blocks everywhere


def run(args: argparse.Namespace) -> int:
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    timer = Timer(cuda, args.warmup, args.iters)
    ceiling = machine_ceilings(timer, device, torch.bfloat16, small=not cuda)
    device_name = torch.cuda.get_device_name(device) if cuda else "cpu-interpreter"
    print(f"{device_name}: copy {ceiling['copy_gbps']:.0f} GB/s, bf16 matmul {ceiling['matmul_tflops']:.1f} TFLOP/s")
    # head dims: the widest and the narrowest of the presets (bench command: all four)
    cases = KernelCases(device, BLOOM_176B_TP4 if cuda else TINY, head_dims=(64, 128))
    records = kernel_records(cases, timer, ceiling, only=args.only)
    write_results(args.out, device_name, ceiling, records)
    return 0 if all(r["correct"] for r in records) else 1


def write_results(out: Path, device_name: str, ceiling: dict[str, float], records: list[dict[str, Any]]) -> Path:
    today = datetime.date.today().isoformat()
    slug = re.sub(r"[^a-z0-9]+", "-", device_name.lower()).strip("-")
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{today}-{slug}-kernels.json"
    payload = {"device": device_name, "date": today, "torch": torch.__version__, "ceilings": ceiling,
               "records": records}  # fmt: skip
    path.write_text(json.dumps(payload, indent=2) + "\n")
    print(f"wrote {path}")
    return path


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--iters", type=int, default=50, help="timed calls per measurement (median reported)")
    parser.add_argument("--warmup", type=int, default=10, help="untimed calls before each measurement")
    parser.add_argument("--out", type=Path, default=_HERE / "results", help="directory for the JSON results")
    parser.add_argument("--only", nargs="*", default=[], help="kernel name prefixes to run (default: all)")
    parser.add_argument("--allow-cpu", action="store_true", help="without a GPU, smoke-run tiny shapes on CPU")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        if not args.allow_cpu:
            message = (
                "bench/kernels.py needs a CUDA GPU to measure the kernels; none is visible. "
                "Use --allow-cpu for a smoke run of tiny shapes through Triton's CPU interpreter."
            )
            print(message, file=sys.stderr)
            return 1
        # Before any kernel module is imported: @triton.jit reads TRITON_INTERPRET when it decorates.
        os.environ["TRITON_INTERPRET"] = "1"
        os.environ["BLOOM_KERNELS"] = "triton"
        args.iters, args.warmup = 1, 0  # a smoke check of the code paths, not a measurement
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
