"""The one switch between the Triton kernels, their pure-torch twins and the other implementations of each op.

The model calls only the functions below. Each picks its backend per call from the tensors it gets:
  BLOOM_KERNELS=auto (default): for CUDA tensors the backend `use()` chose for the op (default Triton), for CPU
                        tensors the torch reference;
  BLOOM_KERNELS=triton: always Triton (CPU tensors then need TRITON_INTERPRET=1 set before triton is imported,
                        which runs the kernels in Triton's CPU interpreter: how the tests exercise them);
  BLOOM_KERNELS=reference: always the torch twins.
Triton modules are imported on first use, so a machine without Triton still runs the reference path.

A call costs a table lookup. The table (`_Routes`: op -> backend for CUDA tensors, the forced backend, the imported
kernel modules, whether Triton interprets) is built once per distinct BLOOM_KERNELS value and rebuilt by `use()`;
each call reads the variable (tests change it per test) and compares it with the table's. Under torch.compile the
same Python runs once, when a block is traced: the choice is baked into the graph, and dynamo guards on the table
and the variable, so a later `use()` or a new value retraces instead of running a stale choice.

Which backends exist and the parsing of BLOOM_KERNELS live in kernels/backend_env.py; every implementation of each
op (the twin, torch.compile of it, the Triton modules, apex's LayerNorm, the attention peers), the list of them for
measuring (`implementations`) and the count of which one ran (`call_counts`) in kernels/op_backends.py.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.distributed as dist

from kernels import backend_env, op_backends
from kernels.backend_env import (
    BACKEND_ENV,
    KERNEL_MODULES,
    PEERS,
    SELECTABLE,
    KernelBackendError,
    triton_installed,
    valid_backends,
)
from kernels.op_backends import Implementation, Route, count, pick
from kernels.reference import alibi_slopes

__all__ = [
    "alibi_slopes",
    "alibi_softmax",
    "backend_for",
    "bias_gelu",
    "chosen",
    "flash_alibi_attention",
    "flash_alibi_attention_backward",
    "get_backend",
    "layer_norm",
    "use",
    "vocab_cross_entropy",
    "vocab_scores",
]


# ----- the table ----------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class _Routes:
    """What runs each op, for one BLOOM_KERNELS value and one set of choices: op -> Route."""

    raw: str | None  # BLOOM_KERNELS as the environment held it (None: unset)
    forced: str | None  # "triton" or "reference" when BLOOM_KERNELS forces every op; None under auto
    cuda: Mapping[str, Route]  # for CUDA tensors
    other: Mapping[str, Route]  # for tensors on any other device


_UNSET = "\0unbuilt"  # no environment value equals it: the first call builds the table
_EMPTY = _Routes(raw=_UNSET, forced=None, cuda={}, other={})
_routes = _EMPTY
_tables: dict[str | None, _Routes] = {}  # per BLOOM_KERNELS value seen, under the current choices
_choices: dict[str, str] = {}  # use()'s, op -> backend for CUDA tensors under auto


def _build(raw: str | None) -> _Routes:
    requested, named = backend_env.parse(raw)
    if requested == "triton" and not triton_installed():
        raise KernelBackendError(f"{BACKEND_ENV}=triton but the triton package is not installed")
    if requested != "auto":
        on_cpu = requested if requested == "reference" or op_backends.kernels_interpreted() else "needs-interpreter"
        cuda = {op: pick(op, requested) for op in KERNEL_MODULES}
        return _Routes(raw, requested, cuda, {op: pick(op, on_cpu) for op in KERNEL_MODULES})
    default = "triton" if triton_installed() else "reference"
    # Without CUDA nothing is built for it (Triton's modules stay unimported on a machine that cannot use them).
    choices = _choices | named  # the environment's names over use()'s measured ones
    cuda = {op: pick(op, choices.get(op, default)) for op in KERNEL_MODULES} if torch.cuda.is_available() else {}
    return _Routes(raw, None, cuda, {op: pick(op, "reference") for op in KERNEL_MODULES})


def _current() -> _Routes:
    raw = os.environ.get(BACKEND_ENV)
    routes = _routes
    if raw != routes.raw:
        routes = _switch(raw)
    return routes


def _switch(raw: str | None) -> _Routes:
    global _routes
    routes = _tables.get(raw)
    if routes is None:
        routes = _tables[raw] = _build(raw)
    _routes = routes
    return routes


def _route(op: str, tensor: torch.Tensor) -> Implementation:
    """The implementation of op for the tensor's device, counted: the one lookup a call makes."""
    routes = _routes
    raw = os.environ.get(BACKEND_ENV)
    if raw != routes.raw:
        routes = _switch(raw)
    _, run, counted_as = (routes.cuda if tensor.is_cuda else routes.other)[op]
    if counted_as is not None:
        count(counted_as)
    return run


