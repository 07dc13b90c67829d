"""Run a function on N gloo ranks on this machine: the one helper every multi-process test uses.

    results = run_distributed(check_layers, 2, 1e-5, tp=2)   # fn(topology, 1e-5) on ranks 0 and 1

Inside ``fn``, ``build_test_engine`` builds the engine with a test's usual settings, so a test names only what it
varies.

Each rank is a fresh spawned process (no inherited state) with one CPU thread, a gloo process group and a
``ParallelTopology`` whose process groups already exist; ``fn(topology, *args)`` must be a module-level
function. The ranks run on the CPU whatever the host has: they start with DeepSpeed's accelerator pinned to the CPU
and no CUDA device visible, so on a GPU host they do not all land on cuda:0. In each rank a ``CollectiveGuard``
checks that every tensor handed to a torch.distributed collective or point-to-point call is on ``device`` (the
device the engine reports; cpu here), and counts the calls; ``collective_guard()`` returns it inside ``fn``.

Nothing listens beyond loopback: this process hosts the rendezvous store on a socket bound to 127.0.0.1 (port
chosen by the kernel, so no race for a free port), and gloo is pinned to the loopback interface. Return values
come back in rank order; a rank that raises makes the whole call raise with that rank's traceback, after the
other ranks are stopped.
"""

from __future__ import annotations

import contextlib
import datetime
import functools
import io
import os
import queue
import sys
import threading
import time
import traceback
from collections import Counter
from collections.abc import Callable, Iterator, Mapping
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed import distributed_c10d

from appliance.errors import BadInput
from appliance.parallel.store import listening_socket, loopback_interface, serve_store
from appliance.parallel.topology import ParallelTopology
from appliance.planner.layout import Layout
from appliance.planner.train_settings import TrainSettings

if TYPE_CHECKING:
    from pathlib import Path

    from appliance.hardware.profile import Hardware
    from appliance.model.config import BloomConfig
    from appliance.parallel.step.engine import ParallelEngine

_GRACE_S = 2.0  # how long to wait for the other ranks' reports once one rank has failed

# Read when a rank starts, before torch or DeepSpeed choose an accelerator (DeepSpeed picks one at import, from
# DS_ACCELERATOR or else from what torch.cuda sees), so they have to be in the environment the rank is spawned with.
RANK_ENVIRONMENT = {"DS_ACCELERATOR": "cpu", "CUDA_VISIBLE_DEVICES": ""}

# torch.distributed's calls that move tensors between ranks. Old and new names both: torch 2.13 renamed
# all_gather_into_tensor / reduce_scatter_tensor to *_single and the old names now call the new ones, and
# DeepSpeed still calls the old names.
GUARDED_CALLS = (
    "all_reduce",
    "all_reduce_coalesced",
    "reduce",
    "broadcast",
    "all_gather",
    "all_gather_into_tensor",
    "all_gather_single",
    "_all_gather_base",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "reduce_scatter_single",
    "_reduce_scatter_base",
    "all_to_all",
    "all_to_all_single",
    "gather",
    "scatter",
    "send",
    "recv",
    "isend",
    "irecv",
    "batch_isend_irecv",
)


class DistributedRunError(RuntimeError):
    """A rank raised, died, or did not finish in time."""


class WrongDeviceError(RuntimeError):
    """A tensor handed to a collective is not on the device the ranks compute on."""


