"""Search over TP (inside a node), PP, context parallelism (CP degree and mode), DP, micro-batch, ZeRO stage,
recompute and sequence parallelism for the feasible layout with the best predicted step time; keep why each
alternative lost.

CP (GPU ranks; CPU ranks run data parallel only): powers of two dividing world / (tp pp), Ulysses where the heads
per TP rank divide by cp and ring always (the cheaper wins), each only while a sequence piece
(s / Layout.sequence_chunks) is at least one flash query tile. CP is searched only with micro-batches smaller than
cp: with mbs >= cp, the layout with dp x cp DP ranks and micro-batch mbs/cp gives every rank the same tokens, work,
activations and ZeRO partition without the exchange, so a CP layout can only win where it splits a sequence finer
than one per micro-batch.

A candidate is rejected for a hard constraint (heads % tp, pipeline balance, batch divisibility), for memory (it
does not fit), or for speed (it fits but is slower). Ties go to the simpler layout: lower ZeRO stage, less
recompute, no sequence parallelism, no (or less) CP, Ulysses before ring, smaller TP and PP. The kernels that
run (kernel_path.py) impose no shape limit of their own: heads wider than flash attention takes fall back to the
materialised path, which the cost model then charges. Selective recompute is searched only where it drops
something (not under flash attention). BLOOM-MoE: expert parallelism (ep, divisors of dp that divide the experts)
is searched smallest first and stops at the first ep that fits memory (``expert_parallel_degrees``), with and
without CP.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from appliance.errors import BadInput
from appliance.hardware.profile import Hardware
from appliance.planner.device import Device, make_device
from appliance.planner.kernel_path import KernelPath, kernels_for
from appliance.planner.layout import CP_MODES, Layout, layout_text, partition_error
from appliance.planner.memory import MemoryEstimate, memory_for_device
from appliance.planner.model_shape import RECOMPUTE_MODES, ModelShape
from appliance.planner.timing import FLASH_QUERY_BLOCK, StepTime, step_time_for_device

MAX_MICRO_BATCH = 64
CPU_RANKS_PER_NODE = 2  # the CPU smoke run: data parallel over 2 gloo ranks whenever there are 2+ cores


@dataclass(frozen=True)
class Evaluated:
    layout: Layout
    memory: MemoryEstimate
    time: StepTime
    problems: tuple[str, ...] = ()  # hard-constraint or memory reasons; empty when feasible
    notes: tuple[str, ...] = ()  # what the estimate assumed (the kernels), and what a layout asks that does nothing

    @property
    def feasible(self) -> bool:
        return not self.problems

    def rank_key(self) -> tuple[float, ...]:
        lay = self.layout
        return (
            round(self.time.total_s, 9),
            lay.zero_stage,
            RECOMPUTE_MODES.index(lay.recompute),
            int(lay.sequence_parallel),
            lay.cp,
            CP_MODES.index(lay.cp_mode),
            lay.tp,
            lay.pp,
            self.memory.total_gb,
        )


@dataclass
class SearchResult:
    best: Evaluated | None
    evaluated: list[Evaluated] = field(default_factory=list)
    constraint_rejections: list[tuple[dict[str, int], str]] = field(default_factory=list)
    candidates: int = 0


def evaluate(
    layout: Layout,
    model: ModelShape,
    hardware: Hardware,
    device: Device | None = None,
    kernels: KernelPath | None = None,
) -> Evaluated:
    """Memory, time and any reason the layout cannot run (the shape checks of Layout.validate are the caller's).
    `kernels`: what the run executes (default: what our appliance runs on this device)."""
    device = device or make_device(hardware, layout.world_size)
    kernels = kernels or kernels_for(device, model)
    memory = memory_for_device(layout, model, device, kernels=kernels)
    time = step_time_for_device(layout, model, device, hardware, kernels=kernels)
    problems = []
    if not memory.fits:
        unit = "GPU" if device.kind == "gpu" else "rank"
        problems.append(
            f"needs {memory.total_gb:.1f} GiB per {unit} (stage {memory.stage}) >"
            f" {memory.capacity_gb:.1f} GiB available"
        )
    notes = [f"kernels: {kernels.describe()}"]
    if layout.recompute == "selective" and not kernels.selective_recompute_helps:
        notes.append(
            "recompute=selective does nothing under flash attention (no [s, s] scores to drop):"
            " estimated as recompute=none"
        )
    return Evaluated(layout, memory, time, tuple(problems), tuple(notes))


def world_size_for(hardware: Hardware) -> int:
    """GPUs in the allocation, or CPU ranks: min(2, cores) per node."""
    if hardware.has_gpus:
        return hardware.world_gpus
    return hardware.nodes * min(CPU_RANKS_PER_NODE, hardware.cpu_cores)


def _powers_of_two(limit: int) -> list[int]:
    out, v = [], 1
    while v <= limit:
        out.append(v)
        v *= 2
    return out


def _cp_modes(
    model: ModelShape, tp: int, cp: int, where: dict[str, int], reject: Callable[[dict[str, int], str], None]
) -> list[str]:
    """The CP modes worth evaluating at this tp and cp (module docstring), rejecting the others with the reason."""
    if cp == 1:
        return ["ulysses"]  # the Layout default; no exchange runs
    s, heads = model.seq_len, model.heads // tp
    modes = []
    for mode, pieces in (("ulysses", cp), ("ring", 2 * cp)):
        if mode == "ulysses" and heads % cp:
            reject(
                where,
                f"cp_mode=ulysses: heads({model.heads}) / tp({tp}) = {heads} heads per TP rank is not divisible by"
                f" cp({cp}); ring needs no head split",
            )
        elif s % pieces:
            reject(where, f"seq_len({s}) is not divisible by {pieces} ({mode}'s pieces of a sequence at cp({cp}))")
        elif s // pieces < FLASH_QUERY_BLOCK:
            continue  # pieces shorter than a flash query tile: more cp only wastes tiles (not listed: expected)
        else:
            modes.append(mode)
    return modes


def expert_parallel_degrees(model: ModelShape, dp: int) -> list[int]:
    """The ep degrees worth trying, smallest first: divisors of dp (ep folds inside dp) that divide the experts of
    a block. A dense model: ep = 1 only."""
    if not model.moe_num_experts:
        return [1]
    return [ep for ep in range(1, dp + 1) if dp % ep == 0 and model.moe_num_experts % ep == 0]


def search_layouts(
    hardware: Hardware,
    model: ModelShape,
    global_batch_size: int,
    precision: str | None = None,
    *,
    only_tp: int | None = None,
    fixed: Mapping[str, Any] | None = None,
) -> SearchResult:
    """Every candidate layout for `model` at `global_batch_size` on `hardware` in `precision` (None: the hardware's
    default), the best feasible one first. `only_tp`: that TP degree alone, if the hardware allows it (the elastic
    step-down keeps the plan's, planner/shrink.py); None: every one it allows. `fixed`: Layout fields a partial
    --layout gave (parse_layout_fields): each takes that one value, even one the search would not try, and a
    combination that cannot run is a constraint rejection with its reason (Layout's own checks and validate's)."""
    fixed = dict(fixed or {})
    world = _world(hardware, fixed)
    device = make_device(hardware, world, precision)
    kernels = kernels_for(device, model)
    result = SearchResult(best=None)
    gbs = global_batch_size
    if hardware.has_gpus:
        tps = _powers_of_two(hardware.gpus_per_node)
        recomputes: tuple[str, ...] = RECOMPUTE_MODES
        # bf16 and fp16 run stage 1 for 0 (train_settings.engine_zero_stage): 0 would be the same run listed twice
        zeros: tuple[int, ...] = (0, 1, 2) if device.dtype == "fp32" else (1, 2)
    else:
        # CPU ranks: data parallel only (the smoke run's layout), plain gradient all-reduce: gloo has no
        # reduce-scatter and ZeRO's overlap needs CUDA streams. Recompute stays available for big shapes.
        tps = [1]
        recomputes, zeros = RECOMPUTE_MODES, (0,)
    if only_tp is not None:
        tps = [tp for tp in tps if tp == only_tp]
    # Selective recompute only where it drops [s, s] tensors: under flash it would be recompute=none by another name.
    recomputes = tuple(r for r in recomputes if r != "selective" or kernels.selective_recompute_helps)
    q = int(fixed.get("tp2d", 1))  # 2D tensor parallelism only when --layout asks: q x q ranks in tp's place
    seen_reasons: set[str] = set()

    def reject(where: dict[str, int], reason: str) -> None:
        if reason not in seen_reasons:
            seen_reasons.add(reason)
            result.constraint_rejections.append((where, reason))

    def pick(name: str, choices: Iterable[Any]) -> list[Any]:
        return [fixed[name]] if name in fixed else list(choices)

    for tp in pick("tp", tps):
        if model.heads % tp:
            reject({"tp": tp}, f"heads({model.heads}) is not divisible by tp({tp})")
            continue
        ranks = tp * q * q  # one tensor-parallel group
        if world % ranks:
            if "tp" in fixed:
                group = f"tp({tp})" if q == 1 else f"tp2d({q})^2 = {ranks}"
                reject({"tp": tp}, f"{group} does not divide the world size {world}")
            continue
        pps = [p for p in range(1, world // ranks + 1) if (world // ranks) % p == 0] if hardware.has_gpus else [1]
        for pp in pick("pp", pps):
            if world % (ranks * pp):
                if "pp" in fixed:
                    reject({"tp": tp, "pp": pp}, f"{ranks} x pp({pp}) ranks do not divide the world size {world}")
                continue
            problem = partition_error(model.layers, pp)
            if problem:
                reject({"tp": tp, "pp": pp}, problem)
                continue
            cps = _powers_of_two(world // (ranks * pp)) if hardware.has_gpus else [1]
            # BLOOM-MoE too: experts are replicated over cp like the dense weights (memory.py counts E/ep of them
            # per rank whatever cp, their ZeRO partitions over dp x cp / ep) and each CP rank routes its s/cp tokens.
            for cp in (c for c in pick("cp", cps) if (world // (ranks * pp)) % c == 0):
                dp = world // (ranks * pp * cp)
                if "dp" in fixed and dp != fixed["dp"]:
                    continue
                where = {"tp": tp, "pp": pp, "dp": dp} | ({"cp": cp} if cp > 1 else {})
                if gbs % dp:
                    reject(where, f"global batch({gbs}) is not divisible by dp({dp})")
                    continue
                modes = [fixed["cp_mode"]] if "cp_mode" in fixed else _cp_modes(model, tp, cp, where, reject)
                for cp_mode in modes:
                    # mbs >= cp: the same ranks as dp x cp DP ranks at mbs/cp do the same work without the exchange
                    mbss = (b for b in _powers_of_two(min(MAX_MICRO_BATCH, gbs // dp)) if cp == 1 or b < cp)
                    for mbs in pick("micro_batch_size", mbss):
                        if gbs % (mbs * dp):
                            if "micro_batch_size" in fixed:
                                reject(where, f"global batch({gbs}) is not divisible by mbs({mbs}) * dp({dp})")
                            continue
                        for recompute in pick("recompute", recomputes):
                            # Experts need the MoE block's input replicated over tp (DeepSpeed drops duplicates):
                            # no sequence parallelism with them (experts.parallel.check_moe_layout).
                            sps = (False, True) if tp > 1 and q == 1 and not model.moe_num_experts else (False,)
                            for sp in pick("sequence_parallel", sps):
                                # DeepSpeed's pipeline engine stops at ZeRO-1: stage 2 only without a pipeline.
                                stages = (z for z in zeros if pp == 1 or z < 2) if dp * cp > 1 else (0,)
                                for zero in pick("zero_stage", stages):
                                    for ep in pick("ep", expert_parallel_degrees(model, dp)):
                                        values = (tp, pp, dp, mbs, gbs, zero, recompute, sp, cp, cp_mode, q, ep)
                                        layout = _candidate(values, model, world, device, fixed, where, reject)
                                        if layout is None:
                                            continue
                                        result.candidates += 1
                                        evaluated = evaluate(layout, model, hardware, device, kernels)
                                        result.evaluated.append(evaluated)
                                        # The smallest ep that fits: a larger one spreads the same exchange over
                                        # more ranks (more all-to-all messages, more of them across nodes) and
                                        # only saves memory, which this layout no longer needs.
                                        if evaluated.feasible:
                                            break
    if fixed and not result.candidates:  # whatever else was refused, say that none had the fields
        reject({}, f"no layout of {world} ranks has {layout_text(fixed)}")
    feasible = [e for e in result.evaluated if e.feasible]
    result.best = min(feasible, key=Evaluated.rank_key) if feasible else None
    return result


def _world(hardware: Hardware, fixed: Mapping[str, Any]) -> int:
    """The ranks to search over: the GPUs; on CPU, where ranks are processes, the product of the degrees --layout
    fixed when it fixed dp (tp, pp, cp and tp2d taken as 1 where not given), else world_size_for's."""
    if hardware.has_gpus or "dp" not in fixed:
        return world_size_for(hardware)
    degrees = [fixed.get(k, 1) for k in ("tp", "pp", "dp", "cp")] + [fixed.get("tp2d", 1)] * 2
    return math.prod(int(d) for d in degrees)


def _candidate(
    values: tuple[Any, ...],
    model: ModelShape,
    world: int,
    device: Device,
    fixed: Mapping[str, Any],
    where: dict[str, int],
    reject: Callable[[dict[str, int], str], None],
) -> Layout | None:
    """The layout of these values. The search's own combinations are valid by construction; with fields --layout
    fixed, each is checked as a given layout is (Layout, then validate) and a refusal becomes a rejection."""
    tp, pp, dp, mbs, gbs, zero, recompute, sp, cp, cp_mode, q, ep = values
    if not fixed:
        return Layout(tp, pp, dp, mbs, gbs, zero, recompute, sp, cp, cp_mode, ep=ep)
    try:
        layout = Layout(tp, pp, dp, mbs, gbs, zero, recompute, sp, cp, cp_mode, tp2d=q, ep=ep)
        layout.validate(
            world, model.heads, model.layers, model.seq_len, moe_num_experts=model.moe_num_experts, dtype=device.dtype
        )
    except BadInput as e:
        reject(where, re.sub(r"^layout [^:]*: ", "", str(e)))  # the broken rule, once for all its candidates
        return None
    return layout
