"""Hot spare nodes, simulated on this machine: three `train --nnodes 2 --spares 1 --node-rank R` processes on one run
directory, one rank each; the plan (tp1 pp1 dp2, global batch 4, micro-batch 1) trains on two nodes and the third
stands by. The agents' local addresses (torch's PET_LOCAL_ADDR: 127.0.0.1, .2, .3, all loopback) fix the order the
rendezvous gives them, so nodes 0 and 1 train and node 2 is the spare.

1. Node 1's rank freezes as step 3 starts (the fault injector's `hang`, so the loss lands at a known step) and the
   test kills node 1 whole. The spare takes its rank: same layout, same global batch, resumed from step 2.
2. Node 2, training now, freezes as step 5 starts and is killed too. No spare is left: node 0 alone carries on at
   dp1 (the next usable node count), with the same global batch through more accumulation, from step 4.

3. A second run, with the rendezvous store in a process of its own (`--store-elsewhere`, as on a machine that does
   not train), loses node 0 the same way at step 3: the spare takes its rank and nodes 1 and 2 finish the run.

What it shows: the run finishes; each recovery event names the lost node, the spare that took over and the layouts;
every step number is trained once; the losses follow an uninterrupted single-process run of the same plan within
the noise floor of those steps; the spare stood outside the training world (the world's ranks, gathered, are nodes
0 and 1 only) until the loss.
"""

from __future__ import annotations

import functools
import json
import math
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from noise_floor import Order, assert_within, measure_floor
from prepared_runs import cpu_only_env, events, prepare_run, reference_losses
from test_elastic_nodes import RDZV_CONF, _free_port, _kill_node

from appliance.monitor.summary import summarize
from appliance.rundir import RunDir

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

ROOT = Path(__file__).resolve().parents[2]
STEPS = 8
FIRST_LOSS, SECOND_LOSS = 2, 4  # the checkpoints the survivors resume from; a node freezes as the next step starts
GBS = 4
LAYOUT = f"tp=1,pp=1,dp=2,mbs=1,gbs={GBS},zero=1,recompute=none"
# Two layouts of one training sum in other orders (noise_floor.py): the losses lie within a few floors of the
# single-process reference (test_3d_equivalence measures up to 3.6 x), so 10 x.
FACTOR = 10.0


def _wait_for_checkpoint(run_dir: RunDir, step: int, heads: dict[int, subprocess.Popen[str]], deadline: float) -> None:
    while not [e for e in events(run_dir, "checkpoint") if e["step"] == step]:
        assert time.monotonic() < deadline, f"no checkpoint of step {step} in time"
        assert all(h.poll() is None for h in heads.values()), f"a node exited before the checkpoint of step {step}"
        time.sleep(0.2)
    time.sleep(0.3)  # the frozen rank stopped as the next step started, right after the checkpoint


def _prepared(root: Path, steps: int) -> RunDir:
    run_dir = prepare_run(
        root,
        LAYOUT,
        train_samples=GBS * steps,
        warmup_samples=GBS,
        decay_samples=GBS * steps,
        eval_interval=100,  # only the final evaluation
        eval_samples=2,
        save_interval=2,
        eval_task_limit=1,
        # A node freezes right after a save: blocking saves have committed it by then (a background one would still
        # wait for the next step boundary, and go with the node; test_elastic_nodes shows that case).
        async_checkpoints=False,
    )
    plan = json.loads(run_dir.plan.read_text())
    plan["run"]["max_restarts"] = 3  # the survivors' restarts after the losses
    run_dir.plan.write_text(json.dumps(plan, indent=1))
    return run_dir


