"""The kernels a run uses, chosen by measurement on its GPU at its shapes, the same on every rank.

Under BLOOM_KERNELS=auto on CUDA, before the engine is built (train/from_spec.py engine_for):
1. rank 0 reads the cache file (`<run dir>/kernels.json`, kernels/selection_cache.py): every measurement made
   there, one entry per GPU, software, op and shape. Each op whose entry's key equals this run's exactly (device
   name, compute capability, torch, triton and project versions, the op, the sizes the op is fed) takes it; the
   others are measured (kernels/selection.py: each op's candidates checked against the fp32 twin, then timed,
   flash attention's tiles tuned). Where the run compiles its blocks, the block with the chosen ops is timed
   against the block with the twins of the ops inductor fuses (kernels/selection_block.py). New entries are added
   to the file, never in place of others, which is rewritten whole, atomically;
2. rank 0 broadcasts the selection to every rank over the world group;
3. every rank compares its own key with rank 0's: a rank on another GPU model or software stack would run kernels
   measured elsewhere, so any difference stops every rank with an error naming both; else every rank installs it
   (`Selection.apply`: flash attention's tiles, then `registry.use(choices)`).
On CPU under auto, or with BLOOM_KERNELS=triton|reference, nothing is measured and `choose_kernels` returns None;
`kernel_record` then records the backend that runs instead.

The shapes are one rank's: heads, MLP width and vocabulary over tp, a sequence over cp (ring attention's chunk;
Ulysses' attention sees the whole sequence over cp heads, measured at the chunk's shape all the same).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from appliance.model.config import BloomConfig
from appliance.parallel.topology import ParallelTopology
from kernels import backend_env, registry
from kernels.selection import (
    Implementations,
    RankShapes,
    Selection,
    Timer,
    current_key,
    default_timer,
    document_ids,
    select,
)
from kernels.selection_block import BlockStep, check_block
from kernels.selection_cache import SelectionCache

# plan.json's train.dtype -> RankShapes.dtype
DTYPE_NAMES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}


class KernelChoiceError(RuntimeError):
    """The ranks cannot share one measured selection (their keys differ); the message names every difference."""


def forced_backend() -> str | None:
    """BLOOM_KERNELS's value when it forces a backend ("triton" or "reference"); None under auto, and when it names
    a backend per op (backend_env.given)."""
    value = os.environ.get(backend_env.BACKEND_ENV, "auto").strip().lower() or "auto"
    return None if value == "auto" or "=" in value else value


def rank_shapes(
    config: BloomConfig,
    topology: ParallelTopology,
    *,
    micro_batch_size: int,
    seq_len: int,
    dtype: str,
    documents: bool = False,
) -> RankShapes:
    """What one rank feeds the selectable ops (the vocabulary is already padded to a multiple of tp)."""
    tp = topology.tp
    return RankShapes(
        micro_batch_size=micro_batch_size,
        seq_len=seq_len // topology.cp,
        hidden=config.hidden_size,
        heads=config.n_head // tp,
        head_dim=config.hidden_size // config.n_head,
        ffn=4 * config.hidden_size // tp,
        vocab=config.vocab_size // tp,
        dtype=DTYPE_NAMES[dtype],
        documents=documents,
    )


def choose_kernels(
    config: BloomConfig,
    topology: ParallelTopology,
    *,
    micro_batch_size: int,
    seq_len: int,
    dtype: str,
    device: torch.device,
    cache_file: Path | None,
    timer: Timer | None = None,
    documents: bool = False,
    compiled_blocks: bool = True,
) -> Selection | None:
    """The measured selection every rank now runs with (collective over the world group), or None on CPU under
    auto and when BLOOM_KERNELS forces a backend (nothing measured; see kernel_record). `compiled_blocks`: whether
    the run compiles its blocks (compile=auto does on CUDA), where the block-level check applies."""
    if forced_backend() is not None or backend_env.given() or torch.device(device).type != "cuda":
        return None
    shapes = rank_shapes(
        config, topology, micro_batch_size=micro_batch_size, seq_len=seq_len, dtype=dtype, documents=documents
    )
    device = torch.device(device)
    block = block_step_for(config, topology, shapes, device) if compiled_blocks else None
    return agree(shapes, device, cache_file=cache_file, timer=timer, block_step=block)


def agree(
    shapes: RankShapes,
    device: torch.device,
    *,
    cache_file: Path | None,
    timer: Timer | None = None,
    implementations: Implementations | None = None,
    block_step: BlockStep | None = None,
) -> Selection:
    """Rank 0's selection for `shapes` (each op from the cache where it holds an entry for this GPU, software, op
    and shape, else measured and added to it; then the block-level check where `block_step` builds the run's
    compiled block), on every rank and installed there; KernelChoiceError on every rank when any rank's key differs
    from rank 0's."""
    from appliance import __version__

    key = current_key(shapes, device, __version__)
    payload: list[Any] = [None]
    if dist.get_rank() == 0:
        timer = timer or default_timer(device)
        cache = SelectionCache.load(cache_file)
        selection = select(
            shapes, device, project_version=__version__, timer=timer, implementations=implementations, cache=cache
        )
        if block_step is not None:
            check_block(selection, block_step, timer, cache)
            torch._dynamo.reset()  # the engine compiles its blocks afresh, not after the check's graphs
        if cache_file is not None and cache.added:
            cache.save(cache_file)
        payload = [selection.to_json()]
    # NCCL moves the pickled object through a tensor on the current CUDA device; gloo through a CPU one.
    dist.broadcast_object_list(payload, src=0, device=device if device.type == "cuda" else None)
    selection = Selection.from_json(payload[0])
    differences: list[list[str]] = [[] for _ in range(dist.get_world_size())]
    dist.all_gather_object(differences, key.differences(selection.key))
    mismatched = {rank: found for rank, found in enumerate(differences) if found}
    if mismatched:
        raise KernelChoiceError(
            "kernel selection: ranks differ from rank 0, whose measured kernels they would run ("
            + "; ".join(f"rank {rank} vs rank 0: {', '.join(found)}" for rank, found in mismatched.items())
            + "); run every rank on one GPU model with one software stack, or set BLOOM_KERNELS=triton"
        )
    selection.apply()
    return selection


