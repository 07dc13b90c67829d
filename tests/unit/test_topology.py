"""Rank arithmetic of ParallelTopology, checked without spawning any process."""

from __future__ import annotations

import itertools

import pytest

from appliance.errors import BadInput
from appliance.parallel.topology import GROUPS, ParallelTopology, RankCoords

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


# ---- named axes beyond (pp, dp, tp): context parallel (cp) and expert parallel (ep, folded inside dp) ----

# (tp, pp, dp, cp, ep): cp > 1 and ep > 1 alone and together, with every other axis at 1 and above it.
NAMED_LAYOUTS = [
    (1, 1, 1, 2, 1),
    (2, 1, 2, 2, 1),
    (2, 2, 1, 3, 1),
    (1, 1, 4, 1, 2),
    (2, 2, 4, 1, 4),
    (2, 2, 4, 2, 2),
    (1, 3, 6, 2, 3),
]


def make_named(tp: int, pp: int, dp: int, cp: int, ep: int) -> ParallelTopology:
    return ParallelTopology(tp=tp, pp=pp, dp=dp, cp=cp, ep=ep, world_size=tp * pp * dp * cp)


def test_axes_are_ordered_data() -> None:
    topology = make_named(2, 3, 4, 5, 2)
    assert topology.axes == (("pp", 3), ("dp", 4), ("cp", 5), ("tp", 2))
    assert make(2, 1, 2).axes == (("pp", 1), ("dp", 2), ("cp", 1), ("tp", 2))  # cp is there at size 1


@pytest.mark.parametrize(("tp", "pp", "dp", "cp", "ep"), NAMED_LAYOUTS)
def test_rank_order_is_tp_cp_dp_pp_and_coordinates_round_trip(tp: int, pp: int, dp: int, cp: int, ep: int) -> None:
    topology = make_named(tp, pp, dp, cp, ep)
    for rank in range(topology.world_size):
        found = topology.coordinates(rank)
        p, d, c, t = found["pp"], found["dp"], found["cp"], found["tp"]
        assert rank == ((p * dp + d) * cp + c) * tp + t  # Megatron-Core's tp-cp-dp-pp, innermost first
        assert topology.global_rank(pp=p, dp=d, cp=c, tp=t) == rank
        assert (found["edp"], found["ep"]) == divmod(d, ep)  # ep ranks are consecutive dp ranks
        assert topology.coords(rank) == RankCoords(pp=p, dp=d, tp=t)
        assert topology.cp_rank(rank) == c
        assert topology.rank_with(rank, pp=pp - 1 - p) == topology.global_rank(pp=pp - 1 - p, dp=d, cp=c, tp=t)


