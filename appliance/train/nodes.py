"""Several machines without SLURM: which node this is, where the rendezvous is, and the rendezvous store itself.

`run` and `train` take `--nnodes N --node-rank R --master HOST:PORT`, or `--hostfile FILE` (one host a line; the
first is the master, this host's line its rank unless --node-rank says). Every node runs the same command; each
starts one elastic agent for its share of the plan's ranks (tp x pp x dp / N), and the agents meet at a c10d
rendezvous at HOST:PORT. `--nnodes MIN:MAX`: the plan's ranks divide over MAX nodes, and the agents carry on with
as few as MIN when a node is lost (the ranks re-plan dp: appliance/train/elastic.py); with --hostfile, MAX is its
line count.

`--spares K`: K more nodes run the same command (node ranks N..N+K-1, or the hostfile's last K lines) and stand by
outside the rendezvous, in a process that imports no torch (appliance/train/standby.py): the agents meet as the N
training nodes (`--nnodes MIN:N`), and when one is lost the first spare in line starts its agent, which joins them
as they re-form, and takes the lost node's ranks.

`--store-elsewhere`: the store runs on a machine that does not train (`python -m appliance.train.nodes --host-store
HOST:PORT` there), every node's launcher, node 0's included, joins it as a client, and losing node 0 is then a
node loss like any other.

Who hosts the rendezvous: on node 0, a small process that runs the agent as its child, not the agent. torch's
TCPStore server listens on every interface (`*:PORT`) whatever host it is given; this process binds the listening
socket itself, to HOST only, and hands it to the store (`master_listen_fd`, parallel/store.py); every agent, node
0's included, joins as a client (`is_host=false`). HOST is the address the user names: 127.0.0.1 reaches nothing
outside the machine, 0.0.0.0 listens everywhere, and only when written so. The store lives exactly as long as node
0's agent, which outlives the head as on one node.

The ranks' own store: the rendezvous gives every rank the address of the node it ranks first (its agent's
--local-addr) as MASTER_ADDR and a free port there as MASTER_PORT, and rank 0 serves the process group's store on
that address only (`store_bind_host`). A node's address is PET_LOCAL_ADDR when set, else the address the machine
reaches the master from (`local_address`), so the ranks meet on the network the user named; where a node's --master
is the wildcard, torch's default (the machine's FQDN) and a rank 0 store on every interface, as asked.

Files: the run directory must be one directory on a file system every node mounts (as under SLURM). Node 0 runs
the data stages; the other nodes wait for them (the stage records in stages.json) and read the same plan, data
and checkpoints; every rank writes its events to the same metrics.jsonl, so node 0's dashboard sees every node.
"""

from __future__ import annotations

import contextlib
import errno
import ipaddress
import os
import socket
import subprocess
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

from appliance.errors import BadInput
from appliance.parallel.store import listening_socket, serve_store

DEFAULT_PORT = 29500
# A node other than 0 may start before node 0 has its rendezvous up (or before its data stages end): how long it
# keeps trying the master before the run is refused as unreachable (BLOOM_MASTER_WAIT_S overrides it).
MASTER_WAIT_S = 120.0
MASTER_WAIT_ENV = "BLOOM_MASTER_WAIT_S"

# The name a node's gpu and energy samples carry (appliance/rank/worker.py): the host alone names a node when it
# runs the only agent of the machine, not when simulated nodes share one.
NODE_NAME_ENV = "BLOOM_NODE_NAME"
# Set ("MIN:MAX") for the ranks of agents started with --nnodes MIN:MAX: they may re-plan for a smaller world
# (appliance/train/elastic.py); the ranks of any other launch keep the plan's layout. train/launch.py sets both.
ELASTIC_ENV = "BLOOM_ELASTIC_NODES"