def block_step_for(
    config: BloomConfig, topology: ParallelTopology, shapes: RankShapes, device: torch.device, backend: str = "inductor"
) -> BlockStep | None:
    """The block-level check's block (kernels/selection_block.py): one of the run's dense blocks in its dtype on
    `device`, compiled as parallelize.compile_blocks compiles it (fullgraph, `backend`) anew under the registry's
    current choices, and one forward + backward of it on a micro-batch of random hidden states. None where a rank's
    block is not that one-rank block: tp, cp or tp2d > 1 (their blocks hold collectives) or MoE models."""
    from appliance.model.bloom import BloomBlock

    if topology.tp > 1 or topology.cp > 1 or topology.tp2d > 1 or config.moe_num_experts:
        return None
    block = BloomBlock(config).to(device=device, dtype=shapes.torch_dtype)
    block.alibi.slopes(device)  # cached before the trace, as compile_blocks does
    gen = torch.Generator().manual_seed(0)
    size = (shapes.micro_batch_size, shapes.seq_len, shapes.hidden)
    hidden = torch.randn(*size, generator=gen).to(device, shapes.torch_dtype).requires_grad_()
    grad = torch.randn(*size, generator=gen).to(device, shapes.torch_dtype)
    docs = document_ids(shapes.micro_batch_size, shapes.seq_len, device) if shapes.documents else None
    leaves = [hidden, *block.parameters()]

    def build() -> Callable[[], object]:
        torch._dynamo.reset()  # each combination traced afresh, never counted against dynamo's recompile limit
        forward = torch.compile(block.forward, fullgraph=True, backend=backend)
        return lambda: torch.autograd.grad(forward(hidden, None, docs), leaves, grad)

    return build


def kernel_record(selection: Selection | None, device: torch.device) -> dict[str, Any]:
    """What ds_config.json's "kernels" key and the `kernels` event say: the choice per op and the times (ms of one
    forward + backward at the rank's shapes), with where the choice came from: "measured" or "cache"; without a
    selection, "forced" (BLOOM_KERNELS=triton|reference) or "default" (CPU under auto: the torch twins), with the
    one backend every op runs."""
    if selection is not None:
        return {
            "source": selection.source,
            "choices": dict(selection.choices),
            "times_ms": {op: dict(times) for op, times in selection.times_ms.items()},
            "rejected": {op: dict(found) for op, found in selection.rejected.items()},
            "flash_tiles": None if selection.flash_tiles is None else selection.flash_tiles["chosen"],
            "cached": list(selection.cached),
            "block": None if selection.block is None else {k: selection.block[k] for k in ("chosen", "times_ms")},
            "device": selection.key.device,
            "shapes": vars(selection.key.shapes),
        }
    named = backend_env.given()
    if named:  # BLOOM_KERNELS named a backend per op: nothing measured, the rest as under auto
        return {
            "source": "given",
            "choices": registry.chosen(),
            "times_ms": {},
            "backend_env": f"{backend_env.BACKEND_ENV}={os.environ.get(backend_env.BACKEND_ENV, '')}",
        }
    forced = forced_backend()
    return {
        "source": "default" if forced is None else "forced",
        "backend": registry.get_backend(device),  # what every fused op runs: nothing was chosen per op
        "choices": {},
        "times_ms": {},
        "backend_env": f"{backend_env.BACKEND_ENV}={forced or 'auto'}",
    }
