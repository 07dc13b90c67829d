"""The layout rules that depend on the model's experts, the run's precision or its expert store: each a function of
plain values returning the broken rules' text, so that ``Layout.validate`` (the planner, the head reading plan.json
and every rank before its process groups) and the training engine's own checks (parallel/experts/parallel.py
``check_moe_layout``, parallel/experts/store_engine.py ``check_store_layout``, parallel/step/build.py) refuse a layout
in the same words. ``tp`` here is the tensor-parallel axis's ranks (``Layout.tp_ranks``, the topology's tp).
"""

from __future__ import annotations

STORE = "train.expert_device_budget_mb > 0 (the tiered expert store)"


def moe_problems(*, moe_num_experts: int, ep: int, tp: int, tp2d: int, sequence_parallel: bool) -> list[str]:
    """What keeps this layout from running a model with ``moe_num_experts`` experts per MoE block (0: dense)."""
    problems = []
    if ep > 1 and not moe_num_experts:
        problems.append(f"ep({ep}) > 1 needs an MoE model (moe_num_experts > 0); this one is dense")
    elif moe_num_experts % ep:
        problems.append(f"moe_num_experts({moe_num_experts}) is not divisible by ep({ep})")
    if moe_num_experts:
        if tp > 1 and sequence_parallel:
            # DeepSpeed drops 1/tp of the tokens on each tp rank as duplicates: sequence chunks are not duplicates.
            problems.append(
                f"sequence_parallel with tp({tp}) > 1 and experts: the MoE block needs its input replicated over tp"
                " (docs/MOE.md); turn sequence_parallel off"
            )
        if tp2d > 1:
            problems.append(f"tp2d({tp2d}) > 1 with experts is not supported (experts shard over 1D tp)")
    return problems


def tp2d_precision_problems(*, tp2d: int, dtype: str, zero_stage: int) -> list[str]:
    """The 2D mesh's precision and ZeRO limits."""
    if tp2d > 1 and (dtype == "fp16" or zero_stage > 1):
        # bf16 and ZeRO-1 count the mesh-row-replicated vectors once (layers2d._mark_2d) and are proven at tp2d = 2
        # (tests/distributed/test_tp2d.py); fp16's loss scaler and ZeRO-2's gradient partitions are not yet.
        return [
            f"tp2d({tp2d}) trains in fp32 or bf16 at ZeRO 0 or 1, got dtype {dtype} and zero {zero_stage}: "
            "fp16 and ZeRO 2/3 are not proven with the 2D mesh yet"
        ]
    return []


def store_problems(
    *,
    is_moe: bool,
    dtype: str,
    zero_stage: int,
    cp: int = 1,
    tp: int = 1,
    device_budget_bytes: int = 1,
    host_budget_bytes: int = 0,
) -> list[str]:
    """What keeps the tiered expert store (parallel/experts/store_engine.py) from running with these settings: [] when
    it runs or is not asked for (both budgets 0), else one problem naming every key."""
    if device_budget_bytes <= 0 and host_budget_bytes <= 0:
        return []
    if host_budget_bytes > 0 and device_budget_bytes <= 0:
        return [
            f"train.expert_host_budget_mb ({host_budget_bytes:,} B) needs train.expert_device_budget_mb > 0: with no"
            " device budget every expert stays resident and none reaches host memory or disk"
        ]
    problems = []
    if not is_moe:
        problems.append("the model has no experts (model moe_num_experts = 0)")
    if dtype == "fp16":
        # fp16 scales the loss dynamically: the store would have to unscale its gradients and share the overflow
        # verdict with ZeRO's loss scaler, which nothing here does yet
        problems.append("train.dtype is fp16, the store trains fp32 or bf16 experts (fp16's loss scaling is not wired)")
    if cp > 1:
        # with cp the experts' gradients are partial sums over cp too (edp_cp group, divided by dp x cp); the store
        # reduces over edp and divides by dp
        problems.append(f"layout cp is {cp}, the store reduces its experts over edp only (cp = 1)")
    if tp > 1:
        # with tp the experts are tp slices (model/moe.py ExpertMLP): their squares count on every tp rank and their
        # rows/columns load and save through the tp-sliced checkpoint readers; the store keeps whole experts and
        # counts its squares on tp rank 0 only
        problems.append(f"layout tp is {tp}, the store holds whole experts (tp = 1)")
    if zero_stage > 1:
        # ZeRO-2 reduces gradient partitions during backward (and in bf16 replaces the bf16 optimizer the store
        # joins): not proven with the store
        problems.append(f"layout.zero_stage is {zero_stage}, the store is wired at ZeRO 0 and 1")
    if not problems:
        return []
    return [f"{STORE}: " + "; ".join(problems) + " (set expert_device_budget_mb=0 to keep every expert resident)"]