def _start_nodes(run_dir: RunDir, port: int, faults: dict[int, str], *flags: str) -> dict[int, subprocess.Popen[str]]:
    """Three nodes' `train --nnodes 2 --spares 1`, node R at local address 127.0.0.(R + 1) (the rendezvous orders the
    agents by it: nodes 0 and 1 train, node 2 stands by), with its BLOOM_FAULTS."""
    base = {k: v for k, v in cpu_only_env().items() if k != "BLOOM_FAULTS"} | {"BLOOM_RDZV_CONF": RDZV_CONF}
    heads = {}
    for rank in (2, 1, 0):  # the others first: they wait for the rendezvous
        env = (
            base
            | {"PET_LOCAL_ADDR": f"127.0.0.{rank + 1}"}
            | ({"BLOOM_FAULTS": faults[rank]} if rank in faults else {})
        )
        cmd = [sys.executable, str(ROOT / "bloom_appliance.py"), "train", "--run-dir", str(run_dir.root)]
        cmd += ["--nnodes", "2", "--spares", "1", "--node-rank", str(rank), "--master", f"127.0.0.1:{port}", *flags]
        heads[rank] = subprocess.Popen(
            cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
        )
    return heads


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    run_dir = _prepared(tmp_path_factory.mktemp("spares") / "run", STEPS)
    # Global rank 1 freezes: node 1 at step 3 in the first start; node 2, rank 1 once it took node 1's place (its
    # agent's first attempt still: a spare's restart for new members is no failure), at step 5.
    faults = {1: f"hang@step={FIRST_LOSS + 1}:rank=1", 2: f"hang@step={SECOND_LOSS + 1}:rank=1"}
    started = time.monotonic()
    heads = _start_nodes(run_dir, _free_port(), faults)

    deadline = time.monotonic() + 300
    _wait_for_checkpoint(run_dir, FIRST_LOSS, heads, deadline)
    first_start = json.loads((run_dir.control / "nodes.json").read_text())
    spare = [json.loads(p.read_text()) for p in run_dir.control.glob("spares/*/*.json")]
    spare_sockets = {r["node"]: _sockets(r["pid"]) for r in spare}
    killed = {1: time.time()}
    _kill_node(heads[1])
    _wait_for_checkpoint(run_dir, SECOND_LOSS, {r: heads[r] for r in (0, 2)}, deadline)
    killed[2] = time.time()
    _kill_node(heads[2])
    out, err = heads[0].communicate(timeout=max(1.0, deadline - time.monotonic()))
    for rank in (1, 2):
        heads[rank].communicate(timeout=10)
    return {
        "dir": run_dir,
        "code": heads[0].returncode,
        "output": f"node 0 exit {heads[0].returncode}\n{out[-1500:]}\n{err[-4000:]}",
        "killed": killed,
        "first_start": first_start,
        "spare_sockets": spare_sockets,
        "seconds": time.monotonic() - started,
    }


def _sockets(pid: int) -> int:
    """How many sockets a process holds open: a rank in a process group holds its store and peer connections."""
    fds = Path(f"/proc/{pid}/fd").iterdir()
    return sum(1 for fd in fds if fd.readlink().as_posix().startswith("socket:"))


def _node(rank: int) -> str:
    return f"{socket.gethostname()}/node{rank}"


def _changes(run: dict[str, Any]) -> list[dict[str, Any]]:
    return [e for e in events(run["dir"], "recovery") if e.get("lost_nodes")]


def test_the_run_finishes_on_node_0_alone(run: dict[str, Any]) -> None:
    assert run["code"] == 0, run["output"]
    assert run["dir"].eval.exists()
    nodes = json.loads((run["dir"].control / "nodes.json").read_text())
    assert (nodes["nodes"], nodes["spares"], nodes["layout"]) == ([_node(0)], [], "tp(1) * pp(1) * dp(1)")


def test_the_spare_stood_outside_the_training_world_until_the_loss(run: dict[str, Any]) -> None:
    # The world the training ranks formed (every rank's node, gathered over it, in rank order): every process group
    # they build is a subgroup of it, so node 2's rank was in none of them and took part in no collective.
    first = run["first_start"]
    assert (first["ranks"], first["layout"]) == ([_node(0), _node(1)], "tp(1) * pp(1) * dp(2)")
    starts = [e for e in events(run["dir"], "nodes") if e["t"] < run["killed"][1]]
    assert [(e["nodes"], e["spares"], e["spares_expected"]) for e in starts] == [([_node(0), _node(1)], [_node(2)], 1)]
    # As step 3 started, the spare's rank held no socket at all: no store, no peer, so no collective.
    assert run["spare_sockets"] == {_node(2): 0}


def test_the_spare_takes_the_lost_nodes_rank_at_the_plans_layout(run: dict[str, Any]) -> None:
    first = _changes(run)[0]
    assert (first["lost_nodes"], first["took_over"], first["spares_left"]) == ([_node(1)], [_node(2)], 0)
    assert first["layout_from"] == first["layout_to"] == "tp(1) * pp(1) * dp(2)"
    assert (first["resumed_step"], first["redone_steps"]) == (FIRST_LOSS, 0)
    last_before = max(e["t"] for e in events(run["dir"], "step") if e["t"] < run["killed"][1])
    assert run["killed"][1] - last_before <= first["lost_seconds"] < 300


