"""torch's TCPStore, listening on one address only.

A store is the key-value server processes meet at: the elastic agents' rendezvous store, and the store each launch's
process group forms on (rank 0 serves it, from MASTER_ADDR and MASTER_PORT). torch's TCPStore server binds every
interface (`*:PORT`) whatever host it is given; handed the descriptor of a socket already listening
(`master_listen_fd`), it serves that socket instead. Every store the appliance starts is served so:

- one node: 127.0.0.1, the agent's rendezvous store (train/agent.py) and rank 0's (`ranks_init_method`);
- several nodes: the rendezvous store on the `--master` address (train/nodes.py), rank 0's on the address its node's
  agent gave the rendezvous, which torch hands every rank as MASTER_ADDR (train/nodes.py `local_address`).

No store authenticates anyone: whoever reaches its port can read and write its keys (torch's SECURITY.md: internal
networks only). The address it listens on is what keeps the rest of the network out.
"""

from __future__ import annotations

import functools
import os
import socket
from collections.abc import Iterator, Mapping
from datetime import timedelta
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from torch.distributed import Store, TCPStore

LOOPBACK = "127.0.0.1"
# Where rank 0 of a launch binds its process group's store: set by the launcher (train/launch.py) for the ranks.
STORE_BIND_ENV = "BLOOM_STORE_BIND"
# init_process_group's init_method for those ranks: torch's env:// (MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE),
# with rank 0's store listening on STORE_BIND_ENV's address only.
BOUND_ENV_SCHEME = "bound-env"


def listening_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to HOST:PORT only (port 0: a free one, which the kernel picks) and listening; OSError when
    HOST is no address of this machine or the port is taken."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
        sock.listen(1024)
    except OSError:
        sock.close()
        raise
    return sock


def serve_store(sock: socket.socket, client_host: str, *, timeout: timedelta) -> TCPStore:
    """torch's store server on `sock`, which it owns from then on (it closes it when the store goes away).
    `client_host`: where this process's own client of the store connects (the address the others are given)."""
    from torch.distributed import TCPStore

    store = TCPStore(
        client_host,
        sock.getsockname()[1],
        is_master=True,
        wait_for_workers=False,
        timeout=timeout,
        master_listen_fd=sock.fileno(),
    )
    sock.detach()
    return store


def ranks_init_method(env: Mapping[str, str] | None = None) -> str | None:
    """The ranks' init_method: `bound-env://` where the launcher named rank 0's store address (STORE_BIND_ENV), else
    None (torch's env://, whose store on rank 0 listens on every interface: a launch by other means)."""
    if not (os.environ if env is None else env).get(STORE_BIND_ENV):
        return None
    _register_bound_env()
    return f"{BOUND_ENV_SCHEME}://"


@functools.cache
def _register_bound_env() -> None:
    from torch.distributed import register_rendezvous_handler

    register_rendezvous_handler(BOUND_ENV_SCHEME, _bound_env_rendezvous)


def _bound_env_rendezvous(
    url: str, timeout: timedelta = timedelta(minutes=10), **kwargs: Any
) -> Iterator[tuple[Store, int, int]]:
    """torch's env:// rendezvous (the same variables), except where rank 0's store listens."""
    from torch.distributed import TCPStore

    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    master, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    if rank == 0:
        store = serve_store(listening_socket(os.environ[STORE_BIND_ENV], port), master, timeout=timeout)
    else:
        store = TCPStore(master, port, is_master=False, timeout=timeout)
    yield store, rank, world_size
    raise RuntimeError(f"{BOUND_ENV_SCHEME}:// rendezvous happens once per process group")


def loopback_interface() -> str:
    """The loopback interface's name (GLOO_SOCKET_IFNAME pins gloo's connections to it): lo on Linux, lo0 on macOS."""
    names = {name for _, name in socket.if_nameindex()}
    return "lo" if "lo" in names else "lo0"
