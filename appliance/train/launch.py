"""Starts the training ranks through PyTorch's elastic agent (torch.distributed.run).

The agent restarts the whole worker group when a rank dies (--max-restarts), and the workers resume from the
newest valid checkpoint. Under SLURM each node runs the same agent with a shared c10d rendezvous on the first node
(see appliance/train/slurm.py); without SLURM, with `--nnodes/--node-rank/--master`, each node's launcher starts its
agent, node 0's under a process that hosts the rendezvous store on the master address only (see
appliance/train/nodes.py).

What listens where (no store authenticates anyone: parallel/store.py). One node: everything on 127.0.0.1. The agent
hosts its c10d rendezvous store on a port the kernel picks (train/agent.py); the ranks get 127.0.0.1 as MASTER_ADDR
and the port torch picks as MASTER_PORT, where rank 0 serves their process group's store; gloo's connections are
pinned to the loopback interface. Several nodes: the rendezvous store on --master HOST:PORT (train/nodes.py), rank
0's store on the address its node's agent gave the rendezvous (nodes.py `local_address`), each node's gloo on the
address its host name resolves to (on loopback where that store is). SLURM's script names no address: torch's own
stores there, on every interface of the first node.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from types import FrameType
from typing import Any

from appliance.errors import BadInput
from appliance.monitor.events import EventWriter
from appliance.parallel.store import LOOPBACK, STORE_BIND_ENV, loopback_interface
from appliance.planner.failures import RDZV_KEEP_ALIVE_ATTEMPTS, RDZV_KEEP_ALIVE_S, RDZV_LAST_CALL_S
from appliance.planner.runspec import RunSpec, load_spec
from appliance.rundir import RunDir
from appliance.train.agent import HOST_RENDEZVOUS, NODE_WATCH
from appliance.train.compile_cache import compile_cache_env
from appliance.train.nodes import (
    ELASTIC_ENV,
    NODE_NAME_ENV,
    NodeGroup,
    check_master_here,
    local_address,
    store_bind_host,
    store_host_command,
    wait_for_master,
)
from appliance.train.peer_watch import EXIT_REPLACED
from appliance.train.restart_budget import AGENT_RESTARTS
from appliance.train.runlock import LOCK_ENV, RunLock, own_run_dir
from appliance.train.startup import LAUNCH_TIME_ENV

REPO_ROOT = Path(__file__).resolve().parents[2]
WORKER_MODULE = "appliance.rank.worker"
AGENT_MODULE = "appliance.train.agent"  # torch.distributed.run, leaving without the teardown (train/agent.py)


# A poll of the agent's few local processes costs microseconds: torch's default, 0.1 s. Ours was 1 s, which added half a
# second on average to every launch's end and to every restart.
AGENT_MONITOR_INTERVAL_S = 0.1


def agent_command(
    run_dir: Path,
    *,
    nproc_per_node: int,
    max_restarts: int,
    nnodes: int | str = 1,
    rdzv_endpoint: str | None = None,
    rdzv_id: str = "bloom-appliance",
    python: str = sys.executable,
    worker_args: tuple[str, ...] = (),
    store_hosted_elsewhere: bool = False,
    local_addr: str | None = None,
    node_rank: int | None = None,
) -> list[str]:
    """The agent's command line. One node (no `rdzv_endpoint`): the agent hosts the rendezvous store itself, on
    loopback, and gives the ranks 127.0.0.1 as MASTER_ADDR. `store_hosted_elsewhere`: every agent joins the
    rendezvous store as a client (the launcher of node 0 hosts it, bound to the master address only;
    appliance/train/nodes.py). `nnodes` may be "MIN:MAX": the agents then re-form without a lost node (rendezvous
    timings: `rendezvous_conf`). `local_addr`: this node's address in the rendezvous, which torch gives every rank
    as MASTER_ADDR when this node comes first (None: torch's own choice, this machine's FQDN). `node_rank`, for an
    elastic launch's node: the agent beats for the node and watches the others' beats (train/peer_watch.py)."""
    one_node = nnodes == 1 and rdzv_endpoint is None
    # One node: torch's --standalone would host the rendezvous store on every interface. The agent hosts it instead
    # (train/agent.py), on loopback, and adds the --rdzv-endpoint; it joins as a client like the agents of nodes.
    cmd = [python, "-m", AGENT_MODULE]
    cmd += [] if node_rank is None else [NODE_WATCH, str(run_dir), str(node_rank)]
    cmd += [HOST_RENDEZVOUS, LOOPBACK] if one_node else []
    cmd += [f"--nproc-per-node={nproc_per_node}", f"--max-restarts={max_restarts}"]
    if one_node:
        cmd += ["--nnodes=1", "--rdzv-backend=c10d", f"--rdzv-id={rdzv_id}"]
        conf = rendezvous_conf(elastic=False, store_hosted_elsewhere=True)
        local_addr = LOOPBACK
    else:
        cmd += [f"--nnodes={nnodes}", "--rdzv-backend=c10d", f"--rdzv-endpoint={rdzv_endpoint}", f"--rdzv-id={rdzv_id}"]
        conf = rendezvous_conf(elastic=":" in str(nnodes), store_hosted_elsewhere=store_hosted_elsewhere)
    if conf:
        cmd.append(f"--rdzv-conf={conf}")
    if local_addr is not None:
        cmd.append(f"--local-addr={local_addr}")
    # Each rank's stdout/stderr goes to run_dir/logs/<run id>/attempt_<n>/<rank>/; the console shows events. The agent
    # looks at its workers every AGENT_MONITOR_INTERVAL_S: its exit (the train stage's end) and a restart lag by that.
    cmd += [f"--log-dir={Path(run_dir) / 'logs'}", "--redirects=3", f"--monitor-interval={AGENT_MONITOR_INTERVAL_S}"]
    cmd += ["-m", WORKER_MODULE, "--run-dir", str(run_dir), *worker_args]
    return cmd


# How quickly the agents of an elastic launch (--nnodes MIN:MAX, --spares K) give up on a lost node and re-form:
# torch's c10d rendezvous declares a node dead after keep_alive_interval x keep_alive_max_attempt seconds without a
# keep-alive (torch's defaults: 5 x 3), and, once MIN nodes have joined a new round, waits last_call_timeout for the
# others (torch's 30 s: a node that restarts within it still joins the same round). The figures live in
# planner/failures.py, which prices a loss with them. BLOOM_RDZV_CONF (k=v,k=v) replaces or adds keys, e.g. shorter
# timings for a test on one machine.
ELASTIC_RDZV_CONF = {
    "keep_alive_interval": str(RDZV_KEEP_ALIVE_S),
    "keep_alive_max_attempt": str(RDZV_KEEP_ALIVE_ATTEMPTS),
    "last_call_timeout": str(RDZV_LAST_CALL_S),
}
RDZV_CONF_ENV = "BLOOM_RDZV_CONF"


def rendezvous_conf(*, elastic: bool, store_hosted_elsewhere: bool, env: dict[str, str] | None = None) -> str:
    """The agents' --rdzv-conf: is_host=false where node 0's launcher hosts the store, the elastic timings."""
    conf = {"is_host": "false"} if store_hosted_elsewhere else {}
    if elastic:
        conf |= ELASTIC_RDZV_CONF
        extra = (os.environ if env is None else env).get(RDZV_CONF_ENV, "")
        for item in filter(None, extra.split(",")):
            key, sep, value = item.partition("=")
            if not sep or not key.strip() or not value.strip():
                raise BadInput(f"{RDZV_CONF_ENV}={extra!r}: {item!r} is not key=value")
            conf[key.strip()] = value.strip()
    return ",".join(f"{k}={v}" for k, v in conf.items())


# By default the agent lets its workers share its own rendezvous store, with no per-restart prefix: after a
# restart, the new workers find the dead ones' addresses under the same keys and the process group fails to form
# ("Gloo connectFullMesh failed ... Connection refused"). With this set, each restart's rank 0 hosts a fresh store,
# at MASTER_ADDR (the agent's --local-addr) and a port torch picks, listening on STORE_BIND_ENV's address only.
FRESH_STORE_ENV = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"
# The interface gloo's connections use (torch reads it in every rank).
GLOO_INTERFACE_ENV = "GLOO_SOCKET_IFNAME"
NCCL_INTERFACE_ENV = "NCCL_SOCKET_IFNAME"


def worker_env(
    base: dict[str, str] | None = None,
    *,
    cpu_plan: bool = False,
    compile_cache: dict[str, str] | None = None,
    store_bind: str | None = None,
) -> dict[str, str]:
    """The ranks' environment. `cpu_plan`: the plan has no GPUs (it was made for CPU ranks, e.g. with --hardware
    cpu-laptop-2core on a GPU node): the ranks see no GPU, or each would take cuda:<local rank> and DeepSpeed its
    CUDA accelerator, and a second rank would find no second GPU. `compile_cache`: compile_cache_env's variables,
    set where the environment has none. `store_bind`: the one address rank 0's process-group store listens on
    (parallel/store.py); on loopback, gloo's connections stay there too."""
    env = dict(os.environ if base is None else base)
    for name, path in (compile_cache or {}).items():
        env.setdefault(name, path)
    if cpu_plan:
        env["CUDA_VISIBLE_DEVICES"] = ""
        env["DS_ACCELERATOR"] = "cpu"
    env[FRESH_STORE_ENV] = "1"
    if store_bind is not None:
        env[STORE_BIND_ENV] = store_bind
    if store_bind == LOOPBACK:
        # Every rank is on this machine. Gloo would otherwise listen on the address the host name resolves to,
        # often the machine's network address.
        env.setdefault(GLOO_INTERFACE_ENV, loopback_interface())
        # NCCL's bootstrap listens on the interface it picks (a network one when there is one); on one node its
        # data goes over NVLink/PCIe or shared memory, so loopback costs nothing. (Not yet run on a GPU node.)
        env.setdefault(NCCL_INTERFACE_ENV, loopback_interface())
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH", "")) if p)
    # One compute thread per rank on CPU: ranks x threads must not exceed the cores (the agent sets this to 1 too
    # when it starts more than one process per node, with a warning we make unnecessary).
    env.setdefault("OMP_NUM_THREADS", "1")
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    return env


