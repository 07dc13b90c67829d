"""PyTorch's elastic agent (`torch.distributed.run`, unchanged: its arguments, rendezvous, restarts and errors), which
leaves without the interpreter's teardown once its ranks have finished (appliance/process_exit.py: ~1 s of every
train stage's end). The launcher runs it as `python -m appliance.train.agent <torch.distributed.run's arguments>`.

One node: `--host-rendezvous HOST` before those arguments. This process then hosts the c10d rendezvous store itself,
on HOST (127.0.0.1) and a port the kernel picks, and the agent joins it as a client (`--rdzv-conf=is_host=false` in
the arguments): torch's own `--standalone` store listens on every interface (parallel/store.py). The store lives
exactly as long as the agent.
"""

from __future__ import annotations

import sys
from datetime import timedelta

from appliance.output_dirs import restrict_umask
from appliance.process_exit import exit_without_teardown

HOST_RENDEZVOUS = "--host-rendezvous"
# The rendezvous store's own client waits this long for a reply (nodes.py's store host waits as long).
STORE_TIMEOUT = timedelta(seconds=600)


def main(argv: list[str] | None = None) -> None:
    from torch.distributed.run import main as run_agent

    restrict_umask()  # under SLURM no command line starts the agent: its ranks' logs and files get the modes here
    args = sys.argv[1:] if argv is None else argv
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
    del store  # held until here: it serves the rendezvous for as long as the agent runs
    exit_without_teardown(0)


if __name__ == "__main__":
    main()