class CollectiveGuard:
    """Wraps torch.distributed's collectives and point-to-point calls in this process: every tensor handed to one
    must be on ``device``, else ``WrongDeviceError`` names the call, the tensor's device and its shape. Counts the
    calls by name (``calls``; a call made from inside another guarded call, such as all_gather_into_tensor calling
    all_gather_single, counts once, as the outer one).

    Every route to the collectives goes through a wrapper: torch.distributed's names, distributed_c10d's (which
    torch's own functions call one another through), and any module that bound one of them at import, like our
    tensor-parallel mappings (``_all_gather_single = dist.all_gather_single``). DeepSpeed's communication layer
    looks ``torch.distributed.<name>`` up at each call, except the two functions its backend object binds when
    it starts; those are rebound too when it has started already.
    """

    def __init__(self, device: torch.device | str) -> None:
        self.device = torch.device(device)
        self.calls: Counter[str] = Counter()
        self._nested = threading.local()
        self._wrappers: dict[int, Callable[..., Any]] = {}

    def install(self) -> None:
        for name in GUARDED_CALLS:
            original = getattr(distributed_c10d, name, None) or getattr(dist, name, None)
            if callable(original) and id(original) not in self._wrappers:
                self._wrappers[id(original)] = self._wrap(name, original)
        for module in list(sys.modules.values()):
            self._rebind(getattr(module, "__dict__", None), module)
        backend = getattr(sys.modules.get("deepspeed.comm.comm"), "cdb", None)
        if backend is not None:
            self._rebind(vars(backend), backend)

    def _rebind(self, namespace: Mapping[str, Any] | None, owner: Any) -> None:
        if not namespace:
            return
        for attribute, value in list(namespace.items()):
            wrapper = self._wrappers.get(id(value)) if callable(value) else None
            if wrapper is not None and wrapper.__wrapped__ is value:  # type: ignore[attr-defined]
                setattr(owner, attribute, wrapper)

    def _wrap(self, name: str, original: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(original)
        def guarded(*args: Any, **kwargs: Any) -> Any:
            if torch.compiler.is_dynamo_compiling():
                # Traced into a compiled block (parallelize.compile_blocks): the count and the nesting depth are
                # side effects a graph cannot hold, so the collective goes in unguarded and uncounted.
                return original(*args, **kwargs)
            for tensor in _tensors((args, kwargs)):
                if tensor.device != self.device:
                    raise WrongDeviceError(
                        f"torch.distributed.{name} was handed a tensor on {tensor.device} of shape "
                        f"{tuple(tensor.shape)}; this rank computes on {self.device}"
                    )
            depth = getattr(self._nested, "depth", 0)
            if depth == 0:
                self.calls[name] += 1
            self._nested.depth = depth + 1
            try:
                return original(*args, **kwargs)
            finally:
                self._nested.depth = depth

        return guarded


def _tensors(value: Any) -> Iterator[torch.Tensor]:
    """The tensors in a call's arguments: bare, in lists and dicts, and in P2POp objects."""
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, list | tuple):
        for item in value:
            yield from _tensors(item)
    elif isinstance(value, dict):
        for item in value.values():
            yield from _tensors(item)
    elif isinstance(value, dist.P2POp):
        yield value.tensor


_guard: CollectiveGuard | None = None


def collective_guard() -> CollectiveGuard:
    """The guard of this rank (inside a function run by ``run_distributed``)."""
    if _guard is None:
        raise RuntimeError("no collective guard in this process: only ranks started by run_distributed have one")
    return _guard