def _request_stop_on_signals(run_dir: RunDir) -> dict[int, Any]:
    """SIGTERM (a scheduler's preemption) and SIGUSR1 (SLURM's --signal=USR1@300 warning) to the head process
    become the save-and-exit control file: the ranks see it at their next step, agree on the step with one
    all-reduce, save, and exit cleanly. Signalling the agent instead would race its own worker shutdown."""

    def on_signal(signum: int, frame: FrameType | None) -> None:
        run_dir.make_control()
        run_dir.request_stop.touch()

    return {sig: signal.signal(sig, on_signal) for sig in (signal.SIGTERM, signal.SIGUSR1)}


# The agent's own report of a dead worker (torch.distributed.elastic.multiprocessing.api, SubprocessContext._poll).
WORKER_FAILED = re.compile(rb"failed \(exitcode: (-?\d+)\) local_rank: (\d+) \(pid: (\d+)\)")


class AgentLogWatcher:
    """Turns the agent's "failed (exitcode: -9) local_rank: 1 (pid: 4242)" lines into `failure` events.

    A rank killed outright (SIGKILL, the OOM killer, a segfault) writes nothing itself; the agent sees its exit code
    and restarts the group. This reads the agent's log as it grows, so the dashboard names the rank and the cause.
    A worker the hang watchdog killed was already reported, with the better reason, and is not reported again.
    """

    def __init__(self, run_dir: RunDir, log: Path, events: EventWriter, node: str | None = None) -> None:
        self.run_dir = run_dir
        self.log = log
        self.events = events
        self.node = node  # several nodes: which node's agent saw it (its `rank` is the local rank there)
        self.offset = log.stat().st_size if log.exists() else 0
        self.partial = b""

    def poll(self) -> int:
        """Read what the agent wrote since the last call; returns how many failures it reported."""
        from appliance.train.peer_watch import was_aborted
        from appliance.train.watchdog import was_killed_as_hung

        try:
            with open(self.log, "rb") as f:
                f.seek(self.offset)
                chunk = f.read()
        except OSError:
            return 0
        self.offset += len(chunk)
        lines = (self.partial + chunk).split(b"\n")
        self.partial = lines.pop()
        reported = 0
        for line in lines:
            match = WORKER_FAILED.search(line)
            if match is None:
                continue
            code, local_rank, pid = (int(g) for g in match.groups())
            if was_killed_as_hung(self.run_dir.heartbeats, pid) or (
                self.node is not None and was_aborted(self.run_dir, self.node, pid)
            ):
                continue  # reported already, with the reason: a hang, or a silent peer node
            cause = f"killed by {signal.Signals(-code).name}" if code < 0 and -code in _SIGNALS else f"exit code {code}"
            where = {} if self.node is None else {"node": self.node}
            who = f"rank {local_rank}" if self.node is None else f"local rank {local_rank} on {self.node}"
            self.events.emit(
                "failure",
                rank=local_rank,
                reason=f"{who} (pid {pid}) died: {cause}; the agent restarts the workers",
                exit_code=code,
                **where,
            )
            reported += 1
        return reported


