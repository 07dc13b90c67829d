"""Standby spares and silent nodes, simulated on this machine: five `train --nnodes 2 --spares 3 --node-rank R
--store-elsewhere` commands on one run directory, one rank each, the rendezvous store in a process of its own (a
machine that does not train). The plan: tp1 pp1 dp2, global batch 4, micro-batch 1, STEPS steps, a blocking save every
2 steps, and the plan's own restart budget (3, the default). Node R's agent has the local address 127.0.0.(R+1), which
orders the rendezvous's ranks (the lower address, the lower rank), so each loss's victim is known in advance: its rank
freezes itself as the step after a save starts (the fault injector's `hang`, so the loss lands at a known step), and
the test then freezes or kills the rest of its node.

1. Nodes 0 and 1 train; nodes 2, 3 and 4, the spares the user named (node ranks N..N+K-1), stand by outside the
   rendezvous: launchers that hold no torch, DeepSpeed or numpy, each under 100 MB resident.
2. Node 1 freezes at step 3, its whole process tree SIGSTOPped: the other node's peer watch declares it lost within
   seconds, and node 2, first in line, takes its place at dp2 from step 2, within 60 s of the freeze.
3. Node 4's launcher is killed while the run re-forms: the next start declares its standby lost, and the spares'
   count drops. Node 1's command runs again once the new start's ranks have formed their world: the run is at full
   strength without it, so it stands by, and the training ranks go on to the next loss without a restart.
4. Node 0 freezes at step LOSSES[1] and is killed (the store lives elsewhere): node 1 takes its place. Node 2 freezes
   at LOSSES[2]: node 3 takes its place. Node 3 freezes at LOSSES[3]: no spare is left, and node 1 alone steps down to
   dp1 with the same global batch and finishes.
5. The three takeovers spend no restart and the step-down one: the default budget of 3 carries four losses (torch's
   agent, which counted every one, stopped such a run at its fourth).

What it shows: every step number is trained once and the losses follow an uninterrupted single-process run of the
same plan within the noise floor of those steps; each recovery event names the lost node, the spare that took over,
the layouts, the detection time and the restarts left; control/nodes.json and the `nodes` events say which nodes
train and which stand by; the end of the run waits for no spare.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from noise_floor import assert_within, measure_floor
from prepared_runs import cpu_only_env, events, prepare_run, reference_losses
from test_elastic_nodes import _descendants, _free_port, _kill_node

from appliance.monitor.summary import summarize
from appliance.planner.runspec import DEFAULT_MAX_RESTARTS
from appliance.rundir import RunDir

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

ROOT = Path(__file__).resolve().parents[2]
GBS = 4
LAYOUT = f"tp=1,pp=1,dp=2,mbs=1,gbs={GBS},zero=1,recompute=none"
# The step at whose start each victim's rank freezes: node 1, node 0, node 2, node 3. Each follows a save (every 2
# steps), so nothing is redone.
LOSSES = (3, 17, 19, 21)
# No save but the last falls in the run's last 5% (planner/cadence.py): the last loss's save must come before.
STEPS = 24
# One machine's timings: a node is silent after 3 s without a beat (production: 10 s, every 2 s), dead to the
# rendezvous after 1 s x 3 missed keep-alives, and a round closes 10 s after its fewest nodes joined: time for a
# spare's agent to start and join it (it imports torch: ~5 s on a loaded 2-core machine). Not shorter: see
# test_elastic_nodes.py.
RDZV_CONF = "keep_alive_interval=1,keep_alive_max_attempt=3,last_call_timeout=10,join_timeout=120"
NODE_BEAT = "beat_s=0.5,silent_s=3"
FREEZE_REPLACED_WITHIN_S = 60.0
STANDBY_MAX_RSS_MB = 100.0
# Two layouts of one training sum in other orders (noise_floor.py): within a few floors (test_3d_equivalence
# measures up to 3.6 x), so 10 x.
FACTOR = 10.0
# Each node's faults: its rank freezes at a step, on the attempt of its agent it will be on then (an agent counts the
# restarts of its own ranks: node 0's was restarted once by the first loss, node 2's once by the second).
FAULTS = {
    0: f"hang@step={LOSSES[1]}:rank=0:attempt=1",
    1: f"hang@step={LOSSES[0]}:rank=1",
    2: f"hang@step={LOSSES[2]}:rank=1:attempt=1",
    3: f"hang@step={LOSSES[3]}:rank=1",
}


def _node(rank: int) -> str:
    return f"{socket.gethostname()}/node{rank}"


class Nodes:
    """The five nodes' commands, and the store's."""

    def __init__(self, run_dir: RunDir) -> None:
        self.run_dir = run_dir
        self.port = _free_port()
        self.base = {k: v for k, v in cpu_only_env().items() if k != "BLOOM_FAULTS"}
        self.base |= {"BLOOM_RDZV_CONF": RDZV_CONF, "BLOOM_NODE_BEAT": NODE_BEAT}
        self.store = subprocess.Popen(
            [sys.executable, "-m", "appliance.train.nodes", "--host-store", f"127.0.0.1:{self.port}"],
            cwd=ROOT,
            env=self.base,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        self.heads: dict[int, subprocess.Popen[str]] = {}

    def start(self, rank: int, faults: str | None) -> None:
        env = self.base | {"PET_LOCAL_ADDR": f"127.0.0.{rank + 1}"} | ({"BLOOM_FAULTS": faults} if faults else {})
        cmd = [sys.executable, str(ROOT / "bloom_appliance.py"), "train", "--run-dir", str(self.run_dir.root)]
        cmd += ["--nnodes", "2", "--spares", "3", "--node-rank", str(rank), "--master", f"127.0.0.1:{self.port}"]
        cmd += ["--store-elsewhere"]
        self.heads[rank] = subprocess.Popen(
            cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
        )

    def stop_all(self) -> None:
        for head in self.heads.values():
            if head.poll() is None:
                _kill_node(head)
        self.store.terminate()
        self.store.wait(timeout=10)


def _tree(pid: int) -> list[int]:
    return [pid, *_descendants(pid)]


def _signal_tree(pid: int, sig: signal.Signals) -> None:
    for each in _tree(pid):
        with contextlib.suppress(ProcessLookupError):
            os.kill(each, sig)


def _rss_mb(pids: list[int]) -> float:
    """The resident memory of these processes together (VmRSS of /proc/<pid>/status)."""
    total_kb = 0
    for pid in pids:
        with contextlib.suppress(OSError):
            for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total_kb += int(line.split()[1])
    return total_kb / 1024


def _mapped_libraries(pids: list[int]) -> set[str]:
    """The shared objects these processes have mapped (torch's, DeepSpeed's, numpy's, a GPU driver's show here)."""
    found = set()
    for pid in pids:
        with contextlib.suppress(OSError):
            for line in Path(f"/proc/{pid}/maps").read_text().splitlines():
                parts = line.split()
                if len(parts) >= 6 and ".so" in parts[-1]:
                    found.add(parts[-1])
    return found


def _heavy(libraries: set[str]) -> list[str]:
    words = ("torch", "deepspeed", "numpy", "libcuda", "nvidia")
    return sorted(lib for lib in libraries if any(w in lib for w in words))


def _wait(what: str, done: Any, nodes: Nodes, deadline: float, alive: tuple[int, ...] = ()) -> Any:
    while not (found := done()):
        assert time.monotonic() < deadline, f"not in time: {what}"
        for rank in alive:
            head = nodes.heads[rank]
            assert head.poll() is None, f"node {rank} exited ({head.returncode}) before {what}: {head.stderr.read()}"
        time.sleep(0.2)
    return found


def _checkpoint(run_dir: RunDir, step: int) -> Any:
    return lambda: [e for e in events(run_dir, "checkpoint") if e["step"] == step]


def _declared(run_dir: RunDir, rank: int) -> list[dict[str, Any]]:
    """The failure events that declared node `rank` lost (a node, not a rank: train/peer_watch.py)."""
    return [e for e in events(run_dir, "failure") if e.get("node") == _node(rank) and e["rank"] is None]


def _recoveries(run_dir: RunDir) -> list[dict[str, Any]]:
    return [e for e in events(run_dir, "recovery") if e.get("lost_nodes")]


def _nodes_record(run_dir: RunDir) -> dict[str, Any]:
    try:
        return dict(json.loads((run_dir.control / "nodes.json").read_text()))
    except (OSError, ValueError):
        return {}


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    run_dir = prepare_run(
        tmp_path_factory.mktemp("spares") / "run",
        LAYOUT,
        train_samples=GBS * STEPS,
        warmup_samples=GBS,
        decay_samples=GBS * STEPS,
        eval_interval=1000,  # only the final evaluation
        eval_samples=2,
        save_interval=2,
        eval_task_limit=1,
        # A node freezes right after a save: a blocking save has committed it by then (a background one would still
        # wait for the next step boundary, and go with the node: test_elastic_nodes shows that case).
        async_checkpoints=False,
    )
    plan = json.loads(run_dir.plan.read_text())
    plan["run"]["max_restarts"] = DEFAULT_MAX_RESTARTS
    run_dir.plan.write_text(json.dumps(plan, indent=1))
    nodes = Nodes(run_dir)
    out: dict[str, Any] = {"dir": run_dir}
    started = time.monotonic()
    try:
        for rank in (4, 3, 2, 1, 0):  # the others first: they wait for the store
            nodes.start(rank, FAULTS.get(rank))
        deadline = time.monotonic() + 600
        everyone = (0, 1, 2, 3, 4)

        # 1. The first start: measured as the first save is written.
        _wait("the checkpoint of step 2", _checkpoint(run_dir, 2), nodes, deadline, everyone)
        out["first_start"] = _nodes_record(run_dir)
        out["standby_rss_mb"] = {r: _rss_mb(_tree(nodes.heads[r].pid)) for r in (2, 3, 4)}
        out["standby_libraries"] = {r: _heavy(_mapped_libraries(_tree(nodes.heads[r].pid))) for r in (2, 3, 4)}
        out["training_rss_mb"] = _rss_mb(_tree(nodes.heads[0].pid))
        out["training_libraries"] = _heavy(_mapped_libraries(_tree(nodes.heads[0].pid)))

        # 2. Node 1 frozen whole; replaced by node 2.
        time.sleep(0.3)  # its rank froze as step 3 started, right after the save
        out["frozen_at"] = time.time()
        _signal_tree(nodes.heads[1].pid, signal.SIGSTOP)
        # 3. Node 4 dies while the run re-forms, when no start keeps the spares' account: the next one says so.
        _wait("node 1 declared lost", lambda: _declared(run_dir, 1), nodes, deadline)
        _signal_tree(nodes.heads[4].pid, signal.SIGKILL)
        nodes.heads[4].communicate(timeout=30)
        # Node 1 back, as soon as the new start's ranks have formed their world without it.
        _wait("node 1's place taken", lambda: _node(1) not in _nodes_record(run_dir).get("nodes", []), nodes, deadline)
        _signal_tree(nodes.heads[1].pid, signal.SIGKILL)
        nodes.heads[1].communicate(timeout=30)
        out["back_at"] = time.time()
        nodes.start(1, None)
        first = _wait("the first takeover", lambda: _recoveries(run_dir), nodes, deadline, (0, 1, 2))[0]
        out["first_takeover"] = first

        def listed(rank: int, *, standing: bool) -> Any:
            return lambda: [
                e  # this start's `nodes` events: its own, written as the recovery event, and the spares' changes
                for e in events(run_dir, "nodes")
                if (_node(rank) in e["spares"]) == standing and e["t"] >= first["t"] - 1
            ]

        out["back"] = _wait("node 1 standing by", listed(1, standing=True), nodes, deadline, (0, 1, 2))[0]
        out["spare_lost"] = _wait("node 4 gone", listed(4, standing=False), nodes, deadline, (0, 1, 2))[0]
        out["record_back"] = _nodes_record(run_dir)
        out["standby_back_rss_mb"] = _rss_mb(_tree(nodes.heads[1].pid))

        # 4. Three more losses at known steps, each victim killed whole once its rank froze.
        for victim, loss, alive in ((0, LOSSES[1], (1, 2, 3)), (2, LOSSES[2], (1, 2, 3)), (3, LOSSES[3], (1, 3))):
            _wait(f"the checkpoint of step {loss - 1}", _checkpoint(run_dir, loss - 1), nodes, deadline, alive)
            time.sleep(0.3)
            out.setdefault("killed_at", {})[victim] = time.time()
            _kill_node(nodes.heads[victim])
            nodes.heads[victim].communicate(timeout=30)
        output, errors = nodes.heads[1].communicate(timeout=max(1.0, deadline - time.monotonic()))
        out["ended_at"] = time.time()
        out["code"] = nodes.heads[1].returncode
        out["output"] = f"node 1 exit {out['code']}\n{output[-2000:]}\n{errors[-4000:]}"
    finally:
        nodes.stop_all()
    out["seconds"] = time.monotonic() - started
    return out


def test_the_spares_the_user_named_stand_by_outside_the_rendezvous_holding_no_torch(run: dict[str, Any]) -> None:
    first = run["first_start"]
    # The training world (every rank's node, gathered over it, in rank order): nodes 0 and 1, never a spare.
    assert (first["ranks"], first["layout"]) == ([_node(0), _node(1)], "tp(1) * pp(1) * dp(2)")
    assert first["spares"] == [_node(2), _node(3), _node(4)]
    starts = [e for e in events(run["dir"], "nodes") if e.get("change") == "start"]
    assert (starts[0]["nodes"], starts[0]["spares"]) == ([_node(0), _node(1)], [_node(2), _node(3), _node(4)])
    # Resident memory of each standby's whole process tree, and of a training node's (the control: torch and
    # DeepSpeed in its rank) measured the same way.
    assert all(mb < STANDBY_MAX_RSS_MB for mb in run["standby_rss_mb"].values()), run["standby_rss_mb"]
    assert run["training_rss_mb"] > 2 * STANDBY_MAX_RSS_MB, run["training_rss_mb"]
    print(
        f"resident MB: standbys {run['standby_rss_mb']}, back {run['standby_back_rss_mb']:.1f}, training node", end=""
    )
    print(f" {run['training_rss_mb']:.0f}; the run took {run['seconds']:.0f} s")
    assert run["standby_libraries"] == {2: [], 3: [], 4: []}
    assert any("torch" in lib for lib in run["training_libraries"])


def test_a_frozen_node_is_found_in_seconds_and_replaced_within_a_minute(run: dict[str, Any]) -> None:
    first = run["first_takeover"]
    assert (first["lost_nodes"], first["took_over"]) == ([_node(1)], [_node(2)])  # node 2: first in line
    assert first["layout_from"] == first["layout_to"] == "tp(1) * pp(1) * dp(2)"
    assert (first["resumed_step"], first["redone_steps"]) == (LOSSES[0] - 1, 0)
    # Declared after the 3 s silence (and a beat or two of reading), not after a collective's timeout.
    assert 3.0 <= first["detection_s"] < 6.0, first
    declared = _declared(run["dir"], 1)
    assert len(declared) == 1 and "silent" in declared[0]["reason"] and declared[0]["detected_by"] == _node(0)
    # From the freeze to the first step of the new start (the recovery event is written as it starts).
    assert first["t"] - run["frozen_at"] < FREEZE_REPLACED_WITHIN_S


def test_a_returning_node_stands_by_while_training_goes_on_and_a_dead_spare_leaves_the_count(
    run: dict[str, Any],
) -> None:
    run_dir: RunDir = run["dir"]
    first, second_loss = run["first_takeover"], run["killed_at"][0]
    # Node 1 stands by (no agent, no member of the rendezvous): the new start trains on from its first step to the next
    # loss with no other start and no recovery, step after step.
    assert run["back"]["t"] < second_loss and run["spare_lost"]["t"] < second_loss
    window = [e for e in events(run_dir) if first["t"] < e["t"] < second_loss]
    assert not [e for e in window if e["kind"] == "recovery" or e.get("change") == "start"]
    steps = [e["step"] for e in window if e["kind"] == "step"]
    assert steps == list(range(LOSSES[0], LOSSES[1])), steps
    assert run["standby_back_rss_mb"] < STANDBY_MAX_RSS_MB
    # Node 4 died standing by: a `nodes` event says so, and the spares' count drops.
    lost = [e for e in events(run_dir, "nodes") if e.get("change") == "spare_lost"]
    assert [(e["node"], e["t"] < second_loss) for e in lost] == [(_node(4), True)]
    # The node record and the newest `nodes` event say which nodes train and which stand by.
    record = run["record_back"]
    assert (record["nodes"], record["spares"]) == ([_node(0), _node(2)], [_node(1), _node(3)])
    # The newest before the second loss: this start's own `nodes` event and the spares' changes may all be written
    # before its recovery event (which is written as its first step starts), so none need fall inside `window`.
    newest = [e for e in events(run_dir, "nodes") if e["t"] < second_loss][-1]
    assert (newest["nodes"], newest["spares"]) == ([_node(0), _node(2)], [_node(1), _node(3)])


def test_four_losses_on_the_default_budget_three_takeovers_then_a_step_down(run: dict[str, Any]) -> None:
    run_dir: RunDir = run["dir"]
    assert run["code"] == 0, run["output"]
    assert run_dir.eval.exists()
    changes = _recoveries(run_dir)
    assert [(e["lost_nodes"], e["took_over"], e["layout_to"]) for e in changes] == [
        ([_node(1)], [_node(2)], "tp(1) * pp(1) * dp(2)"),
        ([_node(0)], [_node(1)], "tp(1) * pp(1) * dp(2)"),
        ([_node(2)], [_node(3)], "tp(1) * pp(1) * dp(2)"),
        ([_node(3)], [], "tp(1) * pp(1) * dp(1)"),
    ]
    budget = DEFAULT_MAX_RESTARTS
    assert [(e["restart_spent"], e["restarts_left"]) for e in changes] == [
        (False, budget),
        (False, budget),
        (False, budget),
        (True, budget - 1),
    ]
    assert [e["resumed_step"] for e in changes] == [loss - 1 for loss in LOSSES]
    nodes = json.loads((run_dir.control / "nodes.json").read_text())
    assert (nodes["nodes"], nodes["spares"], nodes["layout"]) == ([_node(1)], [], "tp(1) * pp(1) * dp(1)")
    summary = summarize(run_dir, state="done", wall_seconds=0.0, stage_seconds={})
    assert (summary["restarts_left"], summary["spares_left"]) == (budget - 1, 0)
    assert [e["took_over"] for e in summary["node_losses"]] == [[_node(2)], [_node(1)], [_node(3)], []]
    # The end waits for no spare (node 4 died standing by): the last node leaves once its run is done.
    last_step = max(e["t"] for e in events(run_dir, "step"))
    assert run["ended_at"] - last_step < 60, run["ended_at"] - last_step


def test_every_step_once_with_the_loss_of_an_uninterrupted_run(run: dict[str, Any]) -> None:
    steps = events(run["dir"], "step")
    assert [e["step"] for e in steps] == list(range(1, STEPS + 1))
    assert [e["consumed_samples"] for e in steps] == [GBS * e["step"] for e in steps]
    losses = [e["loss"] for e in steps]
    assert all(math.isfinite(x) for x in losses)
    want, floor = measure_floor(lambda order: reference_losses(run["dir"], order, steps=STEPS, from_step=0))
    assert_within(losses, want["losses"], "losses", floor, FACTOR, "the run across four losses against one process")
