"""Two nodes without SLURM, simulated on this machine: two `train --nnodes 2 --node-rank R --master 127.0.0.1:P`
processes on one run directory, two ranks each (tp1 pp2 dp2), stop at step 2 on both, then both again to the end.

What it shows: the agents meet at the rendezvous and train one 4-rank run (every global rank reports); the
rendezvous listens on the given address only (its listening socket read from /proc/net/tcp while it runs, not
on 0.0.0.0), and so does every other socket the nodes' processes listen on (rank 0's process-group store, gloo:
the nodes reach the master over loopback); the stop-and-rerun resumes from the checkpoint; each node's samples name
their node; bad flags exit 2 naming the flag.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from listening_sockets import Listener, listeners
from prepared_runs import cpu_only_env, events, explain, prepare_run

from appliance.rundir import RunDir

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

ROOT = Path(__file__).resolve().parents[2]
STEPS = 4
STOP_AT = 2


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _train_cmd(run_dir: RunDir, *args: str) -> list[str]:
    return [sys.executable, str(ROOT / "bloom_appliance.py"), "train", "--run-dir", str(run_dir.root), *args]


def _listeners(port: int) -> set[str]:
    """The local addresses listening on `port` (IPv4 and IPv6), from /proc/net/tcp*: state 0A is LISTEN."""
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            address, port_hex = local.split(":")
            if state == "0A" and int(port_hex, 16) == port:
                found.add(address)
    return found


def _two_nodes(run_dir: RunDir, *args: str) -> dict[str, Any]:
    """Both nodes' `train`, node 1 started first (it waits for the master); the master's listeners while it runs."""
    port = _free_port()
    flags = ["--nnodes", "2", "--master", f"127.0.0.1:{port}", *args]
    procs = [
        subprocess.Popen(
            _train_cmd(run_dir, "--node-rank", str(rank), *flags),
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=cpu_only_env(),
        )
        for rank in (1, 0)
    ]
    listening: set[str] = set()
    every_listener: set[Listener] = set()
    deadline = time.monotonic() + 300
    while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
        listening |= _listeners(port)
        every_listener |= listeners([p.pid for p in procs])
        time.sleep(0.2)
    results = [p.communicate(timeout=max(1.0, deadline - time.monotonic())) for p in procs]
    return {
        "codes": [p.returncode for p in procs][::-1],  # node 0's first
        "output": "\n".join(
            f"node exit {p.returncode}\n{out[-2000:]}\n{err[-4000:]}"
            for p, (out, err) in zip(procs, results, strict=True)
        ),
        "listening": listening,
        "every_listener": every_listener,
    }


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("multinode")
    run_dir = prepare_run(
        root / "run",
        "tp=1,pp=2,dp=2,mbs=2,gbs=4,zero=1,recompute=none",
        train_samples=4 * STEPS,
        warmup_samples=4,
        decay_samples=4 * STEPS,
        eval_interval=100,  # only the final evaluation: the launches, not the evaluations, are under test
        eval_samples=2,
        save_interval=STOP_AT,
        eval_task_limit=1,
    )
    first = _two_nodes(run_dir, "--stop-at-step", str(STOP_AT))
    first_steps = [e["step"] for e in events(run_dir, "step")]
    second = _two_nodes(run_dir)
    return {"dir": run_dir, "first": first, "first_steps": first_steps, "second": second}


def test_two_nodes_stop_at_a_step_then_resume_to_the_end(runs: dict[str, Any]) -> None:
    run_dir: RunDir = runs["dir"]
    assert runs["first"]["codes"] == [3, 3], runs["first"]["output"]  # 3: stopped with a checkpoint
    assert runs["second"]["codes"] == [0, 0], runs["second"]["output"]
    assert runs["first_steps"] == [1, 2]
    steps = [e["step"] for e in events(run_dir, "step")]
    assert steps == [1, 2, 3, 4]  # the rerun resumed at step 3 from step 2's checkpoint
    assert run_dir.eval.exists()


def test_every_rank_of_both_nodes_trained(runs: dict[str, Any]) -> None:
    run_dir: RunDir = runs["dir"]
    logs = list(run_dir.logs.glob("**/attempt_*/*/stderr.log"))
    # Two agents, two launches, two local ranks each: eight rank logs.
    assert len(logs) == 8, logs
    assert (run_dir.logs / "agent.log").exists() and (run_dir.logs / "agent-node1.log").exists()


def test_rendezvous_listens_on_the_given_address_only(runs: dict[str, Any]) -> None:
    loopback = "0100007F"  # 127.0.0.1 as /proc/net/tcp writes it (little-endian hex)
    for launch in ("first", "second"):
        assert runs[launch]["listening"] == {loopback}, runs[launch]["listening"]


def test_every_socket_of_both_nodes_listens_on_the_masters_network_only(runs: dict[str, Any]) -> None:
    for launch in ("first", "second"):
        found = runs[launch]["every_listener"]
        described = sorted(map(str, found))
        assert any("appliance.rank.worker" in s.command for s in found), described  # the reader sees the ranks
        assert all(s.loopback for s in found), f"{launch} launch: listening beyond loopback: {described}"


def test_each_node_names_its_samples(runs: dict[str, Any]) -> None:
    nodes = {e.get("node") for e in events(runs["dir"]) if e["kind"] in ("gpu", "energy")}
    host = socket.gethostname()
    assert {f"{host}/node0", f"{host}/node1"} <= nodes, nodes


def _bad_run_dir(tmp: Path) -> RunDir:
    """A run directory that passes the checks made before any process (a plan, a tokenizer and indexed data to
    stat), so what refuses the run is the node flag under test."""
    run_dir = RunDir(tmp / "bad").make()
    run_dir.plan.write_text(json.dumps(prepare_plan_json()))
    for stand_in in (run_dir.tokenizer_json, run_dir.datasets_json):
        stand_in.parent.mkdir(parents=True, exist_ok=True)
        stand_in.write_text("{}")
    return run_dir


def _bad(tmp: Path, *args: str) -> subprocess.CompletedProcess[str]:
    run_dir = _bad_run_dir(tmp)
    return subprocess.run(
        _train_cmd(run_dir, *args), cwd=ROOT, capture_output=True, text=True, timeout=120, env=cpu_only_env()
    )


def prepare_plan_json() -> dict[str, Any]:
    from appliance.hardware import load_hardware
    from appliance.planner import load_model_shape, make_plan, parse_layout

    layout = parse_layout("tp=1,pp=2,dp=2,mbs=2,gbs=4")
    return make_plan(load_hardware("cpu-laptop-2core"), load_model_shape("bloom-micro-test"), layout=layout).to_json()


@pytest.mark.parametrize(
    ("args", "flag"),
    [
        (("--nnodes", "2", "--node-rank", "2", "--master", "127.0.0.1:29999"), "--node-rank 2"),
        (("--nnodes", "3", "--node-rank", "0", "--master", "127.0.0.1:29999"), "--nnodes 3"),
        (("--nnodes", "2", "--node-rank", "0", "--master", "no-such-host.invalid:29999"), "--master"),
        (("--nnodes", "2", "--node-rank", "0", "--master", "127.0.0.1"), "--master"),
        (("--nnodes", "2", "--node-rank", "0", "--master", "192.0.2.1:29999"), "--master"),  # not this machine's
    ],
)
def test_bad_node_flags_exit_2_naming_the_flag(tmp_path: Path, args: tuple[str, ...], flag: str) -> None:
    result = _bad(tmp_path, *args)
    assert result.returncode == 2, explain(result)
    assert flag in result.stderr, explain(result)


def test_unreachable_master_exits_2(tmp_path: Path) -> None:
    env = {**cpu_only_env(), "BLOOM_MASTER_WAIT_S": "2"}
    run_dir = _bad_run_dir(tmp_path)
    cmd = _train_cmd(run_dir, "--nnodes", "2", "--node-rank", "1", "--master", f"127.0.0.1:{_free_port()}")
    result = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120, env=env)
    assert result.returncode == 2, explain(result)
    assert "--master" in result.stderr and "unreachable" in result.stderr, explain(result)


def test_hostfile_gives_the_node_count_the_master_and_this_machines_rank(tmp_path: Path) -> None:
    from appliance.errors import BadInput
    from appliance.train.nodes import node_group

    hostfile = tmp_path / "hosts"
    hostfile.write_text("# the master first\n192.0.2.1 slots=8\nlocalhost\n")
    group = node_group(nnodes=None, node_rank=None, master=None, hostfile=hostfile)
    assert group is not None
    assert (group.nnodes, group.node_rank, group.master) == (2, 1, "192.0.2.1:29500")
    given = node_group(nnodes=2, node_rank=0, master="192.0.2.1:29611", hostfile=hostfile)
    assert given is not None and (given.node_rank, given.master_port) == (0, 29611)
    with pytest.raises(BadInput, match="--nnodes 3: --hostfile"):
        node_group(nnodes=3, node_rank=None, master=None, hostfile=hostfile)
    hostfile.write_text("192.0.2.1\n192.0.2.2\n")
    with pytest.raises(BadInput, match=r"--hostfile .* give --node-rank"):
        node_group(nnodes=None, node_rank=None, master=None, hostfile=hostfile)


def test_every_agent_joins_the_store_node_0_hosts(tmp_path: Path) -> None:
    from appliance.train.launch import agent_command

    cmd = agent_command(
        tmp_path,
        nproc_per_node=2,
        max_restarts=0,
        nnodes=2,
        rdzv_endpoint="127.0.0.1:29611",
        store_hosted_elsewhere=True,
    )
    assert "--standalone" not in cmd
    assert {"--nnodes=2", "--rdzv-backend=c10d", "--rdzv-endpoint=127.0.0.1:29611", "--rdzv-conf=is_host=false"} <= set(
        cmd
    )


def test_run_on_another_node_waits_for_node_0s_stages_then_names_the_run_dir(tmp_path: Path) -> None:
    from appliance.errors import BadInput
    from appliance.head_run import run_on_other_node
    from appliance.run_request import RunRequest
    from appliance.train.nodes import NodeGroup

    nodes = NodeGroup(nnodes=2, node_rank=1, master_host="127.0.0.1", master_port=29611)
    request = RunRequest(corpus=[], run_dir=tmp_path / "not-shared", nodes=nodes)
    with pytest.raises(BadInput, match=r"--run-dir .*not-shared: node 0's data stages did not appear"):
        run_on_other_node(request, nodes, wait_s=0.1)