_SIGNALS = {s.value for s in signal.Signals}


def run_agent(
    run_dir: RunDir,
    *,
    nproc_per_node: int,
    max_restarts: int,
    worker_args: tuple[str, ...] = (),
    nodes: NodeGroup | None = None,
    cpu_plan: bool = False,
) -> int:
    """Runs the agent to completion; returns its exit code. Its own chatter goes to logs/agent.log (node R > 0:
    logs/agent-node<R>.log), which is watched for dead workers (each becomes a `failure` event)."""
    run_dir.logs.mkdir(parents=True, exist_ok=True)
    multi = nodes is not None and nodes.total_nodes > 1
    cmd = agent_command(
        run_dir.root,
        nproc_per_node=nproc_per_node,
        max_restarts=max_restarts,
        worker_args=worker_args,
        nnodes=1 if nodes is None else nodes.agent_nnodes,
        rdzv_endpoint=None if nodes is None else nodes.master,
        rdzv_id=f"bloom-{run_dir.root.resolve().name}",
        store_hosted_elsewhere=nodes is not None,
        local_addr=None if nodes is None else local_address(nodes),
        node_rank=nodes.node_rank if nodes is not None and nodes.elastic else None,
    )
    previous = _request_stop_on_signals(run_dir) if threading.current_thread() is threading.main_thread() else {}
    agent_log = run_dir.logs / ("agent.log" if nodes is None or nodes.is_head else f"agent-node{nodes.node_rank}.log")
    if nodes is not None and nodes.hosts_store:
        check_master_here(nodes)  # exit 2 naming --master before anything starts
        cmd = store_host_command(nodes, cmd)
    try:
        if nodes is not None and not nodes.hosts_store:
            wait_for_master(nodes)
        with open(agent_log, "ab") as log, EventWriter(run_dir.metrics) as events, _node_lock(run_dir, nodes) as lock:
            watcher = AgentLogWatcher(run_dir, agent_log, events, node=nodes.node_name() if multi and nodes else None)
            # A new session: a Ctrl-C in the terminal reaches the head process only, which turns it into a
            # save-and-exit request instead of killing ranks mid-step. The agent inherits the run directory's
            # lock (pass_fds) and keeps it if this process dies; its ranks join it (appliance/train/runlock.py).
            env = worker_env(
                cpu_plan=cpu_plan,
                compile_cache=compile_cache_env(run_dir, 0 if nodes is None else nodes.node_rank),
                store_bind=LOOPBACK if nodes is None else store_bind_host(nodes),
            )
            env = env if lock is None else lock.child_env(env)
            if multi and nodes is not None:
                env[NODE_NAME_ENV] = nodes.node_name()
                if nodes.elastic:
                    env[ELASTIC_ENV] = nodes.agent_nnodes
                if lock is None:  # a node other than 0: node 0 claimed the directory; these ranks join its lock
                    env[LOCK_ENV] = str(run_dir.run_lock)
            env[LAUNCH_TIME_ENV] = repr(time.time())  # where the ranks' startup account begins (train/startup.py)
            proc = subprocess.Popen(
                cmd,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                pass_fds=() if lock is None else lock.fds,
                start_new_session=True,
            )
            if lock is not None:
                lock.note_agent(proc.pid)
            while True:
                try:
                    code = proc.wait(timeout=1.0)
                    watcher.poll()
                    return code
                except subprocess.TimeoutExpired:
                    watcher.poll()
                except KeyboardInterrupt:
                    run_dir.make_control()
                    run_dir.request_stop.touch()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


