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
"""

from __future__ import annotations

import os
import sys
from datetime import timedelta
from pathlib import Path

from appliance.output_dirs import restrict_umask
from appliance.process_exit import exit_without_teardown

HOST_RENDEZVOUS = "--host-rendezvous"
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


if __name__ == "__main__":
    main()
