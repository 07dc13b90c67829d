"""The process groups ParallelTopology creates hold exactly the ranks its arithmetic says (one spawn, 4 ranks)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from appliance.errors import BadInput
from appliance.parallel.testing import run_distributed
from appliance.parallel.topology import ParallelTopology

pytestmark = pytest.mark.distributed

# Every way to lay 4 ranks out over (tp, pp, dp) with degrees of 1, 2 or 4.
LAYOUTS = [(4, 1, 1), (1, 4, 1), (1, 1, 4), (2, 2, 1), (2, 1, 2), (1, 2, 2)]


def _membership(topology: ParallelTopology) -> dict[str, dict[str, object]]:
    """For each layout: this rank's group members as torch reports them, and the sum of ranks all-reduced in
    each group (a wrong or half-built group gives a wrong sum or hangs)."""
    me = dist.get_rank()
    seen: dict[str, dict[str, object]] = {}
    # The layout the helper built, then more layouts over the same world: each builds all its groups once.
    layouts = [topology] + [ParallelTopology(tp=t, pp=p, dp=d, world_size=4) for t, p, d in LAYOUTS]
    for layout in layouts:
        layout.init_process_groups()
        layout.init_process_groups()  # a second call creates nothing (it would hang or mismatch otherwise)
        entry: dict[str, object] = {}
        for axis in ("tp", "dp", "pp", "mp"):
            group = getattr(layout, f"{axis}_group")
            total = torch.tensor([me])
            dist.all_reduce(total, group=group)
            entry[axis] = (dist.get_process_group_ranks(group), int(total))
        seen[f"{layout.tp},{layout.pp},{layout.dp}"] = entry
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
        for key, groups in per_layout.items():
            tp, pp, dp = map(int, key.split(","))
            expected = ParallelTopology(tp=tp, pp=pp, dp=dp, world_size=4)
            for axis, (members, total) in groups.items():
                want = expected.group_ranks(axis, rank)
                assert sorted(members) == want, f"layout {key} rank {rank} {axis}"
                assert total == sum(want), f"layout {key} rank {rank} {axis}"