@contextlib.contextmanager
def _node_lock(run_dir: RunDir, nodes: NodeGroup | None) -> Iterator[RunLock | None]:
    """Node 0 (or the only node) owns the run directory; the other nodes' ranks join its lock."""
    if nodes is not None and not nodes.is_head:
        yield None
        return
    with own_run_dir(run_dir) as lock:
        yield lock


def check_plan_runs_here(spec: RunSpec, source: str, *, ranks_here: int, in_rank: bool = False) -> None:
    """BadInput, naming the fix, when this node's torch and DeepSpeed cannot train the plan with `ranks_here` ranks:
    a CPU-only torch, or fewer visible GPUs than ranks, for a GPU plan (hardware/torch_build.py); fp16 where the
    accelerator has none (parallel/step/precision.py).

    The head asks before the plan is fixed (so no stage runs for a plan that cannot train here, and a rerun with the
    `--set` the refusal names applies) and again before launching; every rank asks for its own node (`in_rank`),
    since under SLURM no head runs on the training nodes. The head asks the fp16 question of CPU plans only: for a
    GPU plan it would hold a CUDA context on GPU 0 in the head for the whole run, and every GPU of the specs table
    has fp16 (V100 on); the ranks ask their own accelerator."""
    from appliance.hardware.torch_build import check_torch_for_plan
    from appliance.parallel.step.precision import check_fp16_supported

    check_torch_for_plan(spec.hardware.gpus_per_node, spec.hardware.gpu, ranks_here, source)
    if in_rank or spec.hardware.gpus_per_node == 0:
        check_fp16_supported(spec.train.dtype, source)


