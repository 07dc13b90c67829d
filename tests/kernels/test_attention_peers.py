"""SDPA and FlexAttention peers of the flash kernel vs the materialized fp32 reference (kernels.reference)."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from kernels import attention_peers as peers
from kernels import reference

ON_GPU = torch.cuda.is_available()

SHAPES = [
    # (batch, heads, seq, head_dim): seq not a multiple of 128 (flex's block) nor of 8 (the bias row alignment)
    (2, 3, 37, 64),
    (1, 2, 130, 80),  # head dim 80 (BLOOM-3b), two flex blocks, the second ragged
    (1, 2, 45, 128),
]
DTYPES = [torch.float32, torch.bfloat16]


def _inputs(dims, dtype, device, documents: bool, seed: int = 3):
    b, h, s, d = dims
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(b, h, s, d, generator=gen).to(device, dtype).requires_grad_() for _ in range(3))
    slopes = reference.alibi_slopes(h, device)
    docs = None
    if documents:  # three documents in the first sample, one document boundary elsewhere in the second
        docs = torch.zeros(b, s, dtype=torch.long)
        docs[0, s // 4 :] = 1
        docs[0, s // 2 :] = 2
        docs[-1, s // 3 :] += 5
        docs = docs.to(device)
    grad = torch.randn(b, h, s, d, generator=gen).to(device, dtype)
    return q, k, v, slopes, docs, grad


def _reference(q, k, v, slopes, docs, grad):
    q32, k32, v32 = (t.detach().float().requires_grad_() for t in (q, k, v))
    out = reference.flash_alibi_attention(q32, k32, v32, slopes, True, q_doc=docs, k_doc=docs)
    return out, torch.autograd.grad(out, (q32, k32, v32), grad.float())


@pytest.mark.parametrize("documents", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("dims", SHAPES)
def test_sdpa_matches_reference_with_gradients(dims, dtype, documents, device, assert_matches) -> None:
    q, k, v, slopes, docs, grad = _inputs(dims, dtype, device, documents)
    out = peers.sdpa_alibi_attention(q, k, v, slopes, q_doc=docs, k_doc=docs)
    grads = torch.autograd.grad(out, (q, k, v), grad)
    expected, expected_grads = _reference(q, k, v, slopes, docs, grad)
    assert out.dtype == dtype and out.shape == q.shape
    # Measured on CPU (SDPA's math backend): fp32 within 2.4e-6 of the reference; bf16 within 0.009 (output) and
    # 0.038 (gradients) where the bf16-rounded reference itself is 0.008 and 0.016 away. The fused GPU backends
    # round P and dS to bf16 before their products, as the flash kernel does: its test's factor 5 for gradients.
    assert_matches(out, expected, dtype)
    for got, want in zip(grads, expected_grads, strict=True):
        assert_matches(got, want, dtype, scale=5)


@pytest.mark.parametrize("documents", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("dims", SHAPES)
def test_flex_forward_matches_reference(dims, dtype, documents, device, assert_matches) -> None:
    q, k, v, slopes, docs, grad = _inputs(dims, dtype, device, documents)
    # torch has no FlexAttention backward on CPU (inputs that require grad are refused): the GPU test below has them
    out = peers.flex_alibi_attention(q.detach(), k.detach(), v.detach(), slopes, q_doc=docs, k_doc=docs)
    expected, _ = _reference(q, k, v, slopes, docs, grad)
    assert out.dtype == dtype and out.shape == q.shape
    # Measured on CPU: fp32 within 1.1e-6, bf16 within the bf16-rounded reference's own 0.008.
    assert_matches(out, expected, dtype)


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="FlexAttention's backward runs on CUDA only")
@pytest.mark.parametrize("documents", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("dims", SHAPES)
def test_flex_gradients_match_reference(dims, dtype, documents, assert_matches) -> None:
    q, k, v, slopes, docs, grad = _inputs(dims, dtype, torch.device("cuda"), documents)
    out = peers.flex_alibi_attention(q, k, v, slopes, q_doc=docs, k_doc=docs)
    grads = torch.autograd.grad(out, (q, k, v), grad)
    expected, expected_grads = _reference(q, k, v, slopes, docs, grad)
    assert_matches(out, expected, dtype)
    for got, want in zip(grads, expected_grads, strict=True):
        assert_matches(got, want, dtype, scale=5)


def test_a_wrong_mask_or_bias_is_far_outside_the_tolerance(device) -> None:
    # The tolerance above means something: dropping the causal mask, or the ALiBi term, moves the output by more
    # than ten times the bf16 bound (0.03 + 0.03 |x|).
    q, k, v, slopes, _, grad = _inputs((2, 3, 37, 64), torch.float32, device, False)
    expected, _ = _reference(q, k, v, slopes, None, grad)
    with torch.no_grad():
        no_causal = peers.sdpa_alibi_attention(q, k, v, slopes, causal=False)
        no_alibi = peers.sdpa_alibi_attention(q, k, v, torch.zeros_like(slopes))
    for wrong in (no_causal, no_alibi):
        assert (wrong - expected).abs().max() > 10 * (0.03 + 0.03 * expected.abs().max())


def test_sdpa_bias_is_built_once_per_slopes_and_aligned(device) -> None:
    peers.clear_caches()
    q, k, v, slopes, _, _ = _inputs((1, 2, 13, 16), torch.bfloat16, device, False)
    built: list[torch.Tensor] = []
    real = peers.alibi_bias

    def counting(*args, **kwargs):
        built.append(real(*args, **kwargs))
        return built[-1]

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(peers, "alibi_bias", counting)
        for _ in range(3):
            peers.sdpa_alibi_attention(q, k, v, slopes)
        assert len(built) == 1
        other = slopes.clone()  # another tensor (another rank's heads): another bias
        peers.sdpa_alibi_attention(q, k, v, other)
        other.mul_(2)  # changed in place: its version moves, the bias is rebuilt
        peers.sdpa_alibi_attention(q, k, v, other)
        peers.sdpa_alibi_attention(q.float(), k.float(), v.float(), slopes)  # another dtype
    assert len(built) == 4
    # Rows padded to 8 elements: 16-byte aligned for the memory-efficient backend, with no copy per call.
    assert built[0].dtype == torch.bfloat16 and built[0].stride(-2) % peers.BIAS_ROW_ALIGN == 0
    assert built[0].shape == (1, 2, 13, 13)


class _HostSyncs(TorchDispatchMode):
    """Counts the ops that read a device value back to the host (each one stalls a CUDA stream)."""

    SYNCS = ("_local_scalar_dense", "nonzero", "item")

    def __init__(self) -> None:
        super().__init__()
        self.syncs: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket.__name__ in self.SYNCS:
            self.syncs.append(str(func))
        return func(*args, **(kwargs or {}))


def test_sdpa_and_flex_masks_read_nothing_back_to_the_host(device) -> None:
    q, k, v, slopes, docs, grad = _inputs((2, 3, 37, 64), torch.float32, device, True)
    assert docs is not None
    with _HostSyncs() as counted:
        for d in (None, docs):
            out = peers.sdpa_alibi_attention(q, k, v, slopes, q_doc=d, k_doc=d)
            torch.autograd.grad(out, (q, k, v), grad)
            peers._block_mask(37, True, d, d, device)
    assert counted.syncs == []


def test_flex_block_mask_kept_and_compiled_once(device) -> None:
    import torch._dynamo.utils

    peers.clear_caches()
    q, k, v, slopes, _, _ = _inputs((1, 2, 29, 16), torch.float32, device, False)
    q, k, v = q.detach(), k.detach(), v.detach()
    peers.flex_alibi_attention(q, k, v, slopes)
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    masks = dict(peers._flex_block_masks._entries)
    peers.flex_alibi_attention(q, k, v, slopes.clone())  # a fresh score_mod closure: no recompile
    peers.flex_alibi_attention(q, k, v, slopes)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs
    assert len(masks) == 1 and dict(peers._flex_block_masks._entries) == masks


def test_peers_refuse_what_they_do_not_run(device) -> None:
    q, k, v, slopes, docs, _ = _inputs((1, 2, 9, 16), torch.float32, device, True)
    with pytest.raises(ValueError, match="self-attention takes q, k, v of one shape"):
        peers.sdpa_alibi_attention(q[:, :, :4], k, v, slopes)
    with pytest.raises(ValueError, match="q_doc and k_doc go together"):
        peers.flex_alibi_attention(q, k, v, slopes, q_doc=docs)
    with pytest.raises(ValueError, match="slopes shape"):
        peers.sdpa_alibi_attention(q, k, v, slopes[:1])