def get_backend(where: torch.Tensor | torch.device | str | None = None) -> str:
    """'triton' or 'reference' for tensors on `where` (a tensor or device; None: this machine's default device),
    as BLOOM_KERNELS says, before any op's `use()` choice (backend_for gives that)."""
    routes = _current()
    if routes.forced is not None:
        return routes.forced
    if where is None:
        on_cuda = torch.cuda.is_available()
    else:
        on_cuda = (where.device if isinstance(where, torch.Tensor) else torch.device(where)).type == "cuda"
    return "triton" if on_cuda and triton_installed() else "reference"


def backend_for(op: str, tensor: torch.Tensor) -> str:
    """The backend `op` runs with on `tensor` ("reference", "compiled", "triton", "sdpa" or "flex")."""
    routes = _current()
    return (routes.cuda if tensor.is_cuda else routes.other)[op][0]


# ----- choosing backends for CUDA tensors ---------------------------------------------------------------------------
def use(choices: Mapping[str, str]) -> None:
    """The backend each op runs for CUDA tensors under BLOOM_KERNELS=auto from now on (ops not named keep the
    default: triton on CUDA, reference on CPU). Unknown op or backend: KernelBackendError naming it and the valid
    ones. use({}) restores the defaults. BLOOM_KERNELS=triton|reference still force, ignoring choices."""
    global _routes
    for op, backend in choices.items():
        if op not in SELECTABLE:
            raise KernelBackendError(f"use(): unknown op {op!r}; the selectable ops are {', '.join(SELECTABLE)}")
        if backend not in valid_backends(op):
            raise KernelBackendError(f"use(): {op} has no backend {backend!r}; valid: {', '.join(valid_backends(op))}")
        if backend == "triton" and not triton_installed():
            raise KernelBackendError(f"use(): {op}=triton but the triton package is not installed")
        if backend in PEERS and op_backends.attention_peers() is None:
            raise KernelBackendError(f"use(): {op}={backend} needs kernels/attention_peers.py, which is not here")
    _choices.clear()
    _choices.update(choices)
    _tables.clear()
    _routes = _EMPTY
    _build_now()


def chosen() -> dict[str, str]:
    """The backend each selectable op runs with for CUDA tensors under BLOOM_KERNELS=auto (defaults included)."""
    default = "triton" if triton_installed() else "reference"
    choices = _choices | backend_env.given()
    return {op: choices.get(op, default) for op in SELECTABLE}


# ----- the ops ----------------------------------------------------------------------------------------------------
def layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float = 1e-5) -> torch.Tensor:
    """LayerNorm over the last dim, fp32 statistics, output in x's dtype (rows wider than 16384: torch twin)."""
    return _route("layer_norm", x)(x, weight, bias, eps)


