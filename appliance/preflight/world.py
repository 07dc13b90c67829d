"""The emulated world one role's rank is built in: torch's fake process group, whose collectives and point-to-point
calls return at once without sending, so one process can be any rank of a world of any size. Nothing listens: the
group's store is an in-process fake.

A pipeline stage's first receive asks the previous stage for the shapes and types of what it will send, which no
peer answers here: ``StageHandoff`` records what the first stage sends and hands later stages buffers of that
description instead."""

from __future__ import annotations

import contextlib
import inspect
import os
import sys
import warnings
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

from appliance.parallel.step.deepspeed_comm import SHM_COMM_OP

FAKE_BACKEND = "fake"  # registered by importing torch's fake_pg module


@contextlib.contextmanager
def emulated_world(rank: int, world_size: int) -> Iterator[None]:
    """torch.distributed initialised as rank ``rank`` of ``world_size`` on the fake backend for the block, and torn
    down after it, with the process left as it was (``process_state_kept``). LOCAL_RANK is set for the block as a
    launcher would set it (DeepSpeed's PipelineModule reads it): 0, the one device of this process."""
    if dist.is_initialized():
        raise RuntimeError("preflight builds its ranks in a process of its own: torch.distributed is already running")
    import deepspeed.ops
    from torch.testing._internal.distributed.fake_pg import FakeStore

    with process_state_kept():
        # The fake group is no gloo group, so deepspeed_comm.init_deepspeed_comm would leave DeepSpeed free to
        # compile its CPU shared-memory all-reduce (a minute of C++, which nothing here uses): keep it off.
        deepspeed.ops.__compatible_ops__[SHM_COMM_OP] = False
        os.environ["LOCAL_RANK"] = "0"
        dist.init_process_group(FAKE_BACKEND, store=FakeStore(), rank=rank, world_size=world_size)
        try:
            with defined_outputs():
                yield
        finally:
            dist.destroy_process_group()


# Modules whose globals an engine build sets for its process: DeepSpeed's communication backend (cdb), its
# pipeline's grid, its parallel-groups registry (mpu and the expert groups), its MoE all-to-all (ours installed),
# torch's default backend name. Left behind, the next engine or MoE layer built in the same process would use a
# destroyed fake group's grid and groups.
PROCESS_STATE = (
    "deepspeed.comm.comm",
    "deepspeed.runtime.pipe.p2p",
    "deepspeed.utils.groups",
    "deepspeed.moe.sharded_moe",
    "torch.distributed.distributed_c10d",
)
# Classes among them that a build replaces (install_all_to_all: the experts' exchange)
REPLACED_CLASSES = {"deepspeed.moe.sharded_moe": ("_AllToAll",)}


@contextlib.contextmanager
def process_state_kept() -> Iterator[None]:
    """The block may build engines in this process: afterwards the environment and the PROCESS_STATE modules'
    globals are as before it (values set back, names it added removed, dicts and lists refilled in place, for
    modules that imported them by name)."""
    import importlib

    import deepspeed.ops

    environment = dict(os.environ)
    compatible_ops = dict(deepspeed.ops.__compatible_ops__)
    saved = {}
    with warnings.catch_warnings():  # looking at torch.distributed's deprecated reduce_op warns
        warnings.simplefilter("ignore", FutureWarning)
        for name in PROCESS_STATE:
            module = importlib.import_module(name)
            kept = REPLACED_CLASSES.get(name, ())
            saved[module] = {k: (v, _contents(v)) for k, v in vars(module).items() if _is_state(v) or k in kept}
    try:
        yield
    finally:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            for module, state in saved.items():
                for key in [k for k, v in vars(module).items() if _is_state(v) and k not in state]:
                    delattr(module, key)
                for key, (value, contents) in state.items():
                    setattr(module, key, value)
                    _refill(value, contents)
        os.environ.clear()
        os.environ.update(environment)
        deepspeed.ops.__compatible_ops__.clear()
        deepspeed.ops.__compatible_ops__.update(compatible_ops)


def _is_state(value: Any) -> bool:
    """A module global that holds state: not a function, class or module (those are its code)."""
    return not (inspect.isroutine(value) or inspect.isclass(value) or inspect.ismodule(value))


def _contents(value: Any) -> Any:
    return dict(value) if isinstance(value, dict) else list(value) if isinstance(value, list) else None


def _refill(value: Any, contents: Any) -> None:
    if isinstance(value, dict):
        value.clear()
        value.update(contents)
    elif isinstance(value, list):
        value[:] = contents


def _define(tensor: torch.Tensor) -> None:
    """What a peer would have sent, as far as a step's cost goes: N(0, 1) floats, zero integers."""
    if tensor.dtype.is_floating_point:
        tensor.normal_()
    else:
        tensor.zero_()


def _after(original: Any, fill: Any) -> Any:
    """``original``, then ``fill`` with its arguments by name (callers pass them by position or keyword)."""
    signature = inspect.signature(original)

    def call(*args: Any, **kwargs: Any) -> Any:
        result = original(*args, **kwargs)
        fill(signature.bind(*args, **kwargs).arguments)
        return result

    call.__wrapped__ = original  # type: ignore[attr-defined]
    return call


