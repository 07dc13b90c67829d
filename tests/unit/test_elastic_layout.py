"""--nnodes MIN:MAX without launching: the layout for the ranks there are (shrink and grow back), the node record
that names lost and returned nodes, the flags, and the agents' rendezvous settings."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from appliance.errors import BadInput
from appliance.hardware import load_hardware
from appliance.planner import RunSpec, load_model_shape, make_plan, parse_layout
from appliance.planner.shrink import layout_for_world, usable_node_counts
from appliance.rundir import RunDir
from appliance.train.elastic import check_node_range, min_agents, placement, spec_for_world, training_nodes
from appliance.train.launch import agent_command
from appliance.train.node_beats import create_exclusive
from appliance.train.node_record import note_nodes, update_nodes
from appliance.train.nodes import NodeGroup, node_group, parse_nnodes
from appliance.train.nodes import main as nodes_main


def test_a_lost_node_keeps_the_global_batch_through_more_accumulation() -> None:
    plan = _spec("tp=1,pp=1,dp=3,mbs=1,gbs=6")
    shrunk = layout_for_world(plan, 2)
    assert (shrunk.tp, shrunk.pp, shrunk.dp, shrunk.global_batch_size) == (1, 1, 2, 6)
    assert (plan.layout.micro_batches, shrunk.micro_batches) == (2, 3)  # 6 = 1 x 3 x 2 = 1 x 2 x 3


def test_the_plans_world_again_is_the_plans_layout_grow_back() -> None:
    plan = _spec("tp=1,pp=1,dp=3,mbs=1,gbs=6")
    assert layout_for_world(plan, 3) is plan.layout
    shrunk = plan.with_layout(layout_for_world(plan, 2), plan.report.estimate)
    assert layout_for_world(shrunk, 3).dp == 3  # from the shrunk one too: dp refits both ways


def test_no_valid_layout_names_the_factors() -> None:
    with pytest.raises(BadInput, match=r"global batch\(6\) is not divisible by mbs\(1\) \* dp\(4\)"):
        layout_for_world(_spec("tp=1,pp=1,dp=3,mbs=1,gbs=6"), 4)
    tp2 = _spec("tp=2,pp=1,dp=3,mbs=1,gbs=6")
    with pytest.raises(BadInput, match=r"5 ranks cannot hold tp\(2\) \* pp\(1\) \* dp: .* 2 ranks of one model"):
        layout_for_world(tp2, 5)


def test_what_min_may_be_for_bloom_176b() -> None:
    # tp4 kept on 8-GPU nodes, gbs 2048 = mbs x dp x micro-batches: dp a power of two, pp whatever balances 70
    # blocks (+ 2 ends) over the rest, and a layout among them that fits 80 GB (tests/unit/test_step_down.py).
    # Not 6 nodes: one replica of the plan's pipeline, which no layout fits (dp1 keeps all of ZeRO's states).
    assert usable_node_counts(_bloom(), 48) == [9, 12, 14, 16, 18, 20, 24, 28, 32, 35, 36, 40, 48]


def test_the_node_record_names_lost_and_returned_nodes(tmp_path: Path) -> None:
    run_dir = RunDir(tmp_path).make()
    run_dir.metrics.write_text(json.dumps({"t": 100.0, "kind": "step", "step": 7}) + "\n{torn")
    three, two = ["h/node0", "h/node1", "h/node2"], ["h/node1", "h/node0"]
    assert note_nodes(run_dir, three, "tp(1) * pp(1) * dp(3)") is None  # the first start
    same = note_nodes(run_dir, three, "tp(1) * pp(1) * dp(3)")  # a restart on the same nodes
    assert same is not None and not same.resolve([]).changed
    lost = note_nodes(run_dir, two, "tp(1) * pp(1) * dp(2)")
    assert lost is not None and (lost.lost, lost.joined) == (["h/node2"], [])
    assert (lost.old_layout, lost.new_layout, lost.last_step, lost.last_step_time) == (
        "tp(1) * pp(1) * dp(3)",
        "tp(1) * pp(1) * dp(2)",
        7,
        100.0,
    )
    back = note_nodes(run_dir, three, "tp(1) * pp(1) * dp(3)")
    assert back is not None and (back.lost, back.joined) == ([], ["h/node2"])


def test_the_node_record_names_the_spare_that_took_over(tmp_path: Path) -> None:
    run_dir = RunDir(tmp_path).make()
    assert note_nodes(run_dir, ["h/node0", "h/node1"], "tp(1) * pp(1) * dp(2)") is None
    # Node 1 declared lost; the standby of node 2 claims its place (train/standby.py), and trains in the next start.
    claims = run_dir.control / "node-beats" / "claims"
    assert create_exclusive(claims / "h_node1@x.json", {"spare": "h/node2", "replaces": "h/node1"})
    assert not create_exclusive(claims / "h_node1@x.json", {"spare": "h/node3", "replaces": "h/node1"})  # taken
    change = note_nodes(run_dir, ["h/node0", "h/node2"], "tp(1) * pp(1) * dp(2)")
    assert change is not None
    took = change.resolve([])
    assert (took.lost, took.joined, took.took_over, took.changed) == (["h/node1"], [], ["h/node2"], True)
    # The claim was seen by that start: node 2 trains on in the next one, and took over nothing more.
    again = note_nodes(run_dir, ["h/node0", "h/node2"], "tp(1) * pp(1) * dp(2)")
    assert again is not None and again.took_over == [] and not again.resolve([]).changed
    # A node that joins without a claim (a grow-back) joined; an idle node of a step-down that trains took over.
    update_nodes(run_dir, idle=["h/node3"])
    grown = note_nodes(run_dir, ["h/node0", "h/node2", "h/node3", "h/node4"], "tp(1) * pp(1) * dp(4)")
    assert grown is not None and (grown.took_over, grown.joined) == (["h/node3"], ["h/node4"])


def test_placement_trains_the_plans_nodes_and_the_rest_stand_by() -> None:
    spec = _spec("tp=1,pp=1,dp=2,mbs=1,gbs=4")
    elastic = {"BLOOM_ELASTIC_NODES": "1:3", "LOCAL_WORLD_SIZE": "1"}
    # Three agents, two planned nodes: ranks 0 and 1 train, rank 2 is a spare.
    places = [placement(spec, elastic | {"WORLD_SIZE": "3", "RANK": str(r)}) for r in range(3)]
    assert [p.spare for p in places] == [False, False, True] and places[0].train_world == 2
    assert places[0].spare_nodes == 1
    # Two left: the plan's layout, no spare; one left: dp1 (gbs 4 = 1 x 4 x 1).
    assert placement(spec, elastic | {"WORLD_SIZE": "2", "RANK": "1"}).train_world == 2
    assert placement(spec, elastic | {"WORLD_SIZE": "1", "RANK": "0"}).train_world == 1
    # Not elastic: every rank trains (a world that does not fit the plan is named by the layout's check).
    assert placement(spec, {"WORLD_SIZE": "3", "RANK": "2", "LOCAL_WORLD_SIZE": "1"}).spare is False


def test_with_no_spare_left_the_largest_usable_count_below_trains() -> None:
    # BLOOM-176B: 47 nodes of 48 hold no layout; 40 of them train (tp4 pp10 dp8) and 7 stand by.
    usable = usable_node_counts(_bloom(), 48)
    assert [training_nodes(usable, 48, n) for n in (52, 48, 47, 24, 23, 9, 8)] == [48, 48, 40, 24, 20, 9, None]


def test_nnodes_min_max_flags(tmp_path: Path) -> None:
    assert parse_nnodes("3") == (None, 3) and parse_nnodes("2:3") == (2, 3) and parse_nnodes(None) == (None, None)
    for bad in ("2:", ":3", "two", "2:3:4"):
        with pytest.raises(BadInput, match="--nnodes"):
            parse_nnodes(bad)
    with pytest.raises(BadInput, match=r"--nnodes 4:3: MIN must be 1\.\.MAX"):
        NodeGroup(nnodes=3, node_rank=0, master_host="127.0.0.1", master_port=29500, min_nodes=4)
    group = node_group(nnodes=3, node_rank=1, master="127.0.0.1:29611", hostfile=None, min_nodes=2)
    assert group is not None and group.elastic and group.agent_nnodes == "2:3"
    hostfile = tmp_path / "hosts"
    hostfile.write_text("127.0.0.1\n192.0.2.2\n192.0.2.3\n")
    with pytest.raises(BadInput, match=r"--nnodes 2:4: --hostfile .* lists 3 hosts"):
        node_group(nnodes=4, node_rank=0, master=None, hostfile=hostfile, min_nodes=2)


def test_elastic_agents_get_min_max_and_short_keep_alives(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("BLOOM_RDZV_CONF", "last_call_timeout=1")
    cmd = agent_command(
        tmp_path,
        nproc_per_node=1,
        max_restarts=2,
        nnodes="2:3",
        rdzv_endpoint="127.0.0.1:1",
        store_hosted_elsewhere=True,
    )
    conf = next(c for c in cmd if c.startswith("--rdzv-conf="))
    assert "--nnodes=2:3" in cmd
    assert conf == "--rdzv-conf=is_host=false,keep_alive_interval=5,keep_alive_max_attempt=3,last_call_timeout=1"
    fixed = agent_command(tmp_path, nproc_per_node=1, max_restarts=0, nnodes=2, rdzv_endpoint="127.0.0.1:1")
    assert not any(c.startswith("--rdzv-conf") for c in fixed)  # a fixed node count keeps torch's settings


def _spec(layout: str) -> RunSpec:
    plan = make_plan(
        load_hardware("cpu-laptop-2core"), load_model_shape("bloom-micro-test"), layout=parse_layout(layout)
    )
    return plan.spec()


def _bloom() -> RunSpec:
    """BLOOM-176B's own layout (tp4 pp12 dp8, mbs 2, gbs 2048) on its 48 nodes."""
    hardware, model = load_hardware("jean-zay-a100-48n"), load_model_shape("bloom-176b")
    return make_plan(hardware, model, layout=parse_layout("tp=4,pp=12,dp=8,mbs=2,gbs=2048")).spec()


