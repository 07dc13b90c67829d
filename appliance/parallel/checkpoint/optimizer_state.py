"""Adam's state per parameter, under Hugging Face names, so that it moves to any (tp, pp, dp, cp) layout.

A checkpoint keeps it in safetensors files ``optim-tp{t}-pp{p}-dp{d}.safetensors``. For each parameter of the
model-parallel position (t, p), as that TP rank's slice and whole over DP (the same cut as the model shard):

    <name>.exp_avg, <name>.exp_avg_sq   Adam's moments, fp32 (every per-element state the optimizer keeps)
    <name>.step                         Adam's step count (0-d int64)
    <name>.master                       the fp32 master weight, only where the model's weights are not fp32 (bf16)

The data-parallel ranks of a position share the writing: each writes the parameters ``dp_writers`` assigns to it.
Data-parallel means DeepSpeed's group, dp x cp: ZeRO partitions the state over it, and the CP ranks of a DP rank
hold the same parameters, so the file index d is the rank in that group (dp_rank * cp + cp_rank). The state does
not depend on cp, so a checkpoint written at one cp loads at any other.
Loading reassembles each tensor from the TP pieces of whatever layout wrote it and keeps this rank's slice
(``checkpoint.weight_shards.ShardReader``), so the same code loads at the same layout and at any other.

Where the state lives. ZeRO 1/2 and DeepSpeed's bf16 optimizer keep, on each DP rank, a fragment of flat fp32
groups; DeepSpeed's ``safe_get_full_optimizer_state`` / ``safe_get_full_fp32_param`` return one parameter's
whole tensor (an all-reduce over the DP group, so every DP rank calls them for every parameter in the same
order) and the ``safe_set_*`` twins write this rank's fragment from a whole tensor (local). Plain torch AdamW
(fp32 at ZeRO 0) keeps per-parameter state.

Cost at BLOOM-176B (tp 4, pp 12, dp 8: 176e9 / 48 = 3.7e9 parameters per position). Saving all-reduces one
parameter at a time over DP (the largest, a tp=4 slice of the word embedding, is 3.6 GB in fp32) and each DP
rank keeps only the eighth it writes: 3.7e9 / 8 x 12 B (two moments and the master) = 5.5 GB of host memory,
where DP rank 0 alone would hold 44 GB. The all-reduces move 3.7e9 x 12 B = 44 GB per DP group, tens of seconds
on InfiniBand, against a save every 3 hours. Loading holds one slice of one tensor at a time.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Collection, Sequence
from pathlib import Path
from typing import Any

import torch

NamedParams = Sequence[tuple[str, torch.nn.Parameter]]
Read = Callable[[str, str], torch.Tensor]  # (key, parameter name) -> this rank's slice of the saved tensor

STEP, MASTER = "step", "master"
_FILE = re.compile(r"^optim-tp(\d+)-pp(\d+)-dp(\d+)\.safetensors$")


def optimizer_file_name(tp_rank: int, pp_rank: int, dp_rank: int) -> str:
    return f"optim-tp{tp_rank:02d}-pp{pp_rank:02d}-dp{dp_rank:02d}.safetensors"


def optimizer_files(step_dir: Path) -> list[tuple[int, int, Path]]:
    """(tp_rank, pp_rank, file) of every optimizer file in a checkpoint directory."""
    found = []
    for path in sorted(Path(step_dir).iterdir()):
        match = _FILE.match(path.name)
        if match:
            found.append((int(match[1]), int(match[2]), path))
    return found


def dp_writers(named_params: NamedParams, dp_size: int) -> dict[str, int]:
    """Which DP rank writes each parameter's state: largest first, each to the DP rank with the fewest elements
    so far. Every DP rank of a position has the same parameters, so all compute the same assignment."""
    load = [0] * dp_size
    writers = {}
    for name, param in sorted(named_params, key=lambda item: (-item[1].numel(), item[0])):
        rank = min(range(dp_size), key=lambda r: (load[r], r))
        writers[name] = rank
        load[rank] += param.numel()
    return writers


def _is_partitioned(optimizer: Any) -> bool:
    """True for DeepSpeed's ZeRO 1/2 and bf16 optimizers (state in flat fp32 partitions)."""
    from deepspeed.runtime.bf16_optimizer import BF16_Optimizer
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    return isinstance(optimizer, BF16_Optimizer | DeepSpeedZeroOptimizer)


