"""Every store listens where the user said: loopback on one node, the --master network on several.

The stores (the agent's rendezvous store, rank 0's process-group store) authenticate no one, and torch's TCPStore
server listens on every interface unless handed a socket already bound (appliance/parallel/store.py). Here: the
/proc reader the checks use sees a socket bound to every interface (its positive control); a one-node agent with
one trivial rank holds both stores, and every listening socket of that process tree is on loopback; the multi-node
launcher's addresses. A real training run's sockets are read in tests/e2e/test_preemption.py (one node) and
tests/distributed/test_multinode.py (two nodes), whose launches these checks share.
"""

from __future__ import annotations

import ipaddress
import os
import socket
import subprocess
import textwrap
import time
from pathlib import Path

import pytest
from listening_sockets import decode_address, listeners

from appliance.parallel.store import LOOPBACK, STORE_BIND_ENV, ranks_init_method
from appliance.train.launch import GLOO_INTERFACE_ENV, NCCL_INTERFACE_ENV, WORKER_MODULE, agent_command, worker_env
from appliance.train.nodes import NodeGroup, local_address, store_bind_host


def _listening(host: str) -> socket.socket:
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.bind((host, 0))
    sock.listen()
    return sock


def test_the_proc_reader_sees_a_socket_on_every_interface_and_one_on_loopback() -> None:
    with _listening("0.0.0.0") as everywhere, _listening(LOOPBACK) as loopback:
        found = {(str(s.address), s.port): s for s in listeners([os.getpid()])}
        wild = found[("0.0.0.0", everywhere.getsockname()[1])]
        local = found[(LOOPBACK, loopback.getsockname()[1])]
        assert wild.everywhere and not wild.loopback
        assert local.loopback and not local.everywhere
    assert not {s.port for s in listeners([os.getpid()])} & {wild.port, local.port}  # closed: gone


@pytest.mark.skipif(not socket.has_ipv6, reason="no IPv6 on this machine")
def test_the_proc_reader_decodes_ipv6_wildcards_and_mapped_addresses() -> None:
    with _listening("::") as everywhere:
        (wild,) = [s for s in listeners([os.getpid()]) if s.port == everywhere.getsockname()[1]]
        assert wild.everywhere
    # /proc/net/tcp6 writes each 32-bit word in host order: ::ffff:127.0.0.1 and ::ffff:0.0.0.0
    assert decode_address("0000000000000000FFFF00000100007F") == ipaddress.ip_address("::ffff:127.0.0.1")
    assert decode_address("0100007F") == ipaddress.ip_address("127.0.0.1")
    assert decode_address("0000000000000000FFFF000000000000") == ipaddress.ip_address("::ffff:0.0.0.0")


# A rank that forms its process group as the worker does (its init_method: parallel/store.py), says so, and waits.
RANK = textwrap.dedent(
    """
    import os, sys, time
    from pathlib import Path
    import torch.distributed as dist
    from appliance.parallel.store import ranks_init_method

    dist.init_process_group("gloo", init_method=ranks_init_method())
    Path(sys.argv[1], "formed").write_text(os.environ["MASTER_ADDR"] + " " + os.environ["MASTER_PORT"])
    while not Path(sys.argv[1], "done").exists():
        time.sleep(0.05)
    dist.destroy_process_group()
    """
)


def test_a_one_node_launch_listens_on_loopback_only(tmp_path: Path) -> None:
    """The launcher's agent command and rank environment, one rank: the agent's rendezvous store, rank 0's store and
    gloo all listen on loopback, and nowhere else."""
    script = tmp_path / "rank.py"
    script.write_text(RANK)
    cmd = agent_command(tmp_path, nproc_per_node=1, max_restarts=0)
    cmd = [*cmd[: cmd.index(WORKER_MODULE) - 1], str(script), str(tmp_path)]  # this rank instead of the worker's
    env = worker_env(store_bind=LOOPBACK) | {"OMP_NUM_THREADS": "1"}
    agent = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 120
        while not (tmp_path / "formed").exists():
            assert agent.poll() is None, agent.communicate()[0][-3000:]
            assert time.monotonic() < deadline, "the rank did not form its process group"
            time.sleep(0.1)
        found = listeners([agent.pid])
        (tmp_path / "done").touch()
        assert agent.wait(timeout=60) == 0, agent.communicate()[0][-3000:]
    finally:
        agent.kill()
    master_addr, master_port = (tmp_path / "formed").read_text().split()
    assert master_addr == LOOPBACK  # what the agent gives the ranks
    described = sorted(map(str, found))
    assert any("appliance.train.agent" in s.command for s in found), described  # the rendezvous store
    assert any(s.port == int(master_port) and str(script) in s.command for s in found), described  # rank 0's
    assert all(s.loopback for s in found), f"listening beyond loopback: {described}"


def test_a_rank_without_a_named_address_keeps_torchs_own_store() -> None:
    """A launch by other means (a hand-run torchrun) names no address: torch's env:// as before."""
    assert ranks_init_method({}) is None
    assert ranks_init_method({STORE_BIND_ENV: LOOPBACK}) == "bound-env://"


