"""Catch replicated parameters drifting apart across ranks.

Every TP rank holds its own copy of the LayerNorms (the embedding LayerNorm included) and of the row-parallel
biases. They receive the same gradients and the same updates, so they should stay bit-identical; BLOOM-176B
found out weeks late that its bf16 LayerNorm weights had not (different reduction orders on different ranks).
The trainer calls ``check_replicated_parameters`` every N steps and stops the run when it raises.

Cost: one all-gather of two int64 checksums per parameter. Only parameters whose checksums disagree are
gathered in full, to name the ranks and the size of the difference.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from appliance.parallel.tensor.layers import is_tensor_parallel
from appliance.parallel.tensor.mappings import Group, group_size

# Position weights for the second checksum, so that values swapped between elements also change it.
# A prime period keeps the weights from lining up with power-of-two shapes.
_WEIGHT_PERIOD = 65521

_BITS_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def replicated_across_tp(named_params: Iterable[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
    """The parameters every TP rank must hold identically: all those not split by a tensor-parallel layer."""
    return [(name, p) for name, p in named_params if not is_tensor_parallel(p)]


@dataclass(frozen=True)
class Drift:
    name: str
    ranks: list[int]  # group ranks that disagree with the reference copy
    global_ranks: list[int]
    reference_rank: int  # group rank holding the copy most ranks agree on
    max_abs_diff: float
    elements_differing: int
    numel: int

    def describe(self) -> str:
        return (
            f"{self.name}: ranks {self.ranks} (global {self.global_ranks}) differ from rank {self.reference_rank}, "
            f"max |diff| {self.max_abs_diff:.3e} in {self.elements_differing} of {self.numel} elements"
        )


class ReplicaDriftError(RuntimeError):
    """Parameters that must be identical across ranks are not. Raised on every rank of the group alike."""

    def __init__(self, drifts: list[Drift]) -> None:
        self.drifts = drifts
        lines = "\n  ".join(d.describe() for d in drifts)
        super().__init__(f"{len(drifts)} replicated parameter(s) drifted apart across ranks:\n  {lines}")


def _checksums(tensor: torch.Tensor) -> torch.Tensor:
    """Two int64 sums of the raw bits: plain and position-weighted. Any one-bit change moves the first."""
    flat = tensor.detach().contiguous().reshape(-1)
    if flat.is_floating_point() or flat.is_complex():
        flat = flat.view(_BITS_VIEW[flat.element_size()])
    bits = flat.to(torch.int64)
    weights = torch.arange(bits.numel(), device=bits.device, dtype=torch.int64) % _WEIGHT_PERIOD + 1
    # int64 sums wrap around on overflow, which is fine for a checksum.
    return torch.stack([bits.sum(), (bits * weights).sum()])


def _compare_in_full(
    name: str, tensor: torch.Tensor, reference: int, group: Group, rtol: float, atol: float
) -> Drift | None:
    size = group_size(group)
    local = tensor.detach().contiguous()
    copies = [torch.empty_like(local) for _ in range(size)]
    dist.all_gather(copies, local, group=group)
    ref = copies[reference].double()
    offenders, max_diff, differing = [], 0.0, 0
    for rank, copy in enumerate(copies):
        if rank == reference:
            continue
        other = copy.double()
        same = (
            torch.equal(copy, copies[reference]) if rtol == 0 and atol == 0 else torch.allclose(other, ref, rtol, atol)
        )
        if same:
            continue
        offenders.append(rank)
        diff = (other - ref).abs()
        max_diff = max(max_diff, float(diff.nan_to_num(nan=float("inf")).max()))
        differing = max(differing, int((copy != copies[reference]).sum()))
    if not offenders:
        return None
    global_ranks = [dist.get_global_rank(group, r) if group is not None else r for r in offenders]
    return Drift(name, offenders, global_ranks, reference, max_diff, differing, local.numel())


def check_replicated_parameters(
    named_params: Iterable[tuple[str, torch.Tensor]],
    group: Group,
    *,
    rtol: float = 0.0,
    atol: float = 0.0,
) -> list[str]:
    """Check that every given parameter is the same on all ranks of ``group``; collective over the group.

    Pass only parameters that must be replicated over the group: for the TP group,
    ``replicated_across_tp(model.named_parameters())``; for the DP group, all of them. With the default
    tolerances the copies must be exactly equal. Returns the names checked; raises ``ReplicaDriftError``,
    naming each parameter, the ranks that differ and by how much, on every rank of the group.
    """
    params = list(named_params)
    if group_size(group) == 1 or not params:
        return [name for name, _ in params]
    device = params[0][1].device
    local = torch.stack([_checksums(p).to(device) for _, p in params])  # [n_params, 2]
    gathered = [torch.empty_like(local) for _ in range(group_size(group))]
    dist.all_gather(gathered, local, group=group)
    sums = torch.stack(gathered)  # [ranks, n_params, 2], the same on every rank
    drifts = []
    for index, (name, param) in enumerate(params):
        per_rank = [tuple(row.tolist()) for row in sums[:, index]]
        if len(set(per_rank)) == 1:
            continue
        # The copy most ranks hold is the reference (ties: the lowest rank), so with tp >= 3 the odd one out
        # is named. Every rank computes the same reference from the same gathered sums.
        reference = max(range(len(per_rank)), key=lambda r: (per_rank.count(per_rank[r]), -r))
        drift = _compare_in_full(name, param, reference, group, rtol, atol)
        if drift is not None:
            drifts.append(drift)
    if drifts:
        raise ReplicaDriftError(drifts)
    return [name for name, _ in params]