def run_plan(run_dir: RunDir, *, worker_args: tuple[str, ...] = (), nodes: NodeGroup | None = None) -> int:
    """The ranks of the run directory's plan on this machine: tp x pp x dp processes, or that divided by the nodes
    of `nodes`, with the plan's restart budget (an elastic launch's agents get one they cannot reach, and the run
    counts its own: train/restart_budget.py). A node that stands by (a spare, or a node back to a run that trains
    without it: train/standby.py) starts its agent only when it takes a place, and waits again when its agent
    leaves because the node was declared lost and replaced.

    Preempted and failed markers left by an earlier launch are cleared first (by node 0, the only one that may),
    so they only ever describe this one. A plan the ranks could not read fails here, before any rank starts
    (BadInput naming plan.json and the key).
    """
    spec = load_spec(run_dir.plan)
    world = spec.layout.world_size
    ranks_here = world if nodes is None else nodes.ranks_per_node(world, str(run_dir.plan))
    elastic = nodes is not None and nodes.elastic
    standing_by = False
    if nodes is not None and elastic:
        from appliance.train.node_beats import STANDBY, timings
        from appliance.train.standby import node_role

        standing_by = node_role(run_dir, nodes, timings()) == STANDBY
    if standing_by:
        # torch imported by a process that ends, not by the standby; a CPU plan outside fp16 has nothing to check
        if spec.hardware.gpus_per_node > 0 or spec.train.dtype == "fp16":
            check_node_elsewhere(run_dir, ranks_here)
    else:
        check_plan_runs_here(spec, str(run_dir.plan), ranks_here=ranks_here)
    if nodes is not None and elastic:
        from appliance.train.elastic import check_node_range, min_agents

        # With spares and no MIN, the agents carry on down to the plan's smallest usable node count.
        nodes = replace(nodes, min_nodes=min_agents(spec, nodes))
        assert nodes.min_nodes is not None
        stepping = check_node_range(spec, nodes.min_nodes, nodes.nnodes, str(run_dir.plan))
        if stepping and nodes.is_head:
            print(
                f"warning: --nnodes {nodes.agent_nnodes}: should fewer than {nodes.nnodes} nodes be left, the"
                f" plan's {spec.layout.factors} with global batch({spec.layout.global_batch_size}) trains on"
                f" {stepping} of them (the others stand by)",
                file=sys.stderr,
            )
    if nodes is None or nodes.is_head:
        run_dir.preempted_marker.unlink(missing_ok=True)
        run_dir.failed_marker.unlink(missing_ok=True)
        if elastic:
            from appliance.train.restart_budget import open_launch

            open_launch(run_dir, spec.run.max_restarts)
    while True:
        if nodes is not None and standing_by:
            from appliance.train.node_beats import timings
            from appliance.train.standby import OVER, TAKE_OVER, Standby

            wait_for_master(nodes)
            outcome = Standby(run_dir, nodes, timings()).wait()
            if outcome != TAKE_OVER:
                return 0 if outcome == OVER else 1  # over: the markers say how; else the run is gone
        code = run_agent(
            run_dir,
            nproc_per_node=ranks_here,
            max_restarts=AGENT_RESTARTS if elastic else spec.run.max_restarts,
            worker_args=worker_args,
            nodes=nodes,
            cpu_plan=spec.hardware.gpus_per_node == 0,
        )
        if not (elastic and code == EXIT_REPLACED):
            return code
        print(f"{nodes.node_name() if nodes else 'this node'} was declared lost and replaced", file=sys.stderr)
        standing_by = True


