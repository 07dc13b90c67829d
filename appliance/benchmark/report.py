"""The bench's result: one JSON object (the keys below are public) and the table printed from it.

Keys: device, date, versions, model, workload, flop_convention, tokens_per_s, tokens_per_s_hf_eager,
tokens_per_s_hf_compile, ratio_vs_hf_eager, ratio_vs_hf_compile, tflops_per_device, mfu, peak_tflops_per_device,
contenders (per contender: status "ok" with tokens_per_s, median_step_s, mean_step_s, steps_timed, or status
"out_of_memory" with micro_batch_size, tokens_per_step, error; both with peak_memory_gb, and profile with --profile:
profile.py), ceilings, kernels (one record per op and pass, kernel_table.py), calls_per_step. A figure of a
contender that ran out of memory is null, and so is every ratio or MFU that needs it.
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


def is_result(path: Path) -> bool:
    """Whether `path` holds a bench result (what `bench --out` may replace)."""
    try:
        read_json(path)
    except (OSError, ValueError, TypeError):
        return False
    return True


def _figure(value: float | None, spec: str, width: int) -> str:
    return f"{value:{width}{spec}}" if value is not None else f"{'-':>{width}s}"


def format_table(result: dict[str, Any]) -> str:
    work, ceiling = result["workload"], result["ceilings"]
    lines = [
        f"bench {result['model']} on {result['device']} ({result['date']}): {work['tokens_per_step']} tokens per step"
        f" = {work['micro_batches']} x micro-batch {work['micro_batch_size']} x {work['seq_len']}, {work['dtype']},"
        f" recompute {work['recompute']}, {work['threads']} threads; {work['warmup_steps']} warm-up steps (not timed),"
        f" {work['steps']} timed",
        f"ceilings: copy {ceiling['copy_gbps']:.1f} GB/s, {ceiling['matmul_dtype']} matmul"
        f" {ceiling['matmul_tflops']:.3f} TFLOP/s; peak per device (plan) {result['peak_tflops_per_device']} TFLOP/s",
        "",
        f"{'contender':38s} {'tokens/s':>10s} {'step s':>8s} {'TFLOP/s':>8s} {'MFU':>7s} {'ours / it':>9s}"
        f" {'peak GiB':>8s}",
    ]
    flops_per_token = result["model_flops_per_token"]
    peak = result["peak_tflops_per_device"]
    for name, c in result["contenders"].items():
        memory = _figure(c.get("peak_memory_gb"), ".1f", 8)
        if c.get("status") == "skipped":
            lines.append(f"{name:38s} {'skipped':>37s}")
            continue
        if c.get("status", "ok") != "ok":
            lines.append(f"{name:38s} {'out of memory':>37s} {'':9s} {memory}  {c['error'][:60]}")
            continue
        tflops = c["tokens_per_s"] * flops_per_token / 1e12
        mfu = f"{tflops / peak:7.1%}" if peak else "    n/a"
        ratio = result["tokens_per_s"] / c["tokens_per_s"] if result["tokens_per_s"] is not None else None
        lines.append(
            f"{name:38s} {c['tokens_per_s']:10.1f} {c['median_step_s']:8.4f} {tflops:8.4f} {mfu}"
            f" {_figure(ratio, '.2f', 9)} {memory}"
        )
    lines += _profile_lines(result["contenders"])
    lines += [
        "",
        f"{'op':22s} {'pass':8s} {'calls':>5s} {'ms':>9s} {'host us':>9s} {'achieved':>16s} {'ceiling':>7s}"
        "  peers (x: ours faster)",
    ]
    for r in result["kernels"]:
        if not r["correct"]:
            lines.append(
                f"{r['kernel']:22s} {r['pass']:8s} FAILED correctness: relative error {r['max_rel_error']:.2e}"
            )
            continue
        peers = "  ".join(f"{name} x{value:.2f}" for name, value in r["speedup"].items())
        lines.append(
            f"{r['kernel']:22s} {r['pass']:8s} {r.get('calls_per_step', 0):5d} {r['ms']:9.3f} {r['cpu_us']:9.1f}"
            f" {r['achieved']:8.2f} {r['unit']:7s} {r['pct_of_ceiling']:6.1f}%  {peers}"
        )
    return "\n".join(lines)


def _profile_lines(contenders: dict[str, Any]) -> list[str]:
    """Per profiled contender: its per-step figures, then its top kernels (GPU) or operators (CPU)."""
    lines: list[str] = []
    for name, c in contenders.items():
        p = c.get("profile")
        if p is None:
            continue
        if p.get("status") == "out_of_memory":
            lines += ["", f"profile of {name}: out of memory ({p['error'][:80]})"]
            continue
        idle = f"GPU idle {p['gpu_idle_share']:.1%}" if p["gpu_idle_share"] is not None else "no GPU"
        lines += [
            "",
            f"profile of {name}, {p['steps']} steps ({p['trace']}): {p['wall_ms'] / p['steps']:.1f} ms a step,"
            f" {idle}; per step {p['kernels_per_step']:.0f} kernels, {p['launches_per_step']:.0f} launches,"
            f" {p['host_syncs_per_step']:.1f} host syncs"
            + "".join(f"; {k} {v:g}" for k, v in p["sync_events_per_step"].items()),
        ]
        rows, column = (p["top_kernels"], "ms") if p["top_kernels"] else (p["top_ops"], "self_ms")
        what = "kernel" if p["top_kernels"] else "operator (self time)"
        lines.append(f"  {what:70s} {'calls':>6s} {'ms':>9s} {'share':>6s}")
        for row in rows[:10]:
            lines.append(f"  {row['name'][:70]:70s} {row['calls']:6d} {row[column]:9.2f} {row['share']:6.1%}")
    return lines
