"""The alternatives a plan shows and why each lost: hard-constraint failures, faster layouts that do not fit, and the
best of those that fit but run slower (plan.json's `rejected` and `rejected_counts`)."""

from __future__ import annotations

from typing import Any

from appliance.planner.cp_reasons import best_without_cp, lost_to_cp
from appliance.planner.layout import Layout
from appliance.planner.search import Evaluated, SearchResult

MAX_REJECTED_PER_KIND = 6


def rejections(result: SearchResult, best: Evaluated | None) -> tuple[list[dict[str, Any]], dict[str, int]]:
    """The alternatives worth showing: hard-constraint failures, faster layouts that do not fit, and the best of
    the layouts that fit but run slower (one per tp/pp/dp/cp/mbs/recompute combination); when the best splits
    sequences (cp > 1), first the layout without CP it beat."""
    out: list[dict[str, Any]] = [{"layout": w, "reason": r} for w, r in result.constraint_rejections]
    out = out[:MAX_REJECTED_PER_KIND]
    seen: set[tuple[Any, ...]] = set()
    without_cp = best_without_cp(result) if best is not None and best.layout.cp > 1 else None
    if without_cp is not None and best is not None:  # the layout CP beat, first: why the plan splits sequences
        seen.add(shown_key(without_cp.layout))
        out.append({"layout": without_cp.layout.to_dict(), "reason": lost_to_cp(without_cp, best)})
    infeasible = sorted((e for e in result.evaluated if not e.feasible), key=Evaluated.rank_key)
    feasible = sorted((e for e in result.evaluated if e.feasible and e is not best), key=Evaluated.rank_key)
    best_time = best.time.total_s if best else float("inf")
    shown = 0
    for e in infeasible:
        if e.time.total_s >= best_time or shown >= MAX_REJECTED_PER_KIND:
            break
        key = shown_key(e.layout)
        if key not in seen:
            seen.add(key)
            shown += 1
            out.append({"layout": e.layout.to_dict(), "reason": "; ".join(e.problems)})
    shown = 0
    for e in feasible:
        key = shown_key(e.layout)
        if key in seen or shown >= MAX_REJECTED_PER_KIND:
            continue
        seen.add(key)
        shown += 1
        slower = (e.time.total_s / best_time - 1) * 100
        out.append(
            {
                "layout": e.layout.to_dict(),
                "reason": f"fits, but predicted {slower:.1f}% slower"
                f" ({e.time.total_s:.3g} s vs {best_time:.3g} s per step)",
            }
        )
    memory = sum(1 for e in infeasible if any(p.startswith("needs ") for p in e.problems))
    counts = {
        "constraint": len(result.constraint_rejections) + len(infeasible) - memory,
        "memory": memory,
        "slower": len(feasible),
    }
    return out, counts


def shown_key(layout: Layout) -> tuple[Any, ...]:
    """One rejected alternative is shown per combination of these (the ZeRO stage and SP variants are left out)."""
    return (layout.tp, layout.pp, layout.dp, layout.cp, layout.cp_mode, layout.micro_batch_size, layout.recompute)