@pytest.mark.parametrize(("tp", "pp", "dp", "cp", "ep"), NAMED_LAYOUTS)
def test_every_group_matches_an_independent_row_major_grid(tp: int, pp: int, dp: int, cp: int, ep: int) -> None:
    # DeepSpeed's generic ProcessTopology (any axis names, row-major) is the reference: the grid is (pp, dp, cp, tp),
    # or (pp, edp, ep, cp, tp) with dp split for the expert groups.
    from deepspeed.runtime.pipe.topology import ProcessTopology

    topology = make_named(tp, pp, dp, cp, ep)
    plain = ProcessTopology(axes=["pp", "dp", "cp", "tp"], dims=[pp, dp, cp, tp])
    expert = ProcessTopology(axes=["pp", "edp", "ep", "cp", "tp"], dims=[pp, dp // ep, ep, cp, tp])
    for rank in range(topology.world_size):
        assert topology.coordinates(rank) == {**plain.get_coord(rank)._asdict(), **expert.get_coord(rank)._asdict()}
    for axis in ("pp", "dp", "cp", "tp"):
        assert topology.groups(axis) == plain.get_axis_comm_lists(axis), axis
    for axis in ("ep", "edp"):
        assert topology.groups(axis) == expert.get_axis_comm_lists(axis), axis


@pytest.mark.parametrize(("tp", "pp", "dp", "cp", "ep"), [*NAMED_LAYOUTS, (2, 2, 2, 1, 1)])
def test_each_group_varies_its_axes_and_fixes_the_others(tp: int, pp: int, dp: int, cp: int, ep: int) -> None:
    topology = make_named(tp, pp, dp, cp, ep)
    world = list(range(topology.world_size))
    varies = {
        "tp": {"tp"},
        "dp": {"dp", "edp", "ep"},
        "pp": {"pp"},
        "mp": {"pp", "tp"},
        "cp": {"cp"},
        "dp_cp": {"dp", "edp", "ep", "cp"},
        "ep": {"ep", "dp"},
        "edp": {"edp", "dp"},
        "edp_cp": {"edp", "dp", "cp"},
        "tp_row": {"tp", "mesh_col"},
        "tp_col": {"tp", "mesh_row"},
    }
    assert set(varies) == set(GROUPS)
    for name, moving in varies.items():
        lists = topology.groups(name)
        assert sorted(r for ranks in lists for r in ranks) == world, name  # a partition of the world
        assert all(len(ranks) == topology.size(name) for ranks in lists), name
        for ranks in lists:
            assert ranks == sorted(ranks), name
            seen = [topology.coordinates(r) for r in ranks]
            for axis in seen[0]:
                if axis not in moving:
                    assert len({c[axis] for c in seen}) == 1, (name, axis)
    assert topology.size("dp_cp") == dp * cp and topology.size("mp") == tp * pp
    assert topology.size("ep") == ep and topology.size("edp") == dp // ep


@pytest.mark.parametrize(("tp", "pp", "dp", "cp", "ep"), NAMED_LAYOUTS)
def test_deepspeed_data_axis_is_dp_times_cp(tp: int, pp: int, dp: int, cp: int, ep: int) -> None:
    topology = make_named(tp, pp, dp, cp, ep)
    reference = topology.to_deepspeed()
    assert (reference.get_dim("pipe"), reference.get_dim("data"), reference.get_dim("model")) == (pp, dp * cp, tp)
    for rank in range(topology.world_size):
        coord, found = reference.get_coord(rank), topology.coordinates(rank)
        assert (coord.pipe, coord.data, coord.model) == (found["pp"], found["dp"] * cp + found["cp"], found["tp"])
    assert topology.groups("dp_cp") == reference.get_axis_comm_lists("data")
    assert topology.groups("tp") == reference.get_axis_comm_lists("model")
    assert topology.groups("pp") == reference.get_axis_comm_lists("pipe")


def test_size_one_axes_leave_the_three_axis_groups_alone() -> None:
    topology = make(2, 2, 2)
    assert topology.groups("dp_cp") == topology.groups("dp") == topology.groups("edp")
    assert topology.groups("cp") == topology.groups("ep") == [[r] for r in range(8)]


def test_errors_name_every_factor_with_cp() -> None:
    with pytest.raises(BadInput) as error:
        ParallelTopology(tp=4, pp=2, dp=2, cp=2, world_size=16)
    assert "tp(4) * pp(2) * dp(2) * cp(2) = 32 != world size 16" in str(error.value)
    with pytest.raises(BadInput, match=r"dp\(6\) % ep\(4\) != 0"):
        ParallelTopology(tp=1, pp=1, dp=6, ep=4, world_size=6)
    for bad in ("cp", "ep"):
        with pytest.raises(BadInput, match=f"{bad} must be a positive integer"):
            ParallelTopology(tp=1, pp=1, dp=1, world_size=1, **{bad: 0})


def test_coordinates_name_every_axis_above_one() -> None:
    topology = make_named(2, 1, 2, 2, 1)
    with pytest.raises(ValueError, match=r"missing axes \['cp'\]"):
        topology.global_rank(dp=0, tp=0)  # a caller written for three axes is stopped once cp > 1
    with pytest.raises(ValueError, match=r"unknown axes \['ep'\]"):
        topology.global_rank(dp=0, cp=0, tp=0, ep=0)
    with pytest.raises(ValueError, match="unknown group"):
        topology.groups("sp")
