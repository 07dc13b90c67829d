"""Standby spares and silent nodes without launching: the node beats and who counts as silent, the peer watch that
stops a node's ranks when a peer falls silent, and the standby's decisions (who stands by, who takes a lost node's
place, when a run grows back, when it is over). The launches themselves: tests/distributed/test_hot_spares.py."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from appliance.errors import BadInput
from appliance.rundir import RunDir
from appliance.train.launch import agent_command
from appliance.train.node_beats import (
    ENDED,
    STANDBY,
    TRAINING,
    BeatWatch,
    BeatWriter,
    Timings,
    claims,
    create_exclusive,
    declare_lost,
    lost_markers,
    timings,
)
from appliance.train.nodes import NodeGroup
from appliance.train.peer_watch import EXIT_REPLACED, PeerWatch, was_aborted
from appliance.train.restart_budget import AGENT_RESTARTS
from appliance.train.standby import GONE, OVER, TAKE_OVER, Standby, node_role

TIMINGS = Timings(beat_s=1.0, silent_s=3.0)
HOST = socket.gethostname()


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _group(rank: int, nnodes: int = 2, spares: int = 3) -> NodeGroup:
    return NodeGroup(nnodes=nnodes, node_rank=rank, master_host="127.0.0.1", master_port=29500, spares=spares)


def _age(run_dir: RunDir) -> None:
    """Every beat file as an earlier launch would have left it: written long ago."""
    for path in (run_dir.control / "node-beats").glob("*.json"):
        record = json.loads(path.read_text())
        path.write_text(json.dumps(record | {"t": record["t"] - 100}))


def _name(rank: int) -> str:
    return f"{HOST}/node{rank}"


def test_timings_default_and_from_the_environment() -> None:
    assert timings({}) == Timings(2.0, 10.0)
    assert timings({"BLOOM_NODE_BEAT": "beat_s=0.5,silent_s=3"}) == Timings(0.5, 3.0)
    for bad in ("beat_s", "beat=1", "silent_s=-1", "beat_s=2,silent_s=3"):  # the last: silence within two beats
        with pytest.raises(BadInput, match="BLOOM_NODE_BEAT"):
            timings({"BLOOM_NODE_BEAT": bad})


def test_a_node_is_silent_only_once_seen_beating_and_then_quiet_for_the_timeout(tmp_path: Path) -> None:
    run_dir = RunDir(tmp_path).make()
    BeatWriter(run_dir, "h/old", 5, TRAINING).beat()
    _age(run_dir)  # a file an earlier launch left: never seen to change, never silent
    node = BeatWriter(run_dir, "h/node1", 1, TRAINING)
    node.beat()
    clock = Clock()
    watch = BeatWatch(run_dir, TIMINGS.silent_s, clock=clock)
    watch.poll()
    node.beat()
    clock.now += 1
    watch.poll()
    assert [b.node for b in watch.alive(TRAINING)] == ["h/node1"] and watch.silent(TRAINING) == []
    clock.now += 3.5  # no beat since
    watch.poll()
    assert [b.node for b in watch.silent(TRAINING)] == ["h/node1"] and watch.alive(TRAINING) == []
    # One declaration per silence, whoever sees it: the first watcher's.
    beat = watch.silent(TRAINING)[0]
    record = declare_lost(run_dir, watch, beat, by="h/node0")
    assert record is not None and record["silent_s"] == pytest.approx(3.5) and record["node"] == "h/node1"
    assert declare_lost(run_dir, watch, beat, by="h/node2") is None
    assert list(lost_markers(run_dir).values()) == [record]
    # The node's own clock vouches for a beat this watcher has not seen change yet; an ended node is not training.
    fresh = BeatWatch(run_dir, TIMINGS.silent_s)
    node.beat()
    fresh.poll()
    assert [b.node for b in fresh.alive(TRAINING)] == ["h/node1"]
    node.beat(ENDED)
    fresh.poll()
    assert fresh.alive(TRAINING) == [] and [b.node for b in fresh.alive(ENDED)] == ["h/node1"]


def test_one_claim_per_place(tmp_path: Path) -> None:
    run_dir = RunDir(tmp_path).make()
    place = run_dir.control / "node-beats" / "claims" / "h_node1@x.json"
    assert create_exclusive(place, {"spare": "h/node2"})
    assert not create_exclusive(place, {"spare": "h/node3"})
    assert claims(run_dir) == {"h_node1@x.json": {"spare": "h/node2"}}


def test_the_peer_watch_stops_the_ranks_that_shared_a_silent_peers_world(tmp_path: Path) -> None:
    run_dir = RunDir(tmp_path).make()
    clock = Clock()
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    left: list[int] = []
    try:
        watch = PeerWatch(run_dir, "h/node0", 0, TIMINGS, leave=left.append)
        watch.watch.clock = clock
        watch.start()
        watch._beating.stop()  # ticks by hand, on the fake clock
        peer = BeatWriter(run_dir, "h/node1", 1, TRAINING)
        peer.beat()
        watch.tick()  # this process's child (a rank) first seen now, while the peer beats
        peer.beat()
        clock.now += 1
        watch.tick()
        assert sleeper.poll() is None
        clock.now += 4  # the peer falls silent
        watch.tick()
        assert sleeper.wait(timeout=10) == -9 and was_aborted(run_dir, "h/node0", sleeper.pid)
        failures = [json.loads(line) for line in run_dir.metrics.read_text().splitlines()]
        assert [(e["kind"], e["rank"], e["node"], e["detected_by"]) for e in failures] == [
            ("failure", None, "h/node1", "h/node0")
        ]
        # This node declared lost in turn (frozen, then back): it leaves, for its launcher to stand by.
        create_exclusive(
            run_dir.control / "node-beats" / "lost" / "mine.json",
            {"node": "h/node0", "incarnation": watch.incarnation, "role": TRAINING},
        )
        watch.tick()
        assert left == [EXIT_REPLACED]
        # Node 0 never leaves: its launcher holds the run directory and never stands by.
        head = PeerWatch(run_dir, "h/node0", 0, TIMINGS, may_leave=False, leave=left.append).start()
        head._beating.stop()
        create_exclusive(
            run_dir.control / "node-beats" / "lost" / "head.json",
            {"node": "h/node0", "incarnation": head.incarnation, "role": TRAINING},
        )
        head.tick()
        assert left == [EXIT_REPLACED]
    finally:
        sleeper.kill()
        sleeper.wait()


def test_an_elastic_nodes_agent_beats_for_it_with_a_budget_it_cannot_reach(tmp_path: Path) -> None:
    cmd = agent_command(
        tmp_path, nproc_per_node=1, max_restarts=AGENT_RESTARTS, nnodes="1:2", rdzv_endpoint="127.0.0.1:1", node_rank=3
    )
    assert cmd[3:6] == ["--node-watch", str(tmp_path), "3"] and f"--max-restarts={AGENT_RESTARTS}" in cmd
    assert "--node-watch" not in agent_command(tmp_path, nproc_per_node=1, max_restarts=0)


def test_who_stands_by(tmp_path: Path) -> None:
    run_dir = RunDir(tmp_path).make()
    no_wait = {"sleep": lambda s: None}
    assert node_role(run_dir, _group(2), TIMINGS, **no_wait) == STANDBY  # a spare the user named
    assert node_role(run_dir, _group(0), TIMINGS, **no_wait) == TRAINING  # node 0 never stands by
    assert node_role(run_dir, _group(1), TIMINGS, **no_wait) == TRAINING  # no run yet
    (run_dir.control / "nodes.json").write_text(json.dumps({"nodes": [_name(0), _name(2)]}))
    writers = [BeatWriter(run_dir, _name(r), r, TRAINING) for r in (0, 2)]
    for w in writers:
        w.beat()
    # Node 1 back to a run that trains on nodes 0 and 2, both beating: it stands by.
    assert node_role(run_dir, _group(1), TIMINGS, sleep=lambda s: [w.beat() for w in writers]) == STANDBY
    # A run whose nodes do not beat (a relaunch: the last launch's beats), or one that lists this node: it trains.
    _age(run_dir)
    assert node_role(run_dir, _group(1), TIMINGS, **no_wait) == TRAINING
    writers[0].beat()
    writers[1].beat()
    (run_dir.control / "nodes.json").write_text(json.dumps({"nodes": [_name(0), _name(1)]}))
    assert node_role(run_dir, _group(1), TIMINGS, **no_wait) == TRAINING


def _standby(run_dir: RunDir, rank: int, clock: Clock) -> Standby:
    standby = Standby(run_dir, _group(rank), TIMINGS)
    standby.watch.clock = clock
    standby.writer.beat()
    standby.watch.poll()
    return standby


def test_the_first_spare_in_line_takes_a_lost_nodes_place_and_the_next_one_only_if_it_does_not(tmp_path: Path) -> None:
    run_dir = RunDir(tmp_path).make()
    (run_dir.control / "nodes.json").write_text(json.dumps({"nodes": [_name(0), _name(1)], "t": 1.0}))
    clock = Clock()
    first, second = _standby(run_dir, 2, clock), _standby(run_dir, 3, clock)

    def beats(seconds: float) -> None:
        clock.now += seconds
        first.writer.beat()
        second.writer.beat()

    beats(0.5)
    assert first.step() is None and second.step() is None
    lost = {"node": _name(1), "incarnation": "x", "role": TRAINING, "silent_s": 3.1}
    create_exclusive(run_dir.control / "node-beats" / "lost" / "node1@x.json", lost)
    assert second.step() is None  # not first in line: it leaves the place to node 2 for a few beats
    assert first.step() == TAKE_OVER
    assert claims(run_dir)["node1@x.json"]["spare"] == _name(2)
    beats(5.0)
    assert second.step() is None  # claimed already
    taking = [json.loads(line) for line in run_dir.metrics.read_text().splitlines()]
    assert [(e["change"], e["node"], e["replaces"]) for e in taking] == [("taking_over", _name(2), _name(1))]
    # A place the first in line, beating but stuck, does not take: the next one takes it after the grace.
    create_exclusive(run_dir.control / "node-beats" / "lost" / "node0@y.json", lost | {"node": _name(0)})
    beats(0.5)
    assert second.step() is None
    beats(1.0)
    assert second.step() is None
    beats(2.5)
    assert second.step() == TAKE_OVER and claims(run_dir)["node0@y.json"]["spare"] == _name(3)
    # A silence declared before a standby watched is not its to take (an earlier launch's, or one the run re-formed
    # around already): the run grows back after a save instead.
    create_exclusive(run_dir.control / "node-beats" / "lost" / "node1@z.json", lost | {"incarnation": "z"})
    late = _standby(run_dir, 4, clock)
    late.old_markers = set(lost_markers(run_dir))
    assert late.step() is None


def test_a_standby_grows_a_stepped_down_run_back_after_the_next_save(tmp_path: Path) -> None:
    run_dir = RunDir(tmp_path).make()
    (run_dir.control / "nodes.json").write_text(json.dumps({"nodes": [_name(0)], "t": 5.0}))
    clock = Clock()
    standby = _standby(run_dir, 1, clock)
    trainer = BeatWriter(run_dir, _name(0), 0, TRAINING)
    trainer.beat()
    run_dir.metrics.write_text(json.dumps({"t": 1.0, "kind": "checkpoint", "step": 4}) + "\n")
    assert standby.step() is None and standby.step() is None  # waits past the save of step 4
    with run_dir.metrics.open("a") as f:
        f.write(json.dumps({"t": 2.0, "kind": "checkpoint", "step": 6}) + "\n")
    assert standby.step() == TAKE_OVER
    assert list(claims(run_dir)) == ["grow-5.0-0.json"]


def test_a_standby_leaves_when_the_run_is_over_or_gone(tmp_path: Path) -> None:
    run_dir = RunDir(tmp_path).make()
    clock = Clock()
    standby = _standby(run_dir, 2, clock)
    trainer = BeatWriter(run_dir, _name(0), 0, TRAINING)
    trainer.beat()
    assert standby.step() is None
    trainer.beat(ENDED)
    assert standby.step() == OVER
    gone = _standby(RunDir(tmp_path / "gone").make(), 2, clock)
    BeatWriter(gone.run_dir, _name(0), 0, TRAINING).beat()
    assert gone.step() is None
    clock.now += 3 * TIMINGS.silent_s + 1  # every training node silent that long: node 0 and its store lost
    assert gone.step() == GONE


def test_the_spare_book_counts_standbys_that_come_die_or_take_a_place(tmp_path: Path) -> None:
    from appliance.monitor.events import EventWriter
    from appliance.train.node_record import note_nodes, read_nodes
    from appliance.train.spare_book import SpareBook

    run_dir = RunDir(tmp_path).make()
    note_nodes(run_dir, ["h/node0", "h/node1"], "tp(1) * pp(1) * dp(2)")
    spare2, spare3 = BeatWriter(run_dir, "h/node2", 2, STANDBY), BeatWriter(run_dir, "h/node3", 3, STANDBY)
    spare2.beat()
    clock = Clock()
    with EventWriter(run_dir.metrics) as events:
        book = SpareBook(run_dir, events, TIMINGS, idle=lambda: [], by="h/node0")
        book.watch.clock = clock
        book.settled_at = clock.now + 2
        book.watch.poll()
        book.tick()
        assert book.standbys() == ["h/node2"]  # a start's own `nodes` event lists it: no change to report
        clock.now += 2
        spare2.beat()
        spare3.beat()  # a spare comes
        book.tick()
        clock.now += 2
        spare2.beat(TRAINING)  # node 2 takes a place: it leaves the spares, not lost
        book.tick()
        clock.now += 3.5  # node 3 stops beating
        book.tick()
        book.tick()
    changes = [json.loads(line) for line in run_dir.metrics.read_text().splitlines()]
    assert [(e["change"], e["node"], e["spares"]) for e in changes] == [
        ("spare_joined", "h/node3", ["h/node2", "h/node3"]),
        ("spare_lost", "h/node3", []),
    ]
    assert read_nodes(run_dir)["spares"] == []


def test_a_spare_that_died_between_two_starts_is_declared_as_the_next_start_begins(tmp_path: Path) -> None:
    from appliance.monitor.events import EventWriter
    from appliance.train.node_record import note_nodes
    from appliance.train.spare_book import SpareBook

    run_dir = RunDir(tmp_path).make()
    note_nodes(run_dir, ["h/node0", "h/node1"], "tp(1) * pp(1) * dp(2)")
    BeatWriter(run_dir, "h/node4", 4, STANDBY).beat()
    _age(run_dir)  # its last beat, long before this start
    with EventWriter(run_dir.metrics) as events:
        book = SpareBook(run_dir, events, TIMINGS, idle=lambda: [], by="h/node0", expected=["h/node4", "h/node9"])
        book.watch.poll()
        book.tick()
        book.tick()
    lost = [json.loads(line) for line in run_dir.metrics.read_text().splitlines()]
    assert [(e["change"], e["node"]) for e in lost] == [("spare_lost", "h/node4")]
    assert [m["silent_s"] > 90 for m in lost_markers(run_dir).values()] == [True]


def test_a_standing_by_node_checks_its_torch_in_a_process_of_its_own(tmp_path: Path) -> None:
    """The check imports torch, which the standby must not hold: its refusal comes back from the other process."""
    from appliance.train.launch import check_node_elsewhere

    run_dir = RunDir(tmp_path).make()
    run_dir.plan.write_text("{}")
    with pytest.raises(BadInput, match=r"plan\.json"):
        check_node_elsewhere(run_dir, 1)
