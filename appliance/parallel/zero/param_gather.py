"""ZeRO's post-step parameter all-gather, issued per layer and overlapped with the next step's forward.

After its optimizer step, each DP rank of DeepSpeed's bf16 and ZeRO-1/2 optimizers holds the updated weights of
its own partition only (1/dp of each flat buffer), and DeepSpeed all-gathers the whole buffers before ``step``
returns: every rank idles for the all-gather of all its weights. PaddlePaddle's sharding optimizer instead issues
the gather asynchronously and lets each layer's forward wait only for its own parameters, so the next step's
forward of layer k runs while the weights of layers k+1... are still on the wire. The same here:

    gather = OverlappedParamGather(engine.optimizer, module, dp_group)   # after deepspeed.initialize
    ...            # optimizer.step() issues one async broadcast per (layer, owning rank) piece, forward order
    gather.wait_all()   # before anything reads parameters outside the training forward (the engine does it)

Pieces. The flat buffers are cut evenly over DP (partition r = [r * P, (r + 1) * P)), so a layer's range may span
several ranks' partitions: each (layer, flat group, owning rank) piece is one async broadcast from its owner, on a
process group of its own over the same DP ranks (``gather_groups``): on the DP group itself, every later
collective there (the step's loss all-reduce, the pipeline engine's loss aggregation) would queue behind the
broadcasts, on NCCL's stream as in gloo's queue, and the host reading its result would wait for all of them. The
pieces cover every element of each flat buffer exactly once (alignment padding goes with the layer before it), so
after they complete every rank holds what DeepSpeed's all-gather would have given it, bit for bit: a broadcast
copies the owner's numbers. Every rank builds the same pieces from the same module and partitioning and issues
them in the same order, which is what pairs the collectives up.

Waiting. A forward pre-hook on each layer of the forward sequence (the pipeline's ``forward_funcs``, or the
BloomStack's layers in the same order) waits for that layer's pieces. A layer that is not a module (the tied
embedding used as the LM head through a function) has no hook: its pieces are waited by the hook of the module
before it (or by the whole module's pre-hook when none precedes it), one layer early. The optimizer's next step
waits for anything left before it writes the partitions again, so nothing is overwritten while being sent.

How it is installed, as little as possible into DeepSpeed. Read from DeepSpeed 0.19.8: BF16_Optimizer.step (through
update_lp_params) and DeepSpeedZeroOptimizer.step both end with ``all_gather_dp_groups(groups_flat=...)``, a
module-level name each of deepspeed/runtime/bf16_optimizer.py and zero/stage_1_and_2.py imported from
deepspeed/runtime/utils.py. ``install`` rebinds that name in those two modules to a dispatcher that hands the call
to the gather registered for exactly that ``groups_flat`` list, and to DeepSpeed's own function for any other
optimizer, so optimizers our engine did not register behave as before. ``check_deepspeed_structure`` fails loudly
when what this relies on moved, and the engine checks after each applied step that the gather was issued.
"""

from __future__ import annotations

import importlib
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

# The modules whose ``all_gather_dp_groups`` call ends the optimizer step (DeepSpeed 0.19.8, see the docstring).
PATCHED_MODULES = ("deepspeed.runtime.bf16_optimizer", "deepspeed.runtime.zero.stage_1_and_2")
# (flat buffers, per-rank partitions) of the optimizers it applies to, by class: what each passes to the call.
BUFFERS = {
    "BF16_Optimizer": ("bf16_groups_flat", "bf16_partitioned_groups"),
    "DeepSpeedZeroOptimizer": ("bit16_groups_flat", "parallel_partitioned_bit16_groups"),
}
_ACTIVE: weakref.WeakSet[OverlappedParamGather] = weakref.WeakSet()


class DeepSpeedStructureError(RuntimeError):
    """DeepSpeed no longer looks the way the overlapped gather was written against (0.19.8)."""


def check_deepspeed_structure(optimizer: Any = None) -> None:
    """Raise DeepSpeedStructureError unless DeepSpeed still ends its optimizer steps the way this module expects."""
    from deepspeed.runtime import utils

    for name in PATCHED_MODULES:
        module = importlib.import_module(name)
        bound = getattr(module, "all_gather_dp_groups", None)
        if bound is not utils.all_gather_dp_groups and not isinstance(bound, _Dispatcher):
            raise DeepSpeedStructureError(
                f"{name}.all_gather_dp_groups is {bound!r}, not deepspeed.runtime.utils.all_gather_dp_groups: "
                "DeepSpeed changed how its optimizer step gathers the updated parameters (read from 0.19.8); "
                "set train.overlap_param_gather to false, or update appliance/parallel/zero/param_gather.py"
            )
    if optimizer is not None:
        kind = type(optimizer).__name__
        names = BUFFERS.get(kind)
        missing = [n for n in names or () if not isinstance(getattr(optimizer, n, None), list)]
        missing += (
            [] if isinstance(getattr(optimizer, "real_dp_process_group", None), list) else ["real_dp_process_group"]
        )
        if names is None or missing:
            raise DeepSpeedStructureError(
                f"{kind} has no {', '.join(missing) or 'known flat buffers'} (read from DeepSpeed 0.19.8's "
                f"{', '.join(BUFFERS)}): set train.overlap_param_gather to false, or update zero/param_gather.py"
            )