def _step_tensor(step: int, param: torch.Tensor, optimizer: Any) -> torch.Tensor:
    """Adam's step count as torch keeps it for ``param``: a CPU scalar, except that a fused (or capturable) AdamW
    keeps it as fp32 on the parameter's device, where its kernel reads it (torch.optim.Optimizer's
    _process_value_according_to_param_policy, "special device hosting for step")."""
    group = next(g for g in optimizer.param_groups if any(p is param for p in g["params"]))
    if group.get("fused") or group.get("capturable"):
        return torch.tensor(float(step), dtype=torch.float32, device=param.device)
    # The dtype torch's Adam gives a fresh "step" (torch.optim.optimizer._get_scalar_dtype).
    return torch.tensor(
        float(step), dtype=torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32
    )


def _flat_groups(optimizer: Any) -> list[torch.Tensor]:
    """The fp32 partitions a DeepSpeed optimizer hands to the torch optimizer inside it, one per group."""
    return [p for group in optimizer.optimizer.param_groups for p in group["params"]]


def _link_fragments(named_params: NamedParams, optimizer: Any) -> None:
    """Point each parameter's DeepSpeed fragment at the state tensors the torch optimizer holds now.

    DeepSpeed links them lazily after its first step; state created or replaced before that (a load into a
    fresh engine) must be linked here, or the getters and setters would find nothing or stale tensors."""
    inner = optimizer.optimizer
    for _, param in named_params:
        mapping = getattr(param, "_hp_mapping", None)
        if mapping is not None:
            flat = inner.param_groups[mapping.param_group_index]["params"][0]
            mapping.set_optim_state_fragment(flat, inner.state[flat])


def _partitioned_state(named_params: NamedParams, optimizer: Any, keep: Callable[[str], bool]) -> dict[str, Any]:
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    inner = optimizer.optimizer
    flats = _flat_groups(optimizer)
    # Every DP rank derives the same keys from its own partitions, so the collectives below pair up.
    kinds = sorted(
        {k for f in flats for k, v in inner.state.get(f, {}).items() if torch.is_tensor(v) and v.shape == f.shape}
    )
    steps = {int(inner.state[f][STEP]) for f in flats if STEP in inner.state.get(f, {})}
    if len(steps) > 1:
        raise RuntimeError(f"optimizer groups at different Adam steps {sorted(steps)}")
    step = steps.pop() if steps else None
    _link_fragments(named_params, optimizer)
    out: dict[str, Any] = {}
    for name, param in named_params:
        for kind in kinds:
            value = safe_get_full_optimizer_state(param, kind)
            if keep(name):
                out[f"{name}.{kind}"] = value.float().cpu()
        if param.dtype != torch.float32:  # fp32 weights are their own master: the model file has them
            value = safe_get_full_fp32_param(param)
            if keep(name):
                out[f"{name}.{MASTER}"] = value.float().cpu()
        if step is not None and keep(name):
            out[f"{name}.{STEP}"] = torch.tensor(step, dtype=torch.int64)
    return out


def _is_flat(optimizer: Any) -> bool:
    """True for the single-replica engine's FlatAdamW (state in flat buffers, one view per parameter)."""
    from appliance.parallel.step.flat_optimizer import FlatAdamW

    return isinstance(optimizer, FlatAdamW)


def _flat_state(named_params: NamedParams, optimizer: Any, keep: Callable[[str], bool]) -> dict[str, Any]:
    """FlatAdamW's views: its moments, the master of bf16 weights, the step count once it has stepped."""
    out: dict[str, Any] = {}
    step = int(optimizer.step_count)  # a checkpoint reads the device anyway
    for name, param in named_params:
        if not keep(name):
            continue
        for kind, value in optimizer.param_state(param).items():
            if kind == STEP:
                if step > 0:  # before its first step Adam has no state, as torch's AdamW: only the master
                    out[f"{name}.{STEP}"] = torch.tensor(step, dtype=torch.int64)
            elif kind == MASTER or step > 0:
                out[f"{name}.{kind}"] = value.detach().float().cpu().clone()
    return out


def _load_flat(named_params: NamedParams, optimizer: Any, keys: Collection[str], read: Read) -> bool:
    kinds = _saved_kinds(keys)
    step = _saved_step(named_params, keys, read)
    for name, param in named_params:
        views = optimizer.param_state(param)
        for kind in kinds:
            _require(f"{name}.{kind}", keys)
            if kind not in views:
                raise KeyError(f"optimizer state: {name}.{kind} has no place in this optimizer ({sorted(views)})")
            views[kind].copy_(read(f"{name}.{kind}", name))
        if f"{name}.{MASTER}" in keys:
            optimizer.set_master(param, read(f"{name}.{MASTER}", name))
    if step is not None:
        optimizer.step_count.fill_(float(step))
    return bool(kinds) or step is not None