def test_one_node_ranks_get_loopback_for_their_store_and_gloo() -> None:
    env = worker_env({}, store_bind=LOOPBACK)
    assert env[STORE_BIND_ENV] == LOOPBACK and env[GLOO_INTERFACE_ENV] in ("lo", "lo0")
    assert env[NCCL_INTERFACE_ENV] == env[GLOO_INTERFACE_ENV]  # NCCL's bootstrap on a GPU node, likewise
    assert worker_env({GLOO_INTERFACE_ENV: "ib0"}, store_bind=LOOPBACK)[GLOO_INTERFACE_ENV] == "ib0"  # the user's
    several = worker_env({}, store_bind="10.1.2.3")
    assert several[STORE_BIND_ENV] == "10.1.2.3" and GLOO_INTERFACE_ENV not in several
    assert NCCL_INTERFACE_ENV not in several
    cmd = agent_command(Path("/r"), nproc_per_node=2, max_restarts=0)
    assert "--standalone" not in cmd and f"--local-addr={LOOPBACK}" in cmd and "--rdzv-conf=is_host=false" in cmd


def _node(master: str, rank: int = 1) -> NodeGroup:
    return NodeGroup(nnodes=2, node_rank=rank, master_host=master, master_port=29500)


def test_several_nodes_meet_on_the_network_of_the_master() -> None:
    """A node's rendezvous address, which is where rank 0's store listens when that node ranks first: the address
    this machine reaches --master from; PET_LOCAL_ADDR when set; the wildcard where --master names it."""
    assert local_address(_node(LOOPBACK), {}) == LOOPBACK == store_bind_host(_node(LOOPBACK), {})
    assert local_address(_node(LOOPBACK), {"PET_LOCAL_ADDR": "127.0.0.3"}) == "127.0.0.3"
    assert store_bind_host(_node(LOOPBACK), {"PET_LOCAL_ADDR": "127.0.0.3"}) == "127.0.0.3"
    assert local_address(_node("0.0.0.0", rank=0), {}) is None  # torch's default address: the machine's FQDN
    assert store_bind_host(_node("0.0.0.0", rank=0), {}) == "0.0.0.0"  # every interface, as the user wrote
    cmd = agent_command(
        Path("/r"), nproc_per_node=1, max_restarts=0, nnodes=2, rdzv_endpoint="h:1", local_addr="10.0.0.2"
    )
    assert "--local-addr=10.0.0.2" in cmd and "--rdzv-endpoint=h:1" in cmd


def test_under_slurm_the_first_node_hosts_the_rendezvous_on_the_allocations_address_only(tmp_path: Path) -> None:
    """The batch script's agent words (train/slurm.py): `--slurm-rendezvous "$MASTER_ADDR" 29500` and is_host=false
    on every node. Here one node of such a job, SLURM_NODEID 0, its first node's name resolving to loopback: the
    rendezvous store on that address and port, rank 0's store on the node's address toward it, nothing elsewhere."""
    from appliance.train.agent import SLURM_RENDEZVOUS
    from appliance.train.launch import AGENT_MODULE, FRESH_STORE_ENV
    from appliance.train.slurm import SlurmJob, sbatch_script

    script = sbatch_script(SlurmJob(run_dir=tmp_path / "run", nodes=2, gpus_per_node=1, cpus_per_task=1), corpus=[])
    (srun,) = [line for line in script.splitlines() if line.startswith("srun ")]
    assert f'{SLURM_RENDEZVOUS} "$MASTER_ADDR" 29500' in srun and "--rdzv-conf=is_host=false" in srun
    with _listening(LOOPBACK) as probe:
        port = probe.getsockname()[1]
    rank = tmp_path / "rank.py"
    rank.write_text(RANK)
    cmd = agent_command(
        tmp_path,
        nproc_per_node=1,
        max_restarts=0,
        nnodes=1,
        rdzv_endpoint=f"localhost:{port}",
        store_hosted_elsewhere=True,
    )
    at = cmd.index(AGENT_MODULE) + 1
    cmd[at:at] = [SLURM_RENDEZVOUS, "localhost", str(port)]
    cmd = [*cmd[: cmd.index(WORKER_MODULE) - 1], str(rank), str(tmp_path)]
    env = {k: v for k, v in os.environ.items() if k != STORE_BIND_ENV} | {"SLURM_NODEID": "0", "OMP_NUM_THREADS": "1"}
    env[GLOO_INTERFACE_ENV] = "lo"
    env[FRESH_STORE_ENV] = "1"  # as the batch script exports it
    agent = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 120
        while not (tmp_path / "formed").exists():
            assert agent.poll() is None, agent.communicate()[0][-3000:]
            assert time.monotonic() < deadline, "the rank did not form its process group"
            time.sleep(0.1)
        found = listeners([agent.pid])
        (tmp_path / "done").touch()
        assert agent.wait(timeout=60) == 0, agent.communicate()[0][-3000:]
    finally:
        agent.kill()
    master_addr, master_port = (tmp_path / "formed").read_text().split()
    assert master_addr == LOOPBACK  # the node's own address toward the first node, given to the ranks
    described = sorted(map(str, found))
    assert any(s.port == port and "appliance.train.agent" in s.command for s in found), described
    assert any(s.port == int(master_port) and str(rank) in s.command for s in found), described
    assert all(s.loopback for s in found), f"listening beyond the first node's address: {described}"
