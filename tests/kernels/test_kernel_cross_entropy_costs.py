"""What the chunked cross entropy costs on a GPU, made visible on CPU: the bytes of the [V, H] weight it moves per
step (counted on meta tensors at bloom-560m's shapes), the Triton launch grids as an H100 would get them, the host
syncs of a training step (none), and the chunk rule the planner prices."""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from kernels import chunked_ce, cross_entropy, reference, registry
from kernels.launch import H100, recording

aten = torch.ops.aten

# bloom-560m's LM head: hidden 1024, padded vocabulary 250,880 (presets/models/bloom-560m.toml), bf16, one
# micro-batch of 2 x 2048 tokens.
TOKENS, HIDDEN, VOCAB = 4096, 1024, 250880
WEIGHT_BYTES = VOCAB * HIDDEN * 2  # 514 MB

SYNCING = {aten._local_scalar_dense.default, aten.nonzero.default, aten.is_nonzero.default, aten.masked_select.default}
# Ops that only allocate, and ops that write without reading their tensor arguments' data.
ALLOCATING = {aten.empty_like.default, aten.empty.memory_format, aten.empty_strided.default, aten.new_empty.default}
WRITE_ONLY = {aten.zeros_like.default, aten.zero_.default, aten.fill_.Scalar, aten.new_zeros.default}


def _is_view(func: Any) -> bool:
    # a return that aliases an input without writing it (t, view, detach, ...) moves no bytes
    returns = func._schema.returns
    return bool(returns) and all(r.alias_info is not None and not r.alias_info.is_write for r in returns)


class WeightTraffic(TorchDispatchMode):
    """Bytes read and written of tensors shaped like the weight ([V, H] or its transpose), op by op."""

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        self.shapes = {tuple(weight.shape), tuple(weight.shape[::-1])}
        self.bytes = 0
        self.by_op: Counter[str] = Counter()

    def _count(self, func: Any, tensors: list[Any]) -> None:
        for t in tensors:
            if isinstance(t, torch.Tensor) and tuple(t.shape) in self.shapes:
                self.bytes += t.numel() * t.element_size()
                self.by_op[str(func)] += t.numel() * t.element_size()

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func in ALLOCATING or _is_view(func):
            return out
        if func not in WRITE_ONLY:
            self._count(func, tree_leaves((args, {k: v for k, v in kwargs.items() if k != "out"})))
        self._count(func, tree_leaves(out))
        return out