class _Dispatcher:
    """Stands in for ``all_gather_dp_groups`` in PATCHED_MODULES: registered optimizers' calls go to their gather."""

    def __init__(self, original: Callable[..., None]) -> None:
        self.original = original

    def __call__(self, groups_flat: Any, partitioned_param_groups: Any, *args: Any, **kwargs: Any) -> None:
        for gather in list(_ACTIVE):
            if gather.groups_flat is groups_flat:
                gather.issue(partitioned_param_groups)
                return
        self.original(groups_flat, partitioned_param_groups, *args, **kwargs)


def install() -> None:
    """Put the dispatcher in place (idempotent)."""
    from deepspeed.runtime import utils

    check_deepspeed_structure()
    for name in PATCHED_MODULES:
        module = importlib.import_module(name)
        if not isinstance(module.all_gather_dp_groups, _Dispatcher):
            module.all_gather_dp_groups = _Dispatcher(utils.all_gather_dp_groups)  # type: ignore[attr-defined]


@dataclass
class Bucket:
    """One layer's pieces: (flat group, start, length, owning DP rank), and their handles while in flight."""

    name: str
    pieces: list[tuple[int, int, int, int]] = field(default_factory=list)
    handles: list[Any] = field(default_factory=list)


def forward_layers(module: nn.Module) -> list[Any]:
    """The callables a forward runs, in order: DeepSpeed's PipelineModule keeps them in ``forward_funcs``, and
    pipeline.stack.BloomStack in ``_layers`` (built from the same specs, in the same order)."""
    layers = getattr(module, "forward_funcs", None)
    if layers is None:
        layers = getattr(module, "_layers", None)
    if not isinstance(layers, list) or not layers:
        raise TypeError(f"{type(module).__name__} has no forward sequence (forward_funcs or _layers)")
    return layers


def _layer_module(layer: Any) -> nn.Module | None:
    if isinstance(layer, nn.Module):
        return layer
    if isinstance(layer, partial) and layer.args and isinstance(layer.args[0], nn.Module):
        return layer.args[0]  # a tied module used through a function (TiedLayerSpec.forward_fn)
    return None


