"""Why a plan splits sequences (context parallelism): the layout without CP that the chosen one beat, the note that
says how (it does not fit, or it is slower), and the note on what the exchange sends."""

from __future__ import annotations

from appliance.hardware.profile import Hardware
from appliance.planner.comm import communication_bytes_per_rank
from appliance.planner.device import Device, cp_link
from appliance.planner.model_shape import ModelShape
from appliance.planner.search import Evaluated, SearchResult


def best_without_cp(result: SearchResult) -> Evaluated | None:
    """The fastest layout with cp = 1 that fits, else the leanest with cp = 1: what context parallelism beat."""
    plain = [e for e in result.evaluated if e.layout.cp == 1]
    fits = [e for e in plain if e.feasible]
    if fits:
        return min(fits, key=Evaluated.rank_key)
    return min(plain, key=lambda e: e.memory.total_gb) if plain else None


def lost_to_cp(plain: Evaluated, best: Evaluated) -> str:
    """Why `plain` (cp = 1) lost to the chosen CP layout: it does not fit, or it is slower."""
    if not plain.feasible:
        mem = plain.memory
        activations = mem.breakdown_gb.get("activations", 0.0)
        return (
            f"needs {mem.total_gb:.1f} GiB per GPU > {mem.capacity_gb:.1f} GiB available (activations"
            f" {activations:.1f} GiB): the leanest layout without context parallelism"
        )
    slower = (plain.time.total_s / best.time.total_s - 1) * 100
    return (
        f"fits, but predicted {slower:.1f}% slower ({plain.time.total_s:.3g} s vs {best.time.total_s:.3g} s"
        " per step): the fastest layout without context parallelism"
    )


def _bytes_text(size: float) -> str:
    for scale, unit in ((1e12, "TB"), (1e9, "GB"), (1e6, "MB"), (1e3, "kB")):
        if size >= scale:
            return f"{size / scale:.3g} {unit}"
    return f"{size:.3g} bytes"


def exchange_note(chosen: Evaluated, model: ModelShape, device: Device, hardware: Hardware) -> str:
    """What the CP exchange sends per rank and step, over which link, and how much of it the step waits for."""
    lay = chosen.layout
    sent = communication_bytes_per_rank(lay, model, act_bytes=device.act_bytes)["cp_exchange"]
    link = cp_link(hardware, device, lay.tp, lay.cp)
    exposed = chosen.time.breakdown_s["cp_comm"]
    how = (
        "all-to-alls of q, k, v and the attention output, waited for"
        if lay.cp_mode == "ulysses"
        else "K, V (and dK, dV) around the ring, each step under the attention of the chunk already there"
    )
    return (
        f"context parallel exchange: {_bytes_text(sent)} sent per rank and step over {link.kind} ({how});"
        f" {exposed:.3g} s of it not hidden"
    )


def why_note(best: Evaluated, plain: Evaluated, seq_len: int) -> str:
    """Why the plan splits sequences: without CP nothing fits, or the best layout without it is slower."""
    lay = best.layout
    head = (
        f"context parallel cp={lay.cp} ({lay.cp_mode}): each rank holds {seq_len // lay.cp:,} of a sequence's"
        f" {seq_len:,} tokens; "
    )
    if not plain.feasible:
        mem = plain.memory
        return head + (
            f"without CP no layout fits: the leanest, {plain.layout.describe()}, needs {mem.total_gb:.1f} GiB per"
            f" GPU > {mem.capacity_gb:.1f} GiB (activations {mem.breakdown_gb.get('activations', 0.0):.1f} GiB)"
        )
    slower = (plain.time.total_s / best.time.total_s - 1) * 100
    return head + (
        f"the fastest layout without CP, {plain.layout.describe()}, is predicted {slower:.1f}% slower"
        f" ({plain.time.total_s:.3g} s vs {best.time.total_s:.3g} s per step, {plain.memory.total_gb:.1f} GiB)"
    )