def test_only_elastic_launches_re_plan_and_min_must_hold_a_layout() -> None:
    spec = _spec("tp=1,pp=1,dp=3,mbs=1,gbs=6")
    elastic_env = {"BLOOM_ELASTIC_NODES": "2:3"}
    shrunk = spec_for_world(spec, 2, env=elastic_env)
    assert (shrunk.layout.dp, shrunk.train.global_batch_size, shrunk.layout.micro_batches) == (2, 6, 3)
    assert spec_for_world(spec, 2, env={}) is spec  # a fixed launch keeps the plan (its world check names the misfit)
    assert check_node_range(spec, 2, 3, "plan.json") == {}
    four = _spec("tp=1,pp=1,dp=4,mbs=1,gbs=8")
    # dp3 does not divide 8: on 3 nodes, 2 train and 1 stands by (warned of); MIN 3 is fine for the same reason.
    assert check_node_range(four, 2, 4, "plan.json") == {3: 2}
    assert check_node_range(four, 3, 4, "plan.json") == {3: 2}
    tp2 = _spec("tp=2,pp=1,dp=2,mbs=1,gbs=4")  # 4 ranks over 4 nodes: a replica is 2 nodes
    with pytest.raises(BadInput, match=r"--nnodes 1:4: 1 nodes x 1 ranks .* node counts that can: \[2, 4\]"):
        check_node_range(tp2, 1, 4, "plan.json")


