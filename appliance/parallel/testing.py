"""Run a function on N gloo ranks on this machine: the one helper every multi-process test uses.

    results = run_distributed(check_layers, 2, 1e-5, tp=2)   # fn(topology, 1e-5) on ranks 0 and 1

Each rank is a fresh spawned process (no inherited state) with one CPU thread, a gloo process group and a
``ParallelTopology`` whose process groups already exist; ``fn(topology, *args)`` must be a module-level
function. Nothing listens beyond loopback: this process hosts the rendezvous store on a socket bound to
127.0.0.1 (port chosen by the kernel, so no race for a free port), and gloo is pinned to the loopback
interface. Return values come back in rank order; a rank that raises makes the whole call raise with that
rank's traceback, after the other ranks are stopped.
"""

from __future__ import annotations

import datetime
import io
import os
import queue
import socket
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from appliance.parallel.topology import ParallelTopology

_GRACE_S = 2.0  # how long to wait for the other ranks' reports once one rank has failed


class DistributedRunError(RuntimeError):
    """A rank raised, died, or did not finish in time."""


def _loopback_interface() -> str:
    names = {name for _, name in socket.if_nameindex()}
    return "lo" if "lo" in names else "lo0"


def _dumps(value: Any) -> bytes:
    # torch.save into bytes: tensors travel by value, with no shared memory tied to the rank's lifetime.
    buffer = io.BytesIO()
    torch.save(value, buffer)
    return buffer.getvalue()


def _worker(
    rank: int,
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    layout: tuple[int, int, int, int],
    port: int,
    timeout_s: float,
    results: Any,
) -> None:
    tp, pp, dp, world_size = layout
    report: tuple[int, bool, bytes | str, float]
    try:
        os.environ["GLOO_SOCKET_IFNAME"] = _loopback_interface()
        torch.set_num_threads(1)  # ranks share a few cores; more threads per rank only contend
        timeout = datetime.timedelta(seconds=timeout_s)
        store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timeout)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size, timeout=timeout)
        try:
            topology = ParallelTopology(tp=tp, pp=pp, dp=dp, world_size=world_size)
            topology.init_process_groups()
            report = (rank, True, _dumps(fn(topology, *args)), time.time())
        except BaseException:
            # Time-stamped before our connections close: the peers fail only after that.
            report = (rank, False, traceback.format_exc(), time.time())
        finally:
            dist.destroy_process_group()
    except BaseException:
        report = (rank, False, traceback.format_exc(), time.time())
    results.put(report)


def _raise_first_failure(results: Any, world_size: int, first: tuple[int, str, float]) -> None:
    """Raise with the traceback of the rank that failed first.

    One rank's exception closes its connections, so its peers fail a moment later inside a collective
    ("connection closed by peer"), and their reports can arrive first. Wait briefly for the others and
    name the earliest failure: that is the cause, the rest are consequences.
    """
    failures = [first]
    grace = time.monotonic() + _GRACE_S
    while len(failures) < world_size and time.monotonic() < grace:
        try:
            rank, ok, payload, when = results.get(timeout=0.1)
        except queue.Empty:
            continue
        if not ok:
            failures.append((rank, payload, when))
    failures.sort(key=lambda failure: failure[2])
    rank, payload, _ = failures[0]
    message = f"rank {rank} of {world_size} failed:\n{payload}"
    if len(failures) > 1:
        message += f"(then rank(s) {sorted(f[0] for f in failures[1:])} failed too, most likely in consequence)"
    raise DistributedRunError(message)


def run_distributed(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    tp: int = 1,
    pp: int = 1,
    dp: int = 1,
    timeout_s: float = 120.0,
) -> list[Any]:
    """Call ``fn(topology, *args)`` on ``world_size`` spawned gloo ranks; return their results by rank."""
    ParallelTopology(tp=tp, pp=pp, dp=dp, world_size=world_size)  # a bad layout fails here, before spawning
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    port = listener.getsockname()[1]
    # The store's server takes the socket over (and closes it when the store goes away).
    store = dist.TCPStore(
        "127.0.0.1",
        port,
        is_master=True,
        wait_for_workers=False,
        master_listen_fd=listener.detach(),
        timeout=datetime.timedelta(seconds=timeout_s),
    )
    results = mp.get_context("spawn").Queue()
    context = mp.start_processes(
        _worker,
        args=(fn, args, (tp, pp, dp, world_size), port, timeout_s, results),
        nprocs=world_size,
        join=False,
        start_method="spawn",
    )
    values: dict[int, Any] = {}
    deadline = time.monotonic() + timeout_s
    try:
        while len(values) < world_size:
            try:
                rank, ok, payload, when = results.get(timeout=0.2)
            except queue.Empty:
                _check_alive(context.processes, values, deadline, timeout_s)
                continue
            if not ok:
                _raise_first_failure(results, world_size, (rank, payload, when))
            values[rank] = torch.load(io.BytesIO(payload), weights_only=False)
        for process in context.processes:
            process.join(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        for process in context.processes:
            if process.is_alive():
                process.terminate()
                process.join(timeout=5)
        results.close()
        del store
    return [values[rank] for rank in range(len(values))]


def _check_alive(processes: list[Any], reported: dict[int, Any], deadline: float, timeout_s: float) -> None:
    dead = [rank for rank, p in enumerate(processes) if p.exitcode not in (None, 0) and rank not in reported]
    if dead:
        codes = [processes[rank].exitcode for rank in dead]
        raise DistributedRunError(f"rank(s) {dead} died with exit code(s) {codes} before reporting")
    if time.monotonic() > deadline:
        missing = sorted(set(range(len(processes))) - set(reported))
        raise DistributedRunError(f"rank(s) {missing} did not finish within {timeout_s:.0f} s")