def bias_gelu(x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """gelu_tanh(x + bias), bias over the last dim; output in x's dtype."""
    return _route("bias_gelu", x)(x, bias)


def alibi_softmax(
    scores: torch.Tensor,
    slopes: torch.Tensor,
    padding_mask: torch.Tensor | None = None,
    scale: float = 1.0,
    causal: bool = True,
) -> torch.Tensor:
    """softmax(scale * scores + slope_h * pos_j) with causal/padding masks, fp32 math, output in scores' dtype.

    scores [batch, heads, q_len, k_len]; slopes [heads] (see alibi_slopes); padding_mask [batch, k_len] with
    nonzero for real tokens (transformers' attention_mask) or None. Full contract: kernels.reference.alibi_softmax.
    More than 16384 keys: the torch twin (the flash path is the one for long sequences).
    """
    return _route("alibi_softmax", scores)(scores, slopes, padding_mask, scale, causal)


def flash_alibi_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    slopes: torch.Tensor,
    causal: bool = True,
    scale: float | None = None,
    *,
    q_offset: int | None = None,
    k_offset: int = 0,
    q_doc: torch.Tensor | None = None,
    k_doc: torch.Tensor | None = None,
    return_lse: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """softmax(scale * q k^T + ALiBi, causal) v for q [b, h, q_len, d], k/v [b, h, k_len, d]; scale 1/sqrt(d).

    Queries are right-aligned with the keys (q_len < k_len: the last q_len positions) unless q_offset/k_offset
    give the global positions of the first query and key (the causal mask and the bias use them); q_doc
    [b, q_len] and k_doc [b, k_len] (integer document ids) hide keys of another document; return_lse adds the
    natural-log logsumexp per query row [b, h, q_len] (fp32, fp64 for fp64 inputs on the twin; -inf where a
    row sees no key; no gradient). Full contract: kernels.reference.flash_alibi_attention. Head dims up to 128
    run fused; wider ones fall back to the materialized torch twin. With "sdpa" or "flex" chosen, the calls
    those support (causal self-attention over whole sequences, no return_lse) go to them, the rest to Triton.
    """
    return _route("flash_alibi_attention", q)(
        q, k, v, slopes, causal, scale, q_offset=q_offset, k_offset=k_offset, q_doc=q_doc, k_doc=k_doc,
        return_lse=return_lse,
    )  # fmt: skip


def flash_alibi_attention_backward(
    do: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    lse: torch.Tensor,
    delta: torch.Tensor,
    slopes: torch.Tensor,
    scale: float,
    *,
    causal: bool = True,
    q_offset: int | None = None,
    k_offset: int = 0,
    q_doc: torch.Tensor | None = None,
    k_doc: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """dq, dk, dv of one key chunk's share of an attention, given each query row's logsumexp `lse` (natural log,
    as flash_alibi_attention returns it, merged over all key chunks) and delta = rowsum(O * dO) of the final
    output. Arguments as flash_alibi_attention; contract: kernels.reference.flash_alibi_attention_backward.
    Triton on CUDA (the chunked calls it serves are never the peers'), as BLOOM_KERNELS says otherwise."""
    return _route("flash_alibi_attention_backward", q)(
        do, q, k, v, lse, delta, slopes, scale, causal=causal, q_offset=q_offset, k_offset=k_offset, q_doc=q_doc,
        k_doc=k_doc,
    )  # fmt: skip


def vocab_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    *,
    chunk_size: int | None = None,
    ignore_index: int = -100,
    tp_group: dist.ProcessGroup | None = None,
    reduction: str = "mean",
) -> torch.Tensor:
    """CE of hidden @ weight.T vs labels over non-ignored tokens, without the full fp32 logits.

    hidden [..., H] (replicated across tp_group), weight [V_local, H] (this rank's contiguous vocab shard, or the
    whole vocab without TP), labels [...] global token ids. chunk_size: tokens per chunk (None: logits chunk about
    the size of hidden). With tp_group the loss is the full-vocab loss on every rank and the hidden gradient is
    already summed over the group. reduction: "mean" (all labels ignored gives 0), "sum" (padded evaluation
    micro-batches), "none" (per-token fp32 losses shaped like labels, 0 where ignored; no gradient).
    """
    return _route("vocab_cross_entropy", hidden)(
        hidden, weight, labels, chunk_size=chunk_size, ignore_index=ignore_index, tp_group=tp_group,
        reduction=reduction,
    )  # fmt: skip


def vocab_scores(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor | None,
    *,
    chunk_size: int | None = None,
    tp_group: dist.ProcessGroup | None = None,
) -> tuple[torch.Tensor | None, torch.Tensor]:
    """Evaluation's view of the same chunked pass: (log p(target) [...] fp32, or None when targets is None;
    greedy token [...] int64, the lowest global id of the largest logit) for hidden [..., H] and this rank's
    vocab shard weight [V_local, H]; the same on every rank of tp_group. No gradient."""
    return _route("vocab_scores", hidden)(hidden, weight, targets, chunk_size=chunk_size, tp_group=tp_group)


def _build_now() -> None:
    """The table for the current BLOOM_KERNELS, built now rather than by the first call, which may come inside a
    torch.compile trace: the trace then reads the table instead of building it, and the guards it leaves on the
    table hold from the first step on. A bad BLOOM_KERNELS value is reported by that first call."""
    with contextlib.suppress(KernelBackendError):
        _switch(os.environ.get(BACKEND_ENV))


_build_now()
