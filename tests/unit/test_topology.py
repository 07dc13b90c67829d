"""Rank arithmetic of ParallelTopology, checked without spawning any process."""

from __future__ import annotations

import itertools

import pytest

from appliance.errors import BadInput
from appliance.parallel.topology import ParallelTopology, RankCoords

LAYOUTS = list(itertools.product((1, 2), repeat=3))  # every (tp, pp, dp) in (1|2)^3, world sizes 1 to 8


def make(tp: int, pp: int, dp: int) -> ParallelTopology:
    return ParallelTopology(tp=tp, pp=pp, dp=dp, world_size=tp * pp * dp)


@pytest.mark.parametrize(("tp", "pp", "dp"), LAYOUTS)
def test_rank_order_is_tp_then_dp_then_pp(tp: int, pp: int, dp: int) -> None:
    topology = make(tp, pp, dp)
    seen = []
    for p, d, t in itertools.product(range(pp), range(dp), range(tp)):
        rank = p * dp * tp + d * tp + t
        seen.append(rank)
        assert topology.global_rank(pp=p, dp=d, tp=t) == rank
        assert topology.coords(rank) == RankCoords(pp=p, dp=d, tp=t)
        assert (topology.tp_rank(rank), topology.dp_rank(rank), topology.pp_rank(rank)) == (t, d, p)
    assert sorted(seen) == list(range(tp * pp * dp))


@pytest.mark.parametrize(("tp", "pp", "dp"), LAYOUTS)
def test_groups_partition_the_world_along_each_axis(tp: int, pp: int, dp: int) -> None:
    topology = make(tp, pp, dp)
    world = list(range(topology.world_size))
    for axis, size, count in (("tp", tp, pp * dp), ("dp", dp, pp * tp), ("pp", pp, dp * tp), ("mp", tp * pp, dp)):
        groups = getattr(topology, f"{axis}_groups")()
        assert len(groups) == count and all(len(g) == size for g in groups), axis
        assert sorted(r for g in groups for r in g) == world, axis
    for rank in world:
        me = topology.coords(rank)
        # Each group varies exactly its own axis and holds the others fixed.
        assert [topology.coords(r).tp for r in topology.group_ranks("tp", rank)] == list(range(tp))
        assert {topology.coords(r)[:2] for r in topology.group_ranks("tp", rank)} == {(me.pp, me.dp)}
        assert {(topology.coords(r).pp, topology.coords(r).tp) for r in topology.group_ranks("dp", rank)} == {
            (me.pp, me.tp)
        }
        assert {topology.coords(r)[1:] for r in topology.group_ranks("pp", rank)} == {(me.dp, me.tp)}
        assert {topology.coords(r).dp for r in topology.group_ranks("mp", rank)} == {me.dp}
        # TP ranks are consecutive: they share a node.
        tp_ranks = topology.group_ranks("tp", rank)
        assert tp_ranks == list(range(tp_ranks[0], tp_ranks[0] + tp))


@pytest.mark.parametrize(("tp", "pp", "dp"), LAYOUTS)
def test_matches_deepspeed_pipe_model_data_topology(tp: int, pp: int, dp: int) -> None:
    topology = make(tp, pp, dp)
    reference = topology.to_deepspeed()
    assert reference.get_axis_names() == ["pipe", "data", "model"]
    for rank in range(topology.world_size):
        coord = reference.get_coord(rank)
        assert topology.coords(rank) == RankCoords(pp=coord.pipe, dp=coord.data, tp=coord.model)
    assert topology.tp_groups() == reference.get_axis_comm_lists("model")
    assert topology.dp_groups() == reference.get_axis_comm_lists("data")
    assert topology.pp_groups() == reference.get_axis_comm_lists("pipe")


def test_bloom_176b_layout() -> None:
    # 48 nodes x 8 A100: tp=4 inside half a node, pp=12 stages, dp=8 replicas.
    topology = ParallelTopology(tp=4, pp=12, dp=8, world_size=384)
    assert topology.group_ranks("tp", 0) == [0, 1, 2, 3]
    assert topology.group_ranks("dp", 0) == list(range(0, 32, 4))
    assert topology.group_ranks("pp", 0) == list(range(0, 384, 32))
    assert topology.group_ranks("mp", 5) == sorted(p * 32 + 4 + t for p in range(12) for t in range(4))
    assert topology.coords(383) == RankCoords(pp=11, dp=7, tp=3)
    topology.validate_heads(112)


def test_product_error_names_every_factor() -> None:
    with pytest.raises(BadInput) as error:
        ParallelTopology(tp=4, pp=12, dp=8, world_size=256)
    assert "tp(4) * pp(12) * dp(8) = 384 != world size 256" in str(error.value)


def test_heads_error_names_both_factors() -> None:
    with pytest.raises(BadInput) as error:
        ParallelTopology(tp=4, pp=1, dp=1, world_size=4).validate_heads(14)
    assert "heads(14) % tp(4) != 0" in str(error.value)


@pytest.mark.parametrize(("tp", "pp", "dp", "bad"), [(0, 1, 1, "tp"), (1, -2, 1, "pp"), (1, 1, 1.5, "dp")])
def test_degrees_must_be_positive_integers(tp: int, pp: int, dp: int, bad: str) -> None:
    with pytest.raises(BadInput, match=f"{bad} must be a positive integer"):
        ParallelTopology(tp=tp, pp=pp, dp=dp, world_size=1)


def test_coordinates_outside_the_grid_are_rejected() -> None:
    topology = make(2, 1, 2)
    with pytest.raises(ValueError, match="outside world size 4"):
        topology.coords(4)
    with pytest.raises(ValueError, match="outside"):
        topology.global_rank(pp=0, dp=2, tp=0)


def test_groups_need_init_first() -> None:
    with pytest.raises(RuntimeError, match="init_process_groups"):
        _ = make(2, 1, 1).tp_group
