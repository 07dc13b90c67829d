"""Every Triton kernel compiled ahead of time for sm_80 (A100) and sm_90 (H100) on this machine, no GPU needed:
one row per compiled specialisation with registers per thread, spills and shared memory.

    .venv/bin/python -m bench.kernels_compile [--quick] [--json PATH]

Shapes: each GPU model preset (presets/models, without CPU_PRESETS below) as one tensor-parallel rank sees it at
the layout of its reference run (presets/reference: BLOOM-176B at tp=4,
micro-batch 2), else tp=1 and micro-batch 1. Inputs are bf16, what training runs on these GPUs; flash attention
is also compiled for fp32 inputs, which its launcher gives their own tiles on CUDA. The launchers pick every
configuration themselves (kernels.launch.recording); kernels.aot compiles what they launch. --quick: one
compile per kernel and target (the first shape that launches it, largest model first).

Exit status 1 when a build spills registers or exceeds a limit of its target (kernels.aot.problems).
"""

from __future__ import annotations

import sys
from pathlib import Path

# bench/ holds a tokenize.py that would shadow the standard library's (Triton reads kernel sources through
# inspect, which imports tokenize): keep bench/ off the import path and put the repository root on it.
_HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _HERE]
sys.path.insert(0, str(_HERE.parent))

import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import time  # noqa: E402
from collections.abc import Sequence  # noqa: E402
from dataclasses import asdict  # noqa: E402

import torch  # noqa: E402

from appliance.planner.model_shape import load_model_shape  # noqa: E402
from appliance.presets import list_presets, load_preset  # noqa: E402

CPU_PRESETS = (
    "bloom-tiny-cpu",
    "bloom-micro-test",
    "bloom-moe-tiny-cpu",
)  # sized for CPU smoke runs and the unit tests
EXTRA_DTYPES = {"flash_attention": (torch.bfloat16, torch.float32)}


def training_shapes() -> list:
    """One kernels.aot.TrainingShape per GPU model preset, largest hidden size first."""
    from kernels.aot import TrainingShape

    layouts = {}
    for name in list_presets("reference"):
        _, table = load_preset("reference", name)
        layouts[table["model"]] = table.get("layout", {})
    shapes = []
    for name in list_presets("models"):
        if name in CPU_PRESETS:
            continue
        model = load_model_shape(name)
        layout = layouts.get(name, {})
        tp, micro_batch = int(layout.get("tp", 1)), int(layout.get("micro_batch_size", 1))
        shapes.append(
            TrainingShape(
                model=name, hidden=model.hidden, head_dim=model.head_dim, heads=model.heads // tp,
                ffn=model.ffn_hidden // tp, vocab=model.padded_vocab(tp) // tp, seq_len=model.seq_len,
                micro_batch=micro_batch, tp=tp,
            )
        )  # fmt: skip
    return sorted(shapes, key=lambda s: -s.hidden)


def compile_table(quick: bool) -> list[dict]:
    """Rows (kernels.aot.Build as dicts, with "problems") for sm_80 and sm_90."""
    from kernels import aot

    shapes = training_shapes()
    rows = []
    for target in aot.TARGETS:
        recorded = aot.record(shapes, target, {} if quick else EXTRA_DTYPES)
        if quick:
            recorded = aot.representatives(recorded)
        for build in aot.compile_all(recorded, target):
            rows.append(asdict(build) | {"problems": aot.problems(build)})
    return rows


def tile_candidate_table() -> list[dict]:
    """Rows for every flash-attention tile candidate the measured selection may time
    (kernels.flash_attention.tile_candidates), at each GPU preset's head dim, without and with documents, in bf16,
    for sm_80 and sm_90: each candidate recorded as the launchers launch it when the selection has chosen it."""
    from kernels import aot
    from kernels import flash_attention as fa
    from kernels.launch import recording

    by_head_dim: dict[int, object] = {}
    for shape in training_shapes():
        by_head_dim.setdefault(shape.head_dim, shape)
    rows = []
    for target in aot.TARGETS:
        recorded = []
        for shape in by_head_dim.values():
            for documents, op in ((False, "flash_attention"), (True, "flash_attention_packed")):
                run, size = aot.OPS[op]
                for cfg in fa.tile_candidates(shape.head_dim, torch.bfloat16, target.capability, documents):
                    key = (shape.head_dim, torch.bfloat16, target.capability, documents, shape.seq_len, shape.seq_len)
                    fa.TUNED_TILES[key] = cfg
                    try:
                        with recording(target) as launches:
                            run(shape, torch.bfloat16)
                    finally:
                        del fa.TUNED_TILES[key]
                    recorded += [aot.Recorded(op, size(shape), torch.bfloat16, shape, one) for one in launches]
        for build in aot.compile_all(recorded, target):
            rows.append(asdict(build) | {"problems": aot.problems(build)})
    return rows


def _short(kernel: str) -> str:
    return kernel.removeprefix("_").removesuffix("_kernel")


def _specialisation(row: dict) -> str:
    """What sets this build apart beyond its blocks: flags on, arguments not divisible by 16, arguments equal to 1."""
    flags = [k for k, v in row["constexprs"].items() if v is True and k != "CAUSAL"]  # every launch is causal
    return "; ".join(flags + [f"{n} not /16" for n in row["not_divisible"]] + [f"{n}=1" for n in row["ones"]])


def format_table(rows: list[dict]) -> str:
    header = ("kernel", "target", "dtype", "head dim / width", "blocks", "warps", "stages", "regs", "spill B",
              "shared B", "specialisation", "models")  # fmt: skip
    lines = [header]
    for r in rows:
        blocks = " ".join(f"{k[6:]}={v}" for k, v in r["constexprs"].items() if k.startswith("BLOCK_"))
        lines.append((
            _short(r["kernel"]), f"sm_{r['capability']}", r["dtype"], ", ".join(r["sizes"]), blocks,
            str(r["num_warps"]), str(r["num_stages"]), str(r["registers"]), str(r["stack_bytes"]),
            str(r["shared_bytes"]), _specialisation(r), ", ".join(m.removeprefix("bloom-") for m in r["models"]),
        ))  # fmt: skip
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
    out = ["| " + " | ".join(cell.ljust(w) for cell, w in zip(line, widths, strict=True)) + " |" for line in lines]
    out.insert(1, "|" + "|".join("-" * (w + 2) for w in widths) + "|")
    return "\n".join(out)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="one compile per kernel and target")
    parser.add_argument("--json", type=Path, help="also write the rows to this JSON file")
    parser.add_argument(
        "--tile-candidates", action="store_true", help="flash attention's tile candidates (measured selection) only"
    )
    args = parser.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET"):
        print("kernels_compile: unset TRITON_INTERPRET (the interpreter replaces the kernels)", file=sys.stderr)
        return 2
    import triton

    start = time.perf_counter()
    rows = tile_candidate_table() if args.tile_candidates else compile_table(args.quick)
    print(format_table(rows))
    print(f"\n{len(rows)} builds in {time.perf_counter() - start:.0f} s, triton {triton.__version__}")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1, default=str))
    bad = [r for r in rows if r["problems"]]
    for r in bad:
        where = f"{r['kernel']} sm_{r['capability']} {r['dtype']} {', '.join(r['sizes'])}"
        print(f"{where}: {'; '.join(r['problems'])}", file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