class OverlappedParamGather:
    """See the module docstring. ``events``, when a list, records ("issue" | "wait", bucket index) in order."""

    def __init__(
        self, optimizer: Any, module: nn.Module, group: Any, *, events: list[tuple[str, int]] | None = None
    ) -> None:
        check_deepspeed_structure(optimizer)
        flats_name, parts_name = BUFFERS[type(optimizer).__name__]
        self.groups_flat: list[torch.Tensor] = getattr(optimizer, flats_name)
        partitions: list[list[torch.Tensor]] = getattr(optimizer, parts_name)
        self.group = group  # the broadcasts' own group: the optimizer's DP ranks, in the same order
        # Partition r of flat group g belongs to rank r of the optimizer's DP group of g: its global rank.
        self.owners: list[list[int]] = []
        for dp_group in optimizer.real_dp_process_group:
            ranks = dist.get_process_group_ranks(dp_group)
            if ranks != dist.get_process_group_ranks(group):
                raise ValueError(
                    f"the gather group's ranks {dist.get_process_group_ranks(group)} are not the "
                    f"optimizer's DP ranks {ranks}"
                )
            self.owners.append(ranks)
        self.events = events
        self.issued = 0  # steps whose gather was issued here (the engine checks it grows)
        layers = forward_layers(module)
        self.buckets = [Bucket("(whole module)")]  # first: pieces waited by the whole module's pre-hook
        owner_bucket: dict[int, int] = {}  # id(parameter) -> bucket of its first use
        hooked: list[tuple[nn.Module, list[int]]] = [(module, [0])]
        for index, layer in enumerate(layers):
            layer_module = _layer_module(layer)
            if layer_module is None:
                continue
            self.buckets.append(Bucket(f"layer {index} ({type(layer_module).__name__})"))
            for p in layer_module.parameters():
                owner_bucket.setdefault(id(p), len(self.buckets) - 1)
            if isinstance(layer, nn.Module):
                hooked.append((layer, [len(self.buckets) - 1]))
            else:
                hooked[-1][1].append(len(self.buckets) - 1)  # waited one layer early, by the module before it
        self._cut(module, partitions, owner_bucket)
        self.layer_modules = [m for m, _ in hooked[1:]]  # the hooked layers, in forward order
        self._hooks = [m.register_forward_pre_hook(self._waiter(ids)) for m, ids in hooked]
        self._step_owner = optimizer
        self._original_step = optimizer.step
        optimizer.step = self._step  # instance attribute: only this optimizer waits before stepping
        install()
        _ACTIVE.add(self)

    def _cut(self, module: nn.Module, partitions: list[list[torch.Tensor]], owner: dict[int, int]) -> None:
        """Assign every element of every flat buffer to one bucket, then cut the buckets' ranges at partitions."""
        for g, flat in enumerate(self.groups_flat):
            size = flat.element_size()
            base, end = flat.data_ptr(), flat.data_ptr() + flat.numel() * size
            starts = sorted(
                ((p.data_ptr() - base) // size, owner.get(id(p), 0))
                for p in module.parameters()
                if p.numel() and base <= p.data_ptr() < end
            )
            if not starts:
                raise DeepSpeedStructureError(f"no parameter of the module lies in flat buffer {g}")
            offsets = [(t.data_ptr() - base) // size for t in partitions[g]]
            length = partitions[g][0].numel()
            if offsets != [r * length for r in range(len(offsets))] or flat.numel() != len(offsets) * length:
                raise DeepSpeedStructureError(f"flat buffer {g} is not cut evenly into DP partitions: {offsets}")
            # Segments: from each parameter's start to the next one's (the first from 0, the last to the end).
            bounds = [0] + [s for s, _ in starts[1:]] + [flat.numel()]
            for (_, bucket), lo, hi in zip(starts, bounds[:-1], bounds[1:], strict=True):
                for rank in range(lo // length, (hi - 1) // length + 1):
                    a, b = max(lo, rank * length), min(hi, (rank + 1) * length)
                    pieces = self.buckets[bucket].pieces
                    if pieces and pieces[-1][0] == g and pieces[-1][3] == rank and sum(pieces[-1][1:3]) == a:
                        pieces[-1] = (g, pieces[-1][1], pieces[-1][2] + b - a, rank)  # merge with the adjacent
                    else:
                        pieces.append((g, a, b - a, rank))

    # ---- issuing and waiting ------------------------------------------------------------------------------
    def issue(self, partitioned_param_groups: Any = None) -> None:
        """Start every piece's broadcast, bucket by bucket in forward order (in place of the all-gather)."""
        self.wait_all()
        for index in range(len(self.buckets)):
            self._issue_bucket(index)
        self.issued += 1

    def _issue_bucket(self, index: int) -> None:
        bucket = self.buckets[index]
        for g, start, length, owner in bucket.pieces:
            piece = self.groups_flat[g].narrow(0, start, length)
            src = self.owners[g][owner]
            bucket.handles.append(dist.broadcast(piece, src=src, group=self.group, async_op=True))
        if self.events is not None:
            self.events.append(("issue", index))

    def wait(self, index: int) -> None:
        bucket = self.buckets[index]
        if not bucket.handles:
            return
        for handle in bucket.handles:
            handle.wait()
        bucket.handles.clear()
        if self.events is not None:
            self.events.append(("wait", index))

    def wait_all(self) -> None:
        """Wait for every piece in flight: after it every parameter holds the last step's value on every rank."""
        for index in range(len(self.buckets)):
            self.wait(index)

    @property
    def pending(self) -> int:
        return sum(len(b.handles) for b in self.buckets)

    def _waiter(self, indices: list[int]) -> Callable[..., None]:
        def hook(_module: nn.Module, _inputs: Any) -> None:
            for index in indices:
                self.wait(index)

        return hook

    def _step(self, *args: Any, **kwargs: Any) -> Any:
        self.wait_all()  # the step writes this rank's partition, which a broadcast may still be sending
        return self._original_step(*args, **kwargs)

    def close(self) -> None:
        """Wait for what is in flight and take every hook out: the optimizer gathers as DeepSpeed does again."""
        self.wait_all()
        for handle in self._hooks:
            handle.remove()
        self._hooks.clear()
        if self._step_owner.__dict__.get("step") == self._step:
            del self._step_owner.step
        _ACTIVE.discard(self)


def gather_groups(dp_groups: Sequence[Sequence[int]]) -> Any:
    """A process group per DP group (the same ranks) for the broadcasts alone; this rank's. Collective over the
    world (``dist.new_group``): every rank creates every group, in the same order."""
    rank, own = dist.get_rank(), None
    for ranks in dp_groups:
        group = dist.new_group(ranks=list(ranks))
        if rank in ranks:
            own = group
    return own


def overlap_applies(optimizer: Any, dp: int) -> bool:
    """The overlap acts where ZeRO partitions the weights' update over more than one DP rank."""
    return dp > 1 and type(optimizer).__name__ in BUFFERS


def build_overlap(
    optimizer: Any, module: nn.Module, dp_groups: Sequence[Sequence[int]], enabled: bool
) -> OverlappedParamGather | None:
    """The overlapped gather where it applies, else None. Collective: every rank calls it with the same
    ``enabled`` (the optimizer's class and dp are the same on every rank, so every rank decides alike)."""
    if not (enabled and overlap_applies(optimizer, len(dp_groups[0]))):
        return None
    return OverlappedParamGather(optimizer, module, gather_groups(dp_groups))