def check_node_elsewhere(run_dir: RunDir, ranks_here: int, python: str = sys.executable) -> None:
    """check_plan_runs_here in a process of its own (`python -m appliance.train.node_check`), for a node that stands
    by: the check imports torch, which the standby must not hold. BadInput with the check's message."""
    done = subprocess.run(
        [python, "-m", "appliance.train.node_check", str(run_dir.root), str(ranks_here)],
        capture_output=True,
        text=True,
        env=worker_env(),
    )
    if done.returncode != 0:
        raise BadInput((done.stderr.strip().splitlines() or [f"exit code {done.returncode}"])[-1])


def last_rank_errors(run_dir: RunDir, max_lines: int = 30) -> str:
    """The root cause of a failed training: the first rank traceback of the first attempt that has one.

    Later attempts (the agent's restarts) often fail only as a consequence (peers that cannot connect), so the
    first traceback is the one worth showing; the others stay in logs/.
    """

    def attempt_order(path: Path) -> tuple[int, str]:
        attempt = next((p for p in path.parts if p.startswith("attempt_")), "attempt_0")
        return int(attempt.removeprefix("attempt_") or 0), str(path)

    logs = sorted(run_dir.logs.glob("**/stderr.log"), key=attempt_order)
    fallback = ""
    for path in logs:
        text = path.read_text(errors="replace").strip()
        if "Traceback" in text:
            return f"{path}:\n" + "\n".join(text.splitlines()[-max_lines:])
        fallback = fallback or (f"{path}:\n" + "\n".join(text.splitlines()[-max_lines:]) if text else "")
    return fallback
