"""The bench's result: one JSON object (the keys below are public) and the table printed from it.

Keys: device, date, versions, model, workload, flop_convention, tokens_per_s, tokens_per_s_hf_eager,
tokens_per_s_hf_compile, ratio_vs_hf_eager, ratio_vs_hf_compile, tflops_per_device, mfu, peak_tflops_per_device,
contenders (per contender: tokens_per_s, median_step_s, mean_step_s, steps_timed), ceilings, kernels (one record
per op and pass, kernel_table.py), calls_per_step.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

FLOP_CONVENTION = (
    "model FLOPs = 6N + 6*L*s*h per token (planner/model_shape.py flops_per_token): N = weights in matrix multiplies,"
    " the tied LM head once; causal attention counted as computed (half the s x s square). The trainer's step"
    " events use the same formula (train/metrics.py)."
)
REQUIRED_KEYS = ("tokens_per_s", "tokens_per_s_hf_eager", "tokens_per_s_hf_compile", "mfu", "device")


def write_json(result: dict[str, Any], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1, default=str) + "\n")


def read_json(path: Path) -> dict[str, Any]:
    """A bench result back, checked for the public keys (ValueError naming the file and the missing keys)."""
    result = json.loads(Path(path).read_text())
    missing = [key for key in REQUIRED_KEYS if key not in result]
    if missing:
        raise ValueError(f"{path}: not a bench result, missing {', '.join(missing)}")
    return result


def format_table(result: dict[str, Any]) -> str:
    work, ceiling = result["workload"], result["ceilings"]
    lines = [
        f"bench {result['model']} on {result['device']} ({result['date']}): {work['tokens_per_step']} tokens per step"
        f" = {work['micro_batches']} x micro-batch {work['micro_batch_size']} x {work['seq_len']}, {work['dtype']},"
        f" recompute {work['recompute']}, {work['threads']} threads",
        f"ceilings: copy {ceiling['copy_gbps']:.1f} GB/s, {ceiling['matmul_dtype']} matmul"
        f" {ceiling['matmul_tflops']:.3f} TFLOP/s; peak per device (plan) {result['peak_tflops_per_device']} TFLOP/s",
        "",
        f"{'contender':38s} {'tokens/s':>10s} {'step s':>8s} {'TFLOP/s':>8s} {'MFU':>7s} {'ours / it':>9s}",
    ]
    flops_per_token = result["model_flops_per_token"]
    peak = result["peak_tflops_per_device"]
    for name, c in result["contenders"].items():
        tflops = c["tokens_per_s"] * flops_per_token / 1e12
        mfu = f"{tflops / peak:7.1%}" if peak else "    n/a"
        ratio = result["tokens_per_s"] / c["tokens_per_s"]
        lines.append(f"{name:38s} {c['tokens_per_s']:10.1f} {c['median_step_s']:8.4f} {tflops:8.4f} {mfu} {ratio:9.2f}")
    lines += [
        "",
        f"{'op':22s} {'pass':8s} {'calls':>5s} {'ms':>9s} {'achieved':>16s} {'ceiling':>7s}  peers (x: ours faster)",
    ]
    for r in result["kernels"]:
        if not r["correct"]:
            lines.append(
                f"{r['kernel']:22s} {r['pass']:8s} FAILED correctness: relative error {r['max_rel_error']:.2e}"
            )
            continue
        peers = "  ".join(f"{name} x{value:.2f}" for name, value in r["speedup"].items())
        lines.append(
            f"{r['kernel']:22s} {r['pass']:8s} {r.get('calls_per_step', 0):5d} {r['ms']:9.3f}"
            f" {r['achieved']:8.2f} {r['unit']:7s} {r['pct_of_ceiling']:6.1f}%  {peers}"
        )
    return "\n".join(lines)
