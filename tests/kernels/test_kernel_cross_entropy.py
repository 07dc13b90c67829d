"""Chunked vocabulary cross-entropy (both backends) vs plain full-logits cross-entropy, on one rank and on two
vocab-parallel gloo ranks."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

from kernels import cross_entropy, reference, registry

BACKENDS = {"triton": cross_entropy.vocab_cross_entropy, "reference": reference.vocab_cross_entropy}


def _problem(tokens: int, hidden: int, vocab: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    h = torch.randn(tokens, hidden, generator=gen)
    w = 0.5 * torch.randn(vocab, hidden, generator=gen)
    labels = torch.randint(0, vocab, (tokens,), generator=gen)
    labels[2] = -100
    labels[-1] = -100
    return h, w, labels


def _full_logits_ce(h: torch.Tensor, w: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, ...]:
    h32, w32 = h.detach().float().requires_grad_(), w.detach().float().requires_grad_()
    loss = F.cross_entropy(h32 @ w32.t(), labels, ignore_index=-100)
    loss.backward()
    return loss, h32.grad, w32.grad


@pytest.mark.parametrize("backend", sorted(BACKENDS))
@pytest.mark.parametrize(("dtype", "chunk_size"), [(torch.float32, 5), (torch.bfloat16, None), (torch.float32, 64)])
def test_matches_full_logits(backend, dtype, chunk_size, device, assert_matches) -> None:
    # 13 tokens in chunks of 5 (ragged last chunk); vocab 50 = two interpreter blocks of 32, ragged
    h, w, labels = _problem(13, 16, 50, seed=11)
    expected, dh32, dw32 = _full_logits_ce(h, w, labels)
    h = h.to(device, dtype).requires_grad_()
    w = w.to(device, dtype).requires_grad_()
    loss = BACKENDS[backend](h, w, labels.to(device), chunk_size=chunk_size)
    loss.backward()
    assert loss.dtype == torch.float32
    assert_matches(loss, expected, dtype)
    assert_matches(h.grad, dh32, dtype)
    assert_matches(w.grad, dw32, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_one_rank_single_pass_equals_the_two_step_rows(dtype: torch.dtype, reduction: str) -> None:
    """The torch twin's one-rank path (ce_row_single: statistics and gradient from one softmax, 1 / count folded
    into the GEMMs) against the two passes the tensor-parallel path and the Triton kernels share, on the same chunks:
    losses (x_t - log p_t instead of max + log sum) and gradients equal to fp32 rounding, and in bf16 within one
    bf16 rounding of the gradient chunk (the paths round it to bf16 before and after the 1 / count scale)."""
    h, w, labels = _problem(13, 16, 50, seed=21)
    h, w = h.to(dtype), w.to(dtype)
    runs = {}
    for single in (None, reference.ce_row_single):
        runs[single is None] = reference.chunked_vocab_ce(
            h, w, labels, chunk_size=5, ignore_index=-100, tp_group=None, want_grad=(True, True),
            reduction=reduction, row_single=single,
        )  # fmt: skip
    two_step, one_pass = runs[True], runs[False]
    torch.testing.assert_close(one_pass.losses, two_step.losses, rtol=1e-6, atol=1e-6)
    assert bool((one_pass.losses[labels == -100] == 0).all())
    tol = {torch.float32: 1e-6, torch.bfloat16: 1e-2}[dtype]  # bf16: 2^-7 relative, one rounding of the chunk
    for got, want in ((one_pass.grad_hidden, two_step.grad_hidden), (one_pass.grad_weight, two_step.grad_weight)):
        assert got is not None and want is not None
        torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)


def test_batched_input_all_ignored_and_no_grad(device, triton_backend, monkeypatch: pytest.MonkeyPatch) -> None:
    h, w, labels = _problem(12, 8, 20, seed=12)
    h3, lab3 = h.view(3, 4, 8).to(device), labels.view(3, 4).to(device)
    expected, _, _ = _full_logits_ce(h, w, labels)
    with torch.no_grad(), monkeypatch.context() as patch:  # evaluation: the loss only, no gradient pass
        patch.setattr(cross_entropy, "ce_row_grad_", lambda *args: pytest.fail("gradient computed under no_grad"))
        w_dev = w.to(device).requires_grad_()
        torch.testing.assert_close(registry.vocab_cross_entropy(h3, w_dev, lab3), expected.to(device))
    w_dev = w.to(device).requires_grad_()
    nothing = registry.vocab_cross_entropy(h3, w_dev, torch.full_like(lab3, -100))
    nothing.backward()
    assert nothing.item() == 0.0 and w_dev.grad.abs().sum() == 0


@pytest.mark.parametrize("backend", ["triton", "reference"])
def test_sum_per_token_and_scores_match_full_logits(backend, device, monkeypatch: pytest.MonkeyPatch) -> None:
    """Evaluation's reductions and scores from the same chunks: sum (with its gradient), per-token losses, target
    log-probabilities and the greedy token (a tie broken towards the lower id, as torch.argmax does)."""
    monkeypatch.setenv("BLOOM_KERNELS", backend)
    h, w, labels = _problem(13, 16, 50, seed=14)
    w[3] = w[7] = 2.0  # tokens 3 and 7 tie on every row ...
    h[4] = 1.0  # ... and lead row 4 by far (32 against about N(0, 2^2) for the others)
    h, w, labels = h.to(device), w.to(device), labels.to(device)
    logits = (h @ w.t()).float()
    h_sum = h.clone().requires_grad_()
    total = registry.vocab_cross_entropy(h_sum, w, labels, chunk_size=5, reduction="sum")
    total.backward()
    h_ref = h.clone().requires_grad_()
    expected = F.cross_entropy(h_ref @ w.t(), labels, reduction="sum")
    expected.backward()
    torch.testing.assert_close(total, expected, atol=1e-4, rtol=2e-5)
    torch.testing.assert_close(h_sum.grad, h_ref.grad, atol=2e-5, rtol=2e-5)
    with torch.no_grad():
        per_token = registry.vocab_cross_entropy(h, w, labels.view(1, 13), chunk_size=5, reduction="none")
        logprobs, greedy = registry.vocab_scores(h, w, labels.clamp(min=0), chunk_size=5)
        _, next_token = registry.vocab_scores(h[-2:], w, None)
    full = F.cross_entropy(logits, labels, reduction="none")
    torch.testing.assert_close(per_token, full.view(1, 13), atol=2e-5, rtol=2e-5)
    log_softmax = torch.log_softmax(logits, dim=-1)
    torch.testing.assert_close(logprobs, log_softmax.gather(1, labels.clamp(min=0)[:, None]).squeeze(1))
    assert torch.equal(greedy, logits.argmax(dim=-1)) and greedy[4] == 3
    assert torch.equal(next_token, logits[-2:].argmax(dim=-1))
    with pytest.raises(ValueError, match="reduction='none'"):
        registry.vocab_cross_entropy(h.clone().requires_grad_(), w, labels, reduction="none")


def test_auto_chunk_size_bounds_logits() -> None:
    # BLOOM-176B head, tp=4: 4096 tokens, hidden 14336, 62720 vocab rows per rank -> the logits chunk of 1024
    # tokens holds about as many elements as the hidden states
    assert reference.auto_chunk_size(4096, 14336, 62720) == 1024
    assert reference.auto_chunk_size(3, 16, 50) == 3  # the floor of 2^22 logits: all three tokens in one chunk
    # bloom-tiny-cpu's head: Liger's rule alone would give 16-token chunks; the floor makes them 512 (2^22 / 8192)
    assert reference.auto_chunk_size(1024, 128, 8192) == 512


def _tp_worker(rank: int, world: int, init_file: str, device: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        h, w, labels = _problem(11, 16, 50, seed=13)  # 25 vocab rows per rank
        expected, dh32, dw32 = (t.to(device) for t in _full_logits_ce(h, w, labels))
        h, w, labels = h.to(device), w.to(device), labels.to(device)
        shard = slice(rank * 25, (rank + 1) * 25)
        for backend in ("triton", "reference"):
            os.environ["BLOOM_KERNELS"] = backend
            h_rank = h.clone().requires_grad_()
            w_rank = w[shard].clone().requires_grad_()
            loss = registry.vocab_cross_entropy(h_rank, w_rank, labels, chunk_size=4, tp_group=dist.group.WORLD)
            loss.backward()
            torch.testing.assert_close(loss, expected, atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(h_rank.grad, dh32, atol=1e-5, rtol=1e-5)  # already summed over ranks
            torch.testing.assert_close(w_rank.grad, dw32[shard], atol=1e-5, rtol=1e-5)
    finally:
        dist.destroy_process_group()


@pytest.mark.distributed
def test_vocab_parallel_two_ranks(tmp_path: Path, device: torch.device) -> None:
    # Both ranks share one device when there is a GPU (gloo all-reduces CUDA tensors too).
    mp.spawn(_tp_worker, args=(2, str(tmp_path / "rendezvous"), device.type), nprocs=2, join=True)