class HostSyncs(TorchDispatchMode):
    """Ops that make the host wait for the device: a scalar read (item, int(), bool()), nonzero, boolean-mask
    indexing (which runs nonzero inside)."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: Counter[str] = Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        indices = args[1] if func in (aten.index.Tensor, aten.index_put_.default, aten.index_put.default) else ()
        masked = any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in indices)
        if func in SYNCING or masked:
            self.seen[str(func)] += 1
        return func(*args, **kwargs)


def _meta_head(tokens: int, hidden: int, vocab: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    h = torch.empty(tokens, hidden, dtype=torch.bfloat16, device="meta", requires_grad=True)
    w = torch.empty(vocab, hidden, dtype=torch.bfloat16, device="meta", requires_grad=True)
    return h, w, torch.empty(tokens, dtype=torch.int64, device="meta")


def test_weight_traffic_at_bloom_560m_is_at_most_four_weights(monkeypatch: pytest.MonkeyPatch) -> None:
    """Forward and backward of the twin with the GPU chunk rule (inside recording(H100)): the whole micro-batch is
    one chunk (4096 x 250,880 x 2 B = 2.06e9 B <= 2 GiB), so the weight is read by the logits GEMM, read by the
    hidden-gradient GEMM and its gradient written once in backward: 3 x 514 MB = 1.54 GB.
    The driver before the GPU rule cut these 4096 tokens into 128 chunks of 32 and, with this counter, moved
    515 weights = 265 GB (each chunk: W read twice, the gradient read and written by addmm_; a zeros pass first and
    the backward's scaling by the incoming gradient last)."""
    monkeypatch.setenv("BLOOM_KERNELS", "reference")
    h, w, labels = _meta_head(TOKENS, HIDDEN, VOCAB)
    traffic = WeightTraffic(w)
    with recording(H100), traffic:
        loss = registry.vocab_cross_entropy(h, w, labels)
        loss.backward(torch.empty_like(loss))
    assert w.grad is not None and w.grad.shape == w.shape
    assert traffic.bytes == 3 * WEIGHT_BYTES, traffic.by_op
    assert traffic.bytes <= 4 * WEIGHT_BYTES


def test_several_chunks_write_the_weight_gradient_without_a_zeros_pass(monkeypatch: pytest.MonkeyPatch) -> None:
    """Twice the micro-batch (8192 tokens: 4.1e9 B of logits) takes two 4096-token chunks: per chunk W read twice,
    the first chunk's gradient written (beta = 0), the second read and written, then the backward's scaling read
    and write: 2 x 2 + 1 + 2 + 2 = 9 weights (4 n + 1)."""
    monkeypatch.setenv("BLOOM_KERNELS", "reference")
    h, w, labels = _meta_head(2 * TOKENS, HIDDEN, VOCAB)
    traffic = WeightTraffic(w)
    with recording(H100), traffic:
        loss = registry.vocab_cross_entropy(h, w, labels)
        loss.backward(torch.empty_like(loss))
    assert traffic.bytes == 9 * WEIGHT_BYTES, traffic.by_op
    assert str(aten.zeros_like.default) not in traffic.by_op


def _fake_tp(monkeypatch: pytest.MonkeyPatch, rank: int) -> object:
    """A stand-in tensor-parallel group for meta tensors: this rank's index, all-reduces that leave the data as is
    (meta tensors hold none). Only the launches are looked at."""
    group = object()
    monkeypatch.setattr(dist, "get_rank", lambda g=None: rank if g is group else 0)
    monkeypatch.setattr(dist, "all_reduce", lambda tensor, op=None, group=None: None)
    return group


@pytest.mark.parametrize(
    ("model", "tokens", "hidden", "vocab", "tp"),
    [
        ("bloom-560m", 4096, 1024, 250880, 1),
        ("bloom-1b7", 2048, 2048, 250880, 1),  # micro-batch 1 x 2048
        ("bloom-1b7", 4096, 2048, 250880, 1),
        ("bloom-176b", 4096, 14336, 62720, 4),  # its reference layout: tp 4, micro-batch 2 x 2048
    ],
)
def test_launch_grids_fill_an_h100(model, tokens, hidden, vocab, tp, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every row kernel of a training step gets at least one program per H100 SM (132): one chunk of the whole
    micro-batch, one program per row. One rank: one fused launch per chunk; tp > 1: statistics, then gradient."""
    h, w, labels = _meta_head(tokens, hidden, vocab)
    group = _fake_tp(monkeypatch, rank=tp - 1) if tp > 1 else None
    with recording(H100) as launches:
        loss = cross_entropy.vocab_cross_entropy(h, w, labels, tp_group=group)  # type: ignore[arg-type]
        loss.backward(torch.empty_like(loss))
    names = [launch.kernel.__name__ for launch in launches]
    assert names == (["_ce_fused_kernel"] if tp == 1 else ["_ce_stats_kernel", "_ce_grad_kernel"]), model
    for launch in launches:
        assert launch.grid == (tokens,) and launch.grid[0] >= H100.multiprocessors, (model, launch.grid)
        assert launch.options["BLOCK_V"] == 4096 and launch.options["num_warps"] == 8
    assert h.grad is not None and w.grad is not None


def _small_problem(tokens: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(5)
    h = torch.randn(tokens, 16, generator=gen).to(device).requires_grad_()
    w = torch.randn(50, 16, generator=gen).to(device).requires_grad_()
    labels = torch.randint(0, 50, (tokens,), generator=gen).to(device)
    labels[1] = -100
    return h, w, labels


@pytest.mark.parametrize("backend", ["reference", "triton"])
@pytest.mark.parametrize("chunk_size", [None, 4])  # one chunk (GEMMs deferred to backward), several
def test_a_training_step_never_waits_for_the_host(backend: str, chunk_size: int | None, device) -> None:
    """Forward and backward of the mean loss without a scalar read or nonzero; the Triton path in the interpreter
    (on a GPU, compiled). The control at the end shows the counter sees a host read."""
    fn = {"reference": reference.vocab_cross_entropy, "triton": cross_entropy.vocab_cross_entropy}[backend]
    h, w, labels = _small_problem(13, device)
    syncs = HostSyncs()
    with syncs:
        loss = fn(h, w, labels, chunk_size=chunk_size)
        (0.25 * loss).backward()
    assert syncs.seen == {}, syncs.seen
    assert h.grad is not None and w.grad is not None
    with syncs:
        int(labels.sum())
        labels[labels > 0]
    assert set(syncs.seen) == {str(aten._local_scalar_dense.default), str(aten.index.Tensor)}


@pytest.mark.parametrize(
    ("tokens", "vocab", "logit_bytes", "chunk"),
    [
        (4096, 250880, 2, 4096),  # bloom-560m, 2 x 2048: 2.06e9 B <= 2 GiB, the whole micro-batch
        (8192, 250880, 2, 4096),  # 4.1e9 B: 2^31 / 501,760 B per token = 4279 -> 4096
        (4096, 250880, 4, 2048),  # fp32 logits: 2^31 / 1,003,520 = 2139 -> 2048
        (16384, 62720, 2, 16384),  # BLOOM-176B's tp=4 shard at 8 x 2048: 2.06e9 B, one chunk
        (65536, 62720, 2, 16384),  # 2^31 / 125,440 = 17,119 -> 16,384
        (4096, 2_000_000, 2, 1024),  # 1024 tokens would pass 2 GiB (4.1e9 B): never fewer than 1024
        (300, 2_000_000, 2, 300),  # ... nor more than the micro-batch
        (13, 50, 4, 13),
    ],
)
def test_gpu_chunk_rule(tokens: int, vocab: int, logit_bytes: int, chunk: int) -> None:
    assert chunked_ce.auto_chunk_size(tokens, 1024, vocab, gpu=True, logit_bytes=logit_bytes) == chunk
    # the CPU rule stays what it was measured as: bloom-560m's head there takes 32-token chunks
    assert chunked_ce.auto_chunk_size(4096, 1024, 250880) == 32