def _fill_broadcast(arguments: dict[str, Any]) -> None:
    src, group, group_src = arguments.get("src"), arguments.get("group"), arguments.get("group_src")
    if src is None and group_src is not None:  # a rank of the group: on the default group, the global rank
        src = group_src if group is None else dist.get_global_rank(group, group_src)
    if src != dist.get_rank():
        _define(arguments["tensor"])


def _fill_first(arguments: dict[str, Any]) -> None:
    """The call's first argument: its output tensor, or list of them."""
    out = next(iter(arguments.values()))
    for tensor in out if isinstance(out, list | tuple) else (out,):
        _define(tensor)


def _fill_received(arguments: dict[str, Any]) -> None:
    for op in arguments["p2p_op_list"]:
        if getattr(op.op, "__name__", "") == "irecv":
            _define(op.tensor)


# torch.distributed's calls whose output a peer would fill, and how to fill it here; the modules that hold one of
# them under a name of their own (bound at import) are given the wrapped call too.
FILLED = {
    "broadcast": _fill_broadcast,
    "all_gather": _fill_first,
    "all_gather_into_tensor": _fill_first,
    "reduce_scatter_tensor": _fill_first,
    "all_to_all_single": _fill_first,
    "recv": _fill_first,
    "batch_isend_irecv": _fill_received,  # irecv itself stays: P2POp accepts torch's own function only
}
BOUND_ELSEWHERE = {
    "appliance.parallel.tensor.mappings": {"_all_gather_single": _fill_first, "_reduce_scatter_single": _fill_first},
}


@contextlib.contextmanager
def defined_outputs() -> Iterator[None]:
    """The fake group's receiving calls leave their output buffers as they were allocated: uninitialised memory,
    whose NaNs and huge values make a step skip (ring attention's received keys and values, the 2D mesh's broadcast
    blocks) and its optimizer state never appear. For the block, each such call fills its outputs with finite values
    after it returns; the bytes and shapes, all that preflight measures, are the real ones."""
    import importlib

    saved: list[tuple[Any, str, Any]] = []
    for name, fill in FILLED.items():
        saved.append((dist, name, getattr(dist, name)))
        setattr(dist, name, _after(getattr(dist, name), fill))
    for module_name, aliases in BOUND_ELSEWHERE.items():
        module = importlib.import_module(module_name)
        for alias, fill in aliases.items():
            saved.append((module, alias, getattr(module, alias)))
            setattr(module, alias, _after(getattr(module, alias), fill))
    try:
        yield
    finally:
        for owner, name, original in reversed(saved):
            setattr(owner, name, original)


@contextlib.contextmanager
def stdout_to_stderr() -> Iterator[None]:
    """Standard output sent to standard error for the block, file descriptor 1 and sys.stdout both: DeepSpeed's builders
    print their topology and the layers of each stage, and its logger writes to the stdout it found at import, while
    `preflight --json` owns stdout."""
    sys.stdout.flush()
    saved = os.dup(1)
    os.dup2(2, 1)
    try:
        with contextlib.redirect_stdout(sys.stderr):  # print() to a sys.stdout that is not file descriptor 1
            yield
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)


Description = list[tuple[torch.Size, torch.dtype]]


class StageHandoff:
    """What a pipeline stage sends the next one, as (shape, dtype) per tensor: recorded from the first stage's
    DeepSpeed PipelineEngine, handed to the later stages' engines in place of the description a peer would send."""

    def __init__(self) -> None:
        self.sent: Description | None = None
        self.single = False  # one tensor rather than a tuple

    def record(self, pipe_engine: Any) -> None:
        """Note what ``pipe_engine`` sends downstream (its _send_tensor_meta, called on its first send)."""
        original = pipe_engine._send_tensor_meta

        def send_tensor_meta(buffer: Any, recv_stage: int) -> Any:
            tensors = (buffer,) if isinstance(buffer, torch.Tensor) else tuple(buffer)
            self.single = isinstance(buffer, torch.Tensor)
            self.sent = [(t.shape, t.dtype) for t in tensors]
            return original(buffer, recv_stage)

        pipe_engine._send_tensor_meta = send_tensor_meta

    def feed(self, pipe_engine: Any) -> None:
        """Make ``pipe_engine`` allocate its receive buffers from the recorded description: floating tensors drawn
        from N(0, 1) (the fake receive leaves them as they are), integer ones zero."""
        if self.sent is None:
            raise RuntimeError("the first stage has not sent yet: build and step it before the stages after it")
        device = pipe_engine.device

        def recv_tensor_meta(recv_stage: int) -> Any:
            assert self.sent is not None
            buffers = tuple(
                torch.randn(shape, dtype=dtype, device=device)
                if dtype.is_floating_point
                else torch.zeros(shape, dtype=dtype, device=device)
                for shape, dtype in self.sent
            )
            return buffers[0] if self.single else buffers

        pipe_engine._recv_tensor_meta = recv_tensor_meta