def test_with_no_spare_left_the_run_steps_down_to_one_node(run: dict[str, Any]) -> None:
    changes = _changes(run)
    assert len(changes) == 2, events(run["dir"], "recovery")
    second = changes[1]
    assert (second["lost_nodes"], second["took_over"], second["spares_left"]) == ([_node(2)], [], 0)
    assert (second["layout_from"], second["layout_to"]) == ("tp(1) * pp(1) * dp(2)", "tp(1) * pp(1) * dp(1)")
    assert second["resumed_step"] == SECOND_LOSS


def test_summary_lists_what_each_loss_cost(run: dict[str, Any]) -> None:
    summary = summarize(run["dir"], state="done", wall_seconds=0.0, stage_seconds={})
    losses = summary["node_losses"]
    assert [(e["lost_nodes"], e["took_over"], e["layout_to"]) for e in losses] == [
        ([_node(1)], [_node(2)], "tp(1) * pp(1) * dp(2)"),
        ([_node(2)], [], "tp(1) * pp(1) * dp(1)"),
    ]
    assert all(e["lost_seconds"] > 0 and e["redone_steps"] == 0 for e in losses)
    assert summary["spares_left"] == 0


def test_every_step_once_with_the_global_batch_and_the_loss_of_an_uninterrupted_run(run: dict[str, Any]) -> None:
    steps = events(run["dir"], "step")
    killed = run["killed"]
    assert [e["step"] for e in steps if e["t"] < killed[1]] == list(range(1, FIRST_LOSS + 1))
    assert [e["step"] for e in steps if killed[1] <= e["t"] < killed[2]] == list(range(FIRST_LOSS + 1, SECOND_LOSS + 1))
    assert [e["step"] for e in steps if e["t"] >= killed[2]] == list(range(SECOND_LOSS + 1, STEPS + 1))
    assert [e["consumed_samples"] for e in steps] == [GBS * e["step"] for e in steps]
    losses = [e["loss"] for e in steps]
    assert all(math.isfinite(x) for x in losses)

    def reference(order: Order) -> dict[str, Any]:
        return reference_losses(run["dir"], order, steps=STEPS, from_step=0)

    want, floor = measure_floor(functools.partial(reference))
    assert_within(losses, want["losses"], "losses", floor, FACTOR, "the run across two losses against one process")


# ---- node 0 lost, the store elsewhere ------------------------------------------------------------------------------
NODE0_STEPS = 4


@pytest.fixture(scope="module")
def node0_lost(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The same three nodes with --store-elsewhere and the store in a process of its own (a machine that does not
    train); node 0 (rank 0) freezes as step 3 starts and is killed whole."""
    run_dir = _prepared(tmp_path_factory.mktemp("spares-node0") / "run", NODE0_STEPS)
    port = _free_port()
    store = subprocess.Popen(
        [sys.executable, "-m", "appliance.train.nodes", "--host-store", f"127.0.0.1:{port}"],
        cwd=ROOT,
        env=cpu_only_env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        heads = _start_nodes(run_dir, port, {0: f"hang@step={FIRST_LOSS + 1}:rank=0"}, "--store-elsewhere")
        deadline = time.monotonic() + 240
        _wait_for_checkpoint(run_dir, FIRST_LOSS, heads, deadline)
        killed = time.time()
        _kill_node(heads[0])
        results = {r: heads[r].communicate(timeout=max(1.0, deadline - time.monotonic())) for r in (1, 2)}
        heads[0].communicate(timeout=10)
    finally:
        store.terminate()
        store.wait(timeout=10)
    output = "\n".join(
        f"node {r} exit {heads[r].returncode}\n{o[-1500:]}\n{e[-4000:]}" for r, (o, e) in results.items()
    )
    return {"dir": run_dir, "codes": [heads[1].returncode, heads[2].returncode], "output": output, "killed": killed}


def test_with_the_store_elsewhere_losing_node_0_is_a_node_loss_like_any_other(node0_lost: dict[str, Any]) -> None:
    run_dir: RunDir = node0_lost["dir"]
    assert node0_lost["codes"] == [0, 0], node0_lost["output"]
    assert run_dir.eval.exists()
    changes = [e for e in events(run_dir, "recovery") if e.get("lost_nodes")]
    assert [(e["lost_nodes"], e["took_over"], e["layout_to"]) for e in changes] == [
        ([_node(0)], [_node(2)], "tp(1) * pp(1) * dp(2)")
    ]
    steps = events(run_dir, "step")
    assert [e["step"] for e in steps if e["t"] < node0_lost["killed"]] == list(range(1, FIRST_LOSS + 1))
    assert [e["step"] for e in steps if e["t"] >= node0_lost["killed"]] == list(range(FIRST_LOSS + 1, NODE0_STEPS + 1))
