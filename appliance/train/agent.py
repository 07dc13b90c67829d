"""PyTorch's elastic agent (`torch.distributed.run`, unchanged: its arguments, rendezvous, restarts and errors), which
leaves without the interpreter's teardown once its ranks have finished (appliance/process_exit.py: ~1 s of every
train stage's end). The launcher runs it as `python -m appliance.train.agent <torch.distributed.run's arguments>`.

One node: `--host-rendezvous HOST` before those arguments. This process then hosts the c10d rendezvous store itself,
on HOST (127.0.0.1) and a port the kernel picks, and the agent joins it as a client (`--rdzv-conf=is_host=false` in
the arguments): torch's own `--standalone` store listens on every interface (parallel/store.py). The store lives
exactly as long as the agent.

An elastic launch's node (`--nnodes MIN:MAX`, `--spares K`): `--node-watch RUN_DIR NODE_RANK` before them. This
process then beats the node's file in the run directory and stops its ranks when another training node falls silent
(train/peer_watch.py). The beats start once torch is imported: the import holds the interpreter for seconds at a
time, long enough for a beat to look like a silent node; no peer counts a node as training before its first beat.
A node other than 0 exits with peer_watch.EXIT_REPLACED when it was itself declared lost and a spare took its place.

Under SLURM (train/slurm.py): `--slurm-rendezvous HOST PORT` before them, the same words on every node of the job.
The user named no address there; HOST is the allocation's first node. Its agent (SLURM_NODEID 0) hosts the c10d
rendezvous store on HOST's address and PORT only, every agent joins as a client (`is_host=false`), and each node
gives the rendezvous its own address on the route to HOST (`--local-addr`), where its rank 0 would serve the process
group's store, bound there only (parallel/store.py STORE_BIND_ENV): torch's defaults would listen on every
interface of the allocation's nodes.
"""

from __future__ import annotations

import os
import sys
from collections.abc import MutableMapping
from datetime import timedelta
from pathlib import Path
from typing import Any

from appliance.output_dirs import restrict_umask
from appliance.process_exit import exit_without_teardown

HOST_RENDEZVOUS = "--host-rendezvous"
SLURM_RENDEZVOUS = "--slurm-rendezvous"
SLURM_NODE_ENV = "SLURM_NODEID"  # the node's index in the allocation, 0 for the first of the node list
NODE_WATCH = "--node-watch"
# The rendezvous store's own client waits this long for a reply (nodes.py's store host waits as long).
STORE_TIMEOUT = timedelta(seconds=600)


def main(argv: list[str] | None = None) -> None:
    from torch.distributed.run import main as run_agent

    restrict_umask()  # under SLURM no command line starts the agent: its ranks' logs and files get the modes here
    args = sys.argv[1:] if argv is None else argv
    watch = None
    if args[:1] == [NODE_WATCH]:
        from appliance.rundir import RunDir
        from appliance.train.node_beats import timings
        from appliance.train.nodes import NODE_NAME_ENV
        from appliance.train.peer_watch import PeerWatch

        run_dir, node_rank, args = RunDir(Path(args[1])), int(args[2]), args[3:]
        node = os.environ.get(NODE_NAME_ENV) or f"node{node_rank}"
        # Node 0 keeps its agent whatever is said of it: its launcher holds the run directory (and by default the
        # rendezvous store), and it never stands by.
        watch = PeerWatch(run_dir, node, node_rank, timings(), may_leave=node_rank != 0).start()
    store = None
    if args[:1] == [SLURM_RENDEZVOUS]:
        host, port, args = args[1], int(args[2]), args[3:]
        local, store = slurm_stores(host, port, os.environ)
        args = [f"--local-addr={local}", *args]
    if args[:1] == [HOST_RENDEZVOUS]:
        from appliance.parallel.store import listening_socket, serve_store

        host, args = args[1], args[2:]
        sock = listening_socket(host, 0)
        endpoint = f"[{host}]" if ":" in host else host
        endpoint += f":{sock.getsockname()[1]}"
        store = serve_store(sock, host, timeout=STORE_TIMEOUT)
        args = [f"--rdzv-endpoint={endpoint}", *args]
    run_agent(args)  # a failed launch raises (ChildFailedError) and exits as torch.distributed.run's own would
    if watch is not None:
        watch.end()  # only a finished agent says so: one that raised falls silent, and a spare takes its place
    del store  # held until here: it serves the rendezvous for as long as the agent runs
    exit_without_teardown(0)


def slurm_stores(host: str, port: int, env: MutableMapping[str, str]) -> tuple[str, Any]:
    """This node's address on the route to HOST, set as where its rank 0's store binds (`env`, which the ranks
    inherit), and, on the allocation's first node, the rendezvous store served on HOST's address and PORT only."""
    import socket

    from appliance.parallel.store import STORE_BIND_ENV, listening_socket, serve_store
    from appliance.train.nodes import address_toward

    local = address_toward(host, port, "the rendezvous host")
    env[STORE_BIND_ENV] = local
    if env.get(SLURM_NODE_ENV) != "0":
        return local, None
    bind = str(socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][4][0])
    return local, serve_store(listening_socket(bind, port), bind, timeout=STORE_TIMEOUT)


if __name__ == "__main__":
    main()