@dataclass(frozen=True)
class NodeGroup:
    """This node's place among `nnodes`; validated on creation, each error naming its flag."""

    nnodes: int  # the most nodes (MAX of --nnodes MIN:MAX): the plan's ranks divide over this many
    node_rank: int
    master_host: str
    master_port: int
    min_nodes: int | None = None  # MIN of --nnodes MIN:MAX: the agents carry on with as few (None: all of nnodes)
    spares: int = (
        0  # --spares K: nodes beyond nnodes that stand by, outside the rendezvous, to take a lost node's ranks
    )
    store_elsewhere: bool = False  # --store-elsewhere: the store at --master runs on a machine that does not train

    def __post_init__(self) -> None:
        if self.nnodes < 1:
            raise BadInput(f"--nnodes {self.nnodes}: must be at least 1")
        if self.spares < 0:
            raise BadInput(f"--spares {self.spares}: must be 0 or more")
        if self.min_nodes is not None and not 1 <= self.min_nodes <= self.nnodes:
            raise BadInput(f"--nnodes {self.min_nodes}:{self.nnodes}: MIN must be 1..MAX")
        if not 0 <= self.node_rank < self.total_nodes:
            last = self.total_nodes - 1
            given = f"--nnodes {self.nnodes}" + (f" --spares {self.spares}" if self.spares else "")
            raise BadInput(f"--node-rank {self.node_rank}: out of range for {given} (0..{last})")
        if not 0 < self.master_port < 65536:
            raise BadInput(f"--master {self.master}: port {self.master_port} is not a TCP port (1..65535)")

    @property
    def master(self) -> str:
        host = f"[{self.master_host}]" if ":" in self.master_host else self.master_host
        return f"{host}:{self.master_port}"

    @property
    def total_nodes(self) -> int:
        """The agents of the run: the plan's nodes and the spares."""
        return self.nnodes + self.spares

    @property
    def elastic(self) -> bool:
        """The agents re-form without a lost node (and with it again when it comes back)."""
        return self.spares > 0 or (self.min_nodes is not None and self.min_nodes < self.nnodes)

    @property
    def agent_nnodes(self) -> str:
        """torch.distributed.run's --nnodes: N, or MIN:MAX; MAX is the training nodes' count (a spare is no member
        of the rendezvous until it takes a lost node's place)."""
        if not self.elastic:
            return str(self.nnodes)
        return f"{self.min_nodes or self.nnodes}:{self.nnodes}"

    @property
    def is_head(self) -> bool:
        return self.node_rank == 0

    @property
    def hosts_store(self) -> bool:
        """This node's launcher hosts the rendezvous store (node 0, unless it runs elsewhere)."""
        return self.is_head and not self.store_elsewhere

    def ranks_per_node(self, world_size: int, source: str) -> int:
        """The plan's ranks divided over the nodes, or BadInput naming both numbers."""
        if world_size % self.nnodes:
            raise BadInput(
                f"{source}: the plan's tp x pp x dp = {world_size} ranks do not divide over --nnodes {self.nnodes}"
                f" (use a node count that divides {world_size}, or re-plan with `train --layout`)"
            )
        return world_size // self.nnodes

    def node_name(self) -> str:
        """How this node's samples (gpu, energy events) name it: the host, and the rank where nodes share a host."""
        return f"{socket.gethostname()}/node{self.node_rank}"


def parse_nnodes(text: str | None) -> tuple[int | None, int | None]:
    """--nnodes N or MIN:MAX as (MIN or None, MAX); (None, None) when not given."""
    if text is None:
        return None, None
    low, sep, high = text.partition(":")
    if not (high if sep else low).strip().isdigit() or (sep and not low.strip().isdigit()):
        raise BadInput(f"--nnodes {text!r}: expected N or MIN:MAX, e.g. 3 or 2:3")
    if not sep:
        return None, int(low)
    return int(low), int(high)


def parse_master(text: str, flag: str = "--master") -> tuple[str, int]:
    """HOST:PORT (or [IPv6]:PORT) into its parts; the host must resolve."""
    host, sep, port = text.rpartition(":")
    host = host.strip("[]")
    if not sep or not host or not port.isdigit():
        raise BadInput(f"{flag} {text!r}: expected HOST:PORT, e.g. 10.0.0.1:{DEFAULT_PORT}")
    try:
        socket.getaddrinfo(host, int(port), type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError) as e:
        raise BadInput(f"{flag} {text}: cannot resolve {host!r} ({e})") from None
    return host, int(port)


def read_hostfile(path: Path) -> list[str]:
    """Hosts, one a line (`#` starts a comment; words after the host, like MPI's `slots=8`, are ignored)."""
    try:
        lines = path.read_text().splitlines()
    except OSError as e:
        raise BadInput(f"--hostfile {path}: {e.strerror}") from None
    hosts = [line.split("#", 1)[0].split()[0] for line in lines if line.split("#", 1)[0].strip()]
    if not hosts:
        raise BadInput(f"--hostfile {path}: no hosts in it")
    return hosts


