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

from kernels import chunked_ce, cross_entropy, reference, registry

BACKENDS = {"triton": cross_entropy.vocab_cross_entropy, "reference": reference.vocab_cross_entropy}


def _problem(tokens: int, hidden: int, vocab: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    h = torch.randn(tokens, hidden, generator=gen)
    w = 0.5 * torch.randn(vocab, hidden, generator=gen)
    labels = torch.randint(0, vocab, (tokens,), generator=gen)
    labels[2] = -100
    labels[-1] = -100
    return h, w, labels


def _full_logits_ce(
    h: torch.Tensor, w: torch.Tensor, labels: torch.Tensor, grad_loss: float = 1.0
) -> tuple[torch.Tensor, ...]:
    """F.cross_entropy on the full fp32 logits: the loss, and the gradients of grad_loss x loss."""
    h32, w32 = h.detach().float().requires_grad_(), w.detach().float().requires_grad_()
    loss = F.cross_entropy(h32 @ w32.t(), labels, ignore_index=-100)
    (grad_loss * loss).backward()
    return loss.detach(), h32.grad, w32.grad


@pytest.mark.parametrize("backend", sorted(BACKENDS))
@pytest.mark.parametrize(
    ("dtype", "chunk_size"),
    [(torch.float32, 5), (torch.float32, None), (torch.bfloat16, None), (torch.bfloat16, 5), (torch.float32, 64)],
)
def test_matches_full_logits(backend, dtype, chunk_size, device, assert_matches) -> None:
    """13 tokens in chunks of 5 (ragged last chunk; gradients in forward) or in one chunk (None on CPU: 13 tokens,
    or 64 > 13; gradient GEMMs in backward); vocab 50 = two interpreter blocks of 32, ragged. Two ignored rows, and
    the loss times 0.25 before backward, as DeepSpeed divides it by the accumulation steps."""
    h, w, labels = _problem(13, 16, 50, seed=11)
    expected, dh32, dw32 = _full_logits_ce(h, w, labels, grad_loss=0.25)
    h = h.to(device, dtype).requires_grad_()
    w = w.to(device, dtype).requires_grad_()
    loss = BACKENDS[backend](h, w, labels.to(device), chunk_size=chunk_size)
    (0.25 * loss).backward()
    assert loss.dtype == torch.float32
    assert_matches(loss, expected, dtype)
    assert_matches(h.grad, dh32, dtype)
    assert_matches(w.grad, dw32, dtype)


@pytest.mark.parametrize("backend", sorted(BACKENDS))
@pytest.mark.parametrize("chunk_size", [None, 2])
def test_all_rows_ignored_gives_zero_loss_and_gradients(backend: str, chunk_size: int | None, device) -> None:
    """The mean over no counted token is 0 and so is every gradient (1 / count stays on the device as 1 / max(0, 1),
    and every row's scale is 0): never NaN."""
    h, w, labels = _problem(5, 8, 40, seed=15)
    h, w = h.to(device).requires_grad_(), w.to(device).requires_grad_()
    loss = BACKENDS[backend](h, w, torch.full_like(labels, -100).to(device), chunk_size=chunk_size)
    (0.5 * loss).backward()
    assert loss.item() == 0.0
    assert bool((h.grad == 0).all()) and bool((w.grad == 0).all())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_one_rank_single_pass_equals_the_two_step_rows(dtype: torch.dtype, reduction: str) -> None:
    """The torch twin's one-rank path (ce_row_single: loss and gradient from one softmax) against the two passes
    the tensor-parallel path shares with the Triton kernels, on the same chunks: both leave the row scale (1 / count,
    ignored rows 0) to the GEMMs' [rows, H] operands. Losses equal to fp32 rounding (both take lse from the largest
    probability); gradients to fp32 rounding, and in bf16 within one bf16 rounding of the gradient chunk (the
    two-step path rounds exp(x - lse) - onehot to bf16 in place, the single pass rounds its fp32 softmax)."""
    h, w, labels = _problem(13, 16, 50, seed=21)
    h, w = h.to(dtype), w.to(dtype)
    runs = {}
    for single in (None, chunked_ce.ce_row_single):
        runs[single is None] = chunked_ce.chunked_vocab_ce(
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


def test_a_row_whose_target_probability_underflows_keeps_its_loss(device) -> None:
    """A target 200 nats below the row's best logit: p_target underflows fp32, so the loss comes from the largest
    probability's logsumexp (x_max - log p_max), on every path, without a host-side test for such rows."""
    h = torch.zeros(2, 2)
    h[0, 0] = 1.0
    w = torch.tensor([[0.0, 0.0], [200.0, 0.0], [0.0, 1.0]])  # row 0: logits (0, 200, 0), target 0
    labels = torch.tensor([0, 2])
    expected = F.cross_entropy(h @ w.t(), labels, reduction="none")
    assert expected[0] > 199
    h, w, labels, expected = h.to(device), w.to(device), labels.to(device), expected.to(device)
    for fn in BACKENDS.values():
        per_token = fn(h, w, labels, reduction="none")
        # both paths equal F.cross_entropy bit for bit here (2e-8 from fp64); the bound leaves room for another
        # CPU's exp and log (~1e-5)
        torch.testing.assert_close(per_token, expected, rtol=1e-6, atol=1e-5)


def test_batched_input_and_no_grad(device, triton_backend, monkeypatch: pytest.MonkeyPatch) -> None:
    """[3, 4, H] hidden states flatten like their labels. Under no_grad (evaluation) the one fused launch of the
    chunk skips its gradient pass; with a gradient it writes it."""
    h, w, labels = _problem(12, 8, 20, seed=12)
    h3, lab3, w_dev = h.view(3, 4, 8).to(device), labels.view(3, 4).to(device), w.to(device).requires_grad_()
    expected, _, _ = _full_logits_ce(h, w, labels)
    launched: list[tuple[str, object]] = []
    real_launch = cross_entropy.launch

    def spy(kernel, grid, *args, **options) -> None:
        launched.append((kernel.__name__, options.get("WRITE_GRAD")))
        real_launch(kernel, grid, *args, **options)

    monkeypatch.setattr(cross_entropy, "launch", spy)
    with torch.no_grad():
        torch.testing.assert_close(registry.vocab_cross_entropy(h3, w_dev, lab3), expected.to(device))
    assert launched == [("_ce_fused_kernel", False)]
    launched.clear()
    h_dev = h3.clone().requires_grad_()
    registry.vocab_cross_entropy(h_dev, w_dev, lab3).backward()
    assert launched == [("_ce_fused_kernel", True)]
    assert h_dev.grad is not None and h_dev.grad.shape == h3.shape


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
    assert chunked_ce.auto_chunk_size(4096, 14336, 62720) == 1024
    assert chunked_ce.auto_chunk_size(3, 16, 50) == 3  # the floor of 2^22 logits: all three tokens in one chunk
    # bloom-tiny-cpu's head: Liger's rule alone would give 16-token chunks; the floor makes them 512 (2^22 / 8192)
    assert chunked_ce.auto_chunk_size(1024, 128, 8192) == 512


def _tp_worker(rank: int, world: int, init_file: str, device: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        h, w, labels = _problem(11, 16, 50, seed=13)  # 25 vocab rows per rank
        expected, dh32, dw32 = (t.to(device) for t in _full_logits_ce(h, w, labels, grad_loss=0.25))
        h, w, labels = h.to(device), w.to(device), labels.to(device)
        shard = slice(rank * 25, (rank + 1) * 25)
        for backend in ("triton", "reference"):
            os.environ["BLOOM_KERNELS"] = backend
            # 11 tokens in chunks of 4 (gradients in forward) and in one chunk (gradient GEMMs in backward, the
            # hidden gradient all-reduced there)
            for chunk_size in (4, None):
                h_rank = h.clone().requires_grad_()
                w_rank = w[shard].clone().requires_grad_()
                loss = registry.vocab_cross_entropy(
                    h_rank, w_rank, labels, chunk_size=chunk_size, tp_group=dist.group.WORLD
                )
                (0.25 * loss).backward()
                where = f"{backend}, chunk_size={chunk_size}"
                torch.testing.assert_close(loss, expected, atol=1e-5, rtol=1e-5, msg=where)
                torch.testing.assert_close(h_rank.grad, dh32, atol=1e-5, rtol=1e-5, msg=where)  # summed over ranks
                torch.testing.assert_close(w_rank.grad, dw32[shard], atol=1e-5, rtol=1e-5, msg=where)
    finally:
        dist.destroy_process_group()


@pytest.mark.distributed
def test_vocab_parallel_two_ranks(tmp_path: Path, device: torch.device) -> None:
    # Both ranks share one device when there is a GPU (gloo all-reduces CUDA tensors too).
    mp.spawn(_tp_worker, args=(2, str(tmp_path / "rendezvous"), device.type), nprocs=2, join=True)
