"""The process groups ParallelTopology creates hold exactly the ranks its arithmetic says (one spawn, 4 ranks)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from appliance.errors import BadInput
from appliance.parallel.step.grads import TopologyMPU
from appliance.parallel.testing import run_distributed
from appliance.parallel.topology import GROUPS, ParallelTopology

pytestmark = pytest.mark.distributed

# Every way to lay 4 ranks out over (tp, pp, dp) with degrees of 1, 2 or 4, then (tp, pp, dp, cp, ep) layouts with
# context parallel and expert parallel (folded inside dp) above 1.
LAYOUTS = [(4, 1, 1), (1, 4, 1), (1, 1, 4), (2, 2, 1), (2, 1, 2), (1, 2, 2)]
NAMED_LAYOUTS = [(2, 1, 1, 2, 1), (1, 1, 2, 2, 1), (1, 2, 1, 2, 1), (1, 1, 4, 1, 2), (1, 1, 2, 2, 2), (1, 1, 4, 1, 4)]


def _key(layout: ParallelTopology) -> str:
    return f"{layout.tp},{layout.pp},{layout.dp},{layout.cp},{layout.ep}"


def _membership(topology: ParallelTopology) -> dict[str, dict[str, object]]:
    """For each layout: this rank's group members as torch reports them, and the sum of ranks all-reduced in
    each group (a wrong or half-built group gives a wrong sum or hangs); what DeepSpeed's mpu answers; and which
    groups share one handle (an axis of size 1 must create no group of its own)."""
    me = dist.get_rank()
    seen: dict[str, dict[str, object]] = {}
    # The layout the helper built, then more layouts over the same world: each builds all its groups once.
    layouts = [topology] + [ParallelTopology(tp=t, pp=p, dp=d, world_size=4) for t, p, d in LAYOUTS]
    layouts += [ParallelTopology(tp=t, pp=p, dp=d, cp=c, ep=e, world_size=4) for t, p, d, c, e in NAMED_LAYOUTS]
    for layout in layouts:
        layout.init_process_groups()
        layout.init_process_groups()  # a second call creates nothing (it would hang or mismatch otherwise)
        entry: dict[str, object] = {}
        for axis in GROUPS:
            group = layout.group(axis)
            total = torch.tensor([me])
            dist.all_reduce(total, group=group)
            entry[axis] = (dist.get_process_group_ranks(group), int(total))
        mpu = TopologyMPU(layout)
        entry["mpu data"] = (mpu.get_data_parallel_rank(), mpu.get_data_parallel_world_size())
        entry["shared"] = sorted((a, b) for a in GROUPS for b in GROUPS if a < b and layout.group(a) is layout.group(b))
        seen[_key(layout)] = entry
    return seen


def _groups_and_bad_world(topology: ParallelTopology) -> tuple[dict[str, dict[str, object]], str]:
    seen = _membership(topology)
    try:  # a layout for 8 ranks in a world of 4 fails on every rank before creating any group
        ParallelTopology(tp=2, pp=2, dp=2, world_size=8).init_process_groups()
    except BadInput as error:
        return seen, str(error)
    return seen, "no error"


def test_process_groups_match_rank_arithmetic() -> None:
    results = run_distributed(_groups_and_bad_world, 4, tp=2, dp=2, timeout_s=120)
    for rank, (per_layout, bad_world) in enumerate(results):
        assert "tp(2) * pp(2) * dp(2) = 8 != launched world size 4" in bad_world, f"rank {rank}"
        assert set(per_layout) == {"2,1,2,1,1"} | {f"{t},{p},{d},1,1" for t, p, d in LAYOUTS} | {
            ",".join(map(str, layout)) for layout in NAMED_LAYOUTS
        }
        for key, groups in per_layout.items():
            tp, pp, dp, cp, ep = map(int, key.split(","))
            expected = ParallelTopology(tp=tp, pp=pp, dp=dp, cp=cp, ep=ep, world_size=4)
            for axis in GROUPS:
                members, total = groups[axis]
                want = expected.group_ranks(axis, rank)
                assert sorted(members) == want, f"layout {key} rank {rank} {axis}"
                assert total == sum(want), f"layout {key} rank {rank} {axis}"
            # DeepSpeed's data-parallel rank is the position inside dp x cp (dp and cp adjacent in the rank order).
            found = expected.coordinates(rank)
            assert groups["mpu data"] == (found["dp"] * cp + found["cp"], dp * cp), f"layout {key} rank {rank}"
            # Groups with the same ranks share one handle: every group of one rank (an axis of size 1) is the same
            # local group, and dp_cp is the dp group itself while cp = 1.
            same = {(a, b) for a in GROUPS for b in GROUPS if a < b and expected.groups(a) == expected.groups(b)}
            assert set(map(tuple, groups["shared"])) == same, f"layout {key} rank {rank}"
            if cp == 1:
                assert ("dp", "dp_cp") in same