def test_spares_flags(tmp_path: Path) -> None:
    group = node_group(nnodes=2, node_rank=2, master="127.0.0.1:29611", hostfile=None, spares=1)
    assert group is not None and group.elastic and (group.nnodes, group.total_nodes) == (2, 3)
    # The rendezvous holds the training nodes only: a spare joins it when it takes a lost node's place. MIN defaults
    # to the plan's smallest usable count at launch (min_agents).
    assert group.agent_nnodes == "2:2"
    with pytest.raises(BadInput, match=r"--node-rank 3: out of range for --nnodes 2 --spares 1 \(0\.\.2\)"):
        node_group(nnodes=2, node_rank=3, master="127.0.0.1:29611", hostfile=None, spares=1)
    with pytest.raises(BadInput, match=r"--spares 1: needs --nnodes and --master"):
        node_group(nnodes=None, node_rank=None, master=None, hostfile=None, spares=1)
    hostfile = tmp_path / "hosts"
    hostfile.write_text("127.0.0.1\n192.0.2.2\n192.0.2.3\n")  # the last line stands by
    listed = node_group(nnodes=None, node_rank=0, master=None, hostfile=hostfile, spares=1)
    assert listed is not None and (listed.nnodes, listed.spares) == (2, 1)
    with pytest.raises(BadInput, match=r"--nnodes 3 \+ --spares 1: --hostfile .* lists 3 hosts"):
        node_group(nnodes=3, node_rank=0, master=None, hostfile=hostfile, spares=1)
    spec = _spec("tp=1,pp=1,dp=2,mbs=1,gbs=4")
    assert min_agents(spec, listed) == 1  # dp1 still carries gbs 4: the run steps down to one node
    # --store-elsewhere: node 0 joins the store as every other node does, instead of hosting it.
    assert listed.hosts_store
    elsewhere = node_group(
        nnodes=2, node_rank=0, master="127.0.0.1:29611", hostfile=None, spares=1, store_elsewhere=True
    )
    assert elsewhere is not None and elsewhere.is_head and not elsewhere.hosts_store
    with pytest.raises(BadInput, match=r"--store-elsewhere: needs --nnodes and --master"):
        node_group(nnodes=None, node_rank=None, master=None, hostfile=None, store_elsewhere=True)
    with pytest.raises(SystemExit, match="usage"):
        nodes_main(["--host-store", "127.0.0.1:29611", "python"])  # a command comes after --