def _plain_state(named_params: NamedParams, optimizer: Any, keep: Callable[[str], bool]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, param in named_params:
        if not keep(name):
            continue
        for kind, value in optimizer.state.get(param, {}).items():
            if kind == STEP:
                out[f"{name}.{STEP}"] = torch.tensor(int(value), dtype=torch.int64)
            elif torch.is_tensor(value) and value.shape == param.shape:
                out[f"{name}.{kind}"] = value.detach().float().cpu().clone()
    return out


@torch.no_grad()
def optimizer_state(
    named_params: NamedParams, optimizer: Any, *, keep: Callable[[str], bool] = lambda name: True
) -> dict[str, torch.Tensor]:
    """This rank's optimizer state (its TP slices, whole over DP) of the parameters ``keep`` accepts.

    Collective over the DP group with ZeRO 1/2 and bf16: every DP rank calls it, with its own ``keep``.
    Empty before the first step (Adam has no state yet), except for bf16 master weights."""
    if _is_partitioned(optimizer):
        return _partitioned_state(named_params, optimizer, keep)
    if _is_flat(optimizer):
        return _flat_state(named_params, optimizer, keep)
    return _plain_state(named_params, optimizer, keep)


def _saved_kinds(keys: Collection[str]) -> list[str]:
    return sorted({key.rsplit(".", 1)[1] for key in keys} - {STEP, MASTER})


def _saved_step(named_params: NamedParams, keys: Collection[str], read: Read) -> int | None:
    steps = {int(read(f"{name}.{STEP}", name)) for name, _ in named_params if f"{name}.{STEP}" in keys}
    if len(steps) > 1:
        raise ValueError(f"optimizer state: parameters at different Adam steps {sorted(steps)}")
    return steps.pop() if steps else None


def _require(key: str, keys: Collection[str]) -> None:
    if key not in keys:
        raise KeyError(f"optimizer state has no {key}")


def _load_partitioned(named_params: NamedParams, optimizer: Any, keys: Collection[str], read: Read) -> bool:
    from deepspeed.utils import safe_set_full_fp32_param, safe_set_full_optimizer_state

    inner = optimizer.optimizer
    kinds = _saved_kinds(keys)
    step = _saved_step(named_params, keys, read)
    for flat in _flat_groups(optimizer):
        state = inner.state[flat]
        for kind in kinds:
            # A fresh engine has no state yet; zeros also cover the alignment padding at the end of the
            # partition, where a trained optimizer holds zeros too (padding gradients are zero).
            state.setdefault(kind, torch.zeros_like(flat))
        if step is not None:
            state[STEP] = _step_tensor(step, flat, inner)
    for group in inner.param_groups:
        if step is not None and STEP in group:  # optimizers that count steps per group
            group[STEP] = step
    _link_fragments(named_params, optimizer)
    for name, param in named_params:
        for kind in kinds:
            _require(f"{name}.{kind}", keys)
            safe_set_full_optimizer_state(param, read(f"{name}.{kind}", name), kind)
        if f"{name}.{MASTER}" in keys:
            master = read(f"{name}.{MASTER}", name)
            safe_set_full_fp32_param(param, master)
            if param.dtype == torch.float32:  # saved from bf16, loaded in fp32: the weights are the master
                param.copy_(master)
    return bool(kinds) or step is not None


def _load_plain(named_params: NamedParams, optimizer: Any, keys: Collection[str], read: Read) -> bool:
    kinds = _saved_kinds(keys)
    step = _saved_step(named_params, keys, read)
    for name, param in named_params:
        state = optimizer.state[param]
        for kind in kinds:
            _require(f"{name}.{kind}", keys)
            value = read(f"{name}.{kind}", name).to(device=param.device, dtype=param.dtype)
            if kind in state:
                state[kind].copy_(value)
            else:
                state[kind] = value.clone(memory_format=torch.preserve_format)
        if step is not None:
            state[STEP] = _step_tensor(step, param, optimizer)
        if f"{name}.{MASTER}" in keys:
            param.copy_(read(f"{name}.{MASTER}", name))
    return bool(kinds) or step is not None


@torch.no_grad()
def load_optimizer_state(named_params: NamedParams, optimizer: Any, keys: Collection[str], read: Read) -> bool:
    """Set the optimizer state of ``named_params`` from saved ``keys``; ``read(key, name)`` returns this rank's
    slice of one. Local (no collective). Returns False when the saved state had no moments and no step count
    (a checkpoint written before the first step), leaving the optimizer as it is."""
    keys = set(keys)
    if _is_partitioned(optimizer):
        return _load_partitioned(named_params, optimizer, keys, read)
    if _is_flat(optimizer):
        return _load_flat(named_params, optimizer, keys, read)
    return _load_plain(named_params, optimizer, keys, read)