def this_machines_names() -> set[str]:
    names = {socket.gethostname(), socket.getfqdn(), "localhost"}
    for name in list(names):
        with contextlib.suppress(socket.gaierror):
            names.update(str(info[4][0]) for info in socket.getaddrinfo(name, None))
    return names


def rank_in_hostfile(hosts: list[str], path: Path) -> int:
    here = this_machines_names()
    matches = [i for i, host in enumerate(hosts) if host in here]
    if len(matches) != 1:
        found = "none of its hosts" if not matches else f"lines {[i + 1 for i in matches]}"
        raise BadInput(
            f"--hostfile {path}: this machine ({socket.gethostname()}) is {found}; give --node-rank to say which"
        )
    return matches[0]


def node_group(
    *,
    nnodes: int | None,
    node_rank: int | None,
    master: str | None,
    hostfile: Path | None,
    min_nodes: int | None = None,
    spares: int = 0,
    store_elsewhere: bool = False,
) -> NodeGroup | None:
    """The flags as a NodeGroup, or None for the one-node default (no flag given). `min_nodes`: MIN of
    --nnodes MIN:MAX (`nnodes` is then MAX; with --hostfile, MAX must be its line count less the spares, which are
    its last `spares` lines)."""
    if hostfile is not None:
        hosts = read_hostfile(hostfile)
        if spares >= len(hosts):
            raise BadInput(f"--spares {spares}: --hostfile {hostfile} lists {len(hosts)} hosts, none left to train")
        if nnodes is not None and nnodes + spares != len(hosts):
            given = f"{min_nodes}:{nnodes}" if min_nodes is not None else str(nnodes)
            plus = f" + --spares {spares}" if spares else ""
            raise BadInput(f"--nnodes {given}{plus}: --hostfile {hostfile} lists {len(hosts)} hosts")
        rank = node_rank if node_rank is not None else rank_in_hostfile(hosts, hostfile)
        host, port = parse_master(master) if master else (hosts[0], DEFAULT_PORT)
        parse_master(f"{host}:{port}", flag=f"--hostfile {hostfile}: first host")
        return NodeGroup(
            nnodes=len(hosts) - spares,
            node_rank=rank,
            master_host=host,
            master_port=port,
            min_nodes=min_nodes,
            spares=spares,
            store_elsewhere=store_elsewhere,
        )
    if nnodes is None and node_rank is None and master is None:
        if spares or store_elsewhere:
            flag = f"--spares {spares}" if spares else "--store-elsewhere"
            raise BadInput(f"{flag}: needs --nnodes and --master (or --hostfile)")
        return None
    if nnodes is None or master is None:
        missing = " and ".join(f for f, v in (("--nnodes", nnodes), ("--master", master)) if v is None)
        raise BadInput(f"{missing}: needed with --node-rank/--nnodes/--master (or give --hostfile)")
    host, port = parse_master(master)
    if nnodes + spares > 1 and node_rank is None:
        given = f"--nnodes {nnodes}" + (f" --spares {spares}" if spares else "")
        raise BadInput(f"--node-rank: needed with {given} (0 on the master's machine)")
    return NodeGroup(
        nnodes=nnodes,
        node_rank=node_rank or 0,
        master_host=host,
        master_port=port,
        min_nodes=min_nodes,
        spares=spares,
        store_elsewhere=store_elsewhere,
    )


def _listening_socket(host: str, port: int, flag: str) -> socket.socket:
    """A socket bound to HOST:PORT only and listening, or BadInput naming `flag`."""
    try:
        return listening_socket(host, port)
    except OSError as e:
        why = (
            "is not an address of this machine (node 0 hosts the rendezvous)"
            if e.errno == errno.EADDRNOTAVAIL
            else f"cannot listen there: {e.strerror}"
        )
        raise BadInput(f"{flag} {host}:{port}: {why}") from None


# torch.distributed.run's variable for its --local-addr (simulated nodes on one machine take 127.0.0.1, .2, ...).
LOCAL_ADDR_ENV = "PET_LOCAL_ADDR"