@contextlib.contextmanager
def _environment(values: Mapping[str, str]) -> Iterator[None]:
    """``values`` in os.environ for the block (a spawned process inherits the environment it starts with)."""
    before = {key: os.environ.get(key) for key in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for key, value in before.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def _dumps(value: Any) -> bytes:
    # torch.save into bytes: tensors travel by value, with no shared memory tied to the rank's lifetime.
    buffer = io.BytesIO()
    torch.save(value, buffer)
    return buffer.getvalue()


def harness_layout(tp: int, pp: int, dp: int, tp2d: int = 1) -> Layout:
    """The planner's Layout for the harness's degrees. Here ``tp`` counts the topology's tp axis, so with tp2d = q it
    is the q x q mesh (q * q ranks) and the Layout's own tp is 1; its micro-batch size is then q, the smallest the
    mesh rows can split (the ranks never read it: each test passes its own)."""
    if tp2d > 1:
        if tp != tp2d * tp2d:
            raise BadInput(
                f"parallel layout: tp2d({tp2d}) makes a {tp2d} x {tp2d} mesh of tp ranks, so tp must be "
                f"{tp2d * tp2d}, got tp({tp})"
            )
        return Layout(tp=1, pp=pp, dp=dp, tp2d=tp2d, micro_batch_size=tp2d)
    return Layout(tp=tp, pp=pp, dp=dp)


def _worker(
    rank: int,
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    layout: tuple[int, int, int, int, int],
    port: int,
    timeout_s: float,
    device: str,
    results: Any,
) -> None:
    global _guard
    tp, pp, dp, world_size, tp2d = layout
    report: tuple[int, bool, bytes | str, float]
    try:
        os.environ["GLOO_SOCKET_IFNAME"] = loopback_interface()
        torch.set_num_threads(1)  # ranks share a few cores; more threads per rank only contend
        timeout = datetime.timedelta(seconds=timeout_s)
        store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timeout)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size, timeout=timeout)
        try:
            topology = ParallelTopology.from_layout(harness_layout(tp, pp, dp, tp2d), world_size=world_size)
            topology.init_process_groups()
            _guard = CollectiveGuard(device)
            _guard.install()
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
    device: str = "cpu",
    tp2d: int = 1,
) -> list[Any]:
    """Call ``fn(topology, *args)`` on ``world_size`` spawned gloo ranks; return their results by rank.
    ``device``: where every tensor handed to a collective must be (the engine's device). ``tp2d = q``: the tp
    ranks (tp = q * q) form a q x q mesh (topology.py)."""
    # A bad layout fails here, before spawning.
    ParallelTopology.from_layout(harness_layout(tp, pp, dp, tp2d), world_size=world_size)
    listener = listening_socket("127.0.0.1", 0)
    port = listener.getsockname()[1]
    store = serve_store(listener, "127.0.0.1", timeout=datetime.timedelta(seconds=timeout_s))
    results = mp.get_context("spawn").Queue()
    with _environment(RANK_ENVIRONMENT):
        context = mp.start_processes(
            _worker,
            args=(fn, args, (tp, pp, dp, world_size, tp2d), port, timeout_s, device, results),
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


def build_test_engine(
    config: BloomConfig,
    topology: ParallelTopology,
    *,
    micro_batch_size: int,
    global_batch_size: int,
    zero_stage: int = 0,
    recompute: str = "none",
    sequence_parallel: bool = False,
    cp_mode: str = "ulysses",
    expert_disk_dir: Path | None = None,
    hardware: Hardware | None = None,
    step_engine: str = "auto",
    **settings: Any,
) -> ParallelEngine:
    """``build.build_engine`` for tests and benchmarks, which name only what they vary. The layout's keywords become
    the Layout of ``topology`` (``engine_layout``); ``settings`` are ``engine_settings``' keywords (precision,
    AdamW, clipping, seed, seq_len, compile, the expert budgets in bytes), with its defaults: fp32, AdamW with BLOOM's
    betas and eps and no weight decay at a constant lr of 1e-3, clipping at 1.0. ``hardware``, ``expert_disk_dir``
    and ``step_engine`` go to the engine as they are."""
    from appliance.parallel.step.build import build_engine  # DeepSpeed loads with it: only ranks that build pay

    layout = engine_layout(
        topology,
        micro_batch_size=micro_batch_size,
        global_batch_size=global_batch_size,
        zero_stage=zero_stage,
        recompute=recompute,
        sequence_parallel=sequence_parallel,
        cp_mode=cp_mode,
    )
    train = engine_settings(micro_batch_size=micro_batch_size, global_batch_size=global_batch_size, **settings)
    return build_engine(
        config,
        topology,
        layout,
        train,
        hardware=hardware,  # None: the MoE exchange's nodes are LOCAL_WORLD_SIZE ranks (experts/exchange.py)
        expert_disk_dir=expert_disk_dir,
        step_engine=step_engine,
    )


def engine_layout(topology: ParallelTopology, **fields: Any) -> Layout:
    """The Layout whose topology (``ParallelTopology.from_layout``) is ``topology``, with ``fields`` (batch sizes,
    ZeRO stage, recompute, sequence parallelism, cp_mode) set."""
    degrees = harness_layout(topology.tp, topology.pp, topology.dp, topology.tp2d)
    return replace(degrees, cp=topology.cp, ep=topology.ep, **fields)


def engine_settings(
    *,
    micro_batch_size: int,
    global_batch_size: int,
    dtype: str = "fp32",
    grad_clip: float = 1.0,
    lr: float = 1e-3,
    weight_decay: float = 0.0,
    betas: tuple[float, float] = (0.9, 0.95),
    eps: float = 1e-8,
    seed: int = 0,
    seq_len: int | None = None,
    overlap_param_gather: bool = TrainSettings.overlap_param_gather,
    compile: str = TrainSettings.compile,
    expert_device_budget_bytes: int = 0,
    expert_host_budget_bytes: int = 0,
) -> TrainSettings:
    """TrainSettings holding a test engine's keywords (build_test_engine's defaults). The engine reads only these; the
    schedule and intervals, which the trainer reads, are one constant-lr pass over one global batch.

    ``seq_len`` None: the length the MoE exchange's choice assumes when none is known (experts/exchange.py
    CHOICE_SEQUENCE), so a test that names none sizes the exchange as ``select_all_to_all`` does without one; the
    engine reads it for nothing else. The expert store's budgets are given in bytes, as the tests size them from an
    expert's bytes, and held in MiB as the settings hold them (``_mib``)."""
    from appliance.parallel.experts.exchange import CHOICE_SEQUENCE

    return TrainSettings(
        seq_len=CHOICE_SEQUENCE if seq_len is None else seq_len,
        global_batch_size=global_batch_size,
        micro_batch_size=micro_batch_size,
        train_samples=global_batch_size,
        lr=lr,
        min_lr=lr,
        warmup_samples=0,
        decay_samples=global_batch_size,
        weight_decay=weight_decay,
        grad_clip=grad_clip,
        adam_beta1=betas[0],
        adam_beta2=betas[1],
        adam_eps=eps,
        eval_interval=1,
        eval_samples=0,
        save_interval=1,
        dtype=dtype,
        seed=seed,
        overlap_param_gather=overlap_param_gather,
        compile=compile,
        expert_device_budget_mb=_mib(expert_device_budget_bytes),
        expert_host_budget_mb=_mib(expert_host_budget_bytes),
    )


def _mib(size: int) -> int:
    """``size`` bytes in MiB: whole MiB as the int plan.json holds, else the fraction (a test's expert budget of a few
    hundred KiB): size / 2**20 is exact in binary floating point, and build.expert_budget_bytes turns it back into
    the same bytes."""
    return size // 2**20 if size % 2**20 == 0 else size / 2**20  # type: ignore[return-value]