def listens_everywhere(host: str) -> bool:
    """HOST is the wildcard address (0.0.0.0, ::): the user asked for every interface."""
    with contextlib.suppress(ValueError):
        return ipaddress.ip_address(host).is_unspecified
    return False


def address_toward(host: str, port: int, flag: str) -> str:
    """This machine's address on its route to HOST: the source address the kernel picks for it (connecting a
    datagram socket sends nothing), or BadInput naming `flag` when there is no route."""
    try:
        family, _, _, _, where = socket.getaddrinfo(host, port, type=socket.SOCK_DGRAM)[0]
        with socket.socket(family, socket.SOCK_DGRAM) as probe:
            probe.connect(where)
            return str(probe.getsockname()[0])
    except OSError as e:
        raise BadInput(f"{flag} {host}:{port}: no route from this machine ({e.strerror or e})") from None


def local_address(group: NodeGroup, env: Mapping[str, str] | None = None) -> str | None:
    """This node's address in the rendezvous (the agent's --local-addr). The node the rendezvous ranks first gives
    its address to every rank as MASTER_ADDR, and its rank 0 serves the process group's store there: PET_LOCAL_ADDR
    when set; else the address this machine reaches the master from, on the network the user named; None where
    --master is the wildcard (torch then gives this machine's FQDN)."""
    env = os.environ if env is None else env
    if env.get(LOCAL_ADDR_ENV):
        return env[LOCAL_ADDR_ENV]
    if listens_everywhere(group.master_host):
        return None
    return address_toward(group.master_host, group.master_port, "--master")


def store_bind_host(group: NodeGroup, env: Mapping[str, str] | None = None) -> str:
    """Where rank 0's process-group store listens when the rendezvous ranks this node first: the node's local
    address, or every interface where this node's --master is the wildcard."""
    local = local_address(group, env)
    return group.master_host if local is None else local


def check_master_here(group: NodeGroup) -> None:
    """Node 0, before anything starts: the master address is this machine's and its port is free."""
    _listening_socket(group.master_host, group.master_port, "--master").close()


def store_host_command(group: NodeGroup, agent: list[str], python: str = sys.executable) -> list[str]:
    """Node 0's agent, run under the process that hosts the rendezvous store for exactly the agent's life: the
    store outlives the head as the agent does (a dropped ssh session stops neither)."""
    return [python, "-m", "appliance.train.nodes", "--host-store", group.master, "--", *agent]


def host_store_while(host: str, port: int, command: list[str] | None) -> int:
    """Serve the c10d store on HOST:PORT only while `command` runs (its exit code), or, without one, until the
    process is stopped (SIGINT: 0; SIGTERM ends it): a store on a machine that does not train (--store-elsewhere)."""
    store = serve_store(_listening_socket(host, port, "--master"), host, timeout=timedelta(seconds=600))
    try:
        if command:
            return subprocess.call(command)
        print(f"rendezvous store on {host}:{port}; Ctrl-C ends it", flush=True)
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        return 0
    finally:
        del store


def main(argv: list[str] | None = None) -> int:
    """`--host-store HOST:PORT [-- AGENT COMMAND...]`: node 0's launcher runs its agent under it; alone, it is the
    store for runs started with --store-elsewhere, on any machine the nodes reach that does not train."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) < 2 or args[0] != "--host-store" or (len(args) > 2 and (args[2] != "--" or len(args) < 4)):
        raise SystemExit("usage: python -m appliance.train.nodes --host-store HOST:PORT [-- AGENT COMMAND...]")
    host, port = parse_master(args[1])
    return host_store_while(host, port, args[3:] or None)


def wait_for_master(group: NodeGroup, *, wait_s: float | None = None) -> None:
    """A node other than 0: returns once the master accepts connections, or BadInput naming --master."""
    wait_s = wait_s if wait_s is not None else float(os.environ.get(MASTER_WAIT_ENV, MASTER_WAIT_S))
    deadline = time.monotonic() + wait_s
    while True:
        try:
            with socket.create_connection((group.master_host, group.master_port), timeout=5):
                return
        except OSError as e:
            if time.monotonic() > deadline:
                raise BadInput(
                    f"--master {group.master}: unreachable for {wait_s:.0f} s ({e.strerror or e});"
                    " is node 0 started with the same --master?"
                ) from None
            time.sleep(1.0)


if __name__ == "__main__":
    sys.exit(main())
