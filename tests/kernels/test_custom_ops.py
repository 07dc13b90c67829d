"""The Triton kernels as torch custom ops (bloom::*): torch.library.opcheck on each, and torch.compile tracing them.

opcheck runs each op eagerly, under FakeTensorMode (the fake must give the real outputs' shapes, dtypes and
strides), through AOT autograd with dynamic shapes, and checks its schema and autograd registration. On CPU the
kernels run in Triton's interpreter (conftest), so shapes are small and awkward: rows that are not powers of two,
tails past the interpreter's tiles.
"""

from __future__ import annotations

import math

import pytest
import torch

from kernels import bias_gelu, flash_attention, layer_norm, reference, softmax
from kernels.launch import H100, recording

OPS = {
    "layer_norm": layer_norm.layer_norm_op,
    "layer_norm_backward": layer_norm.layer_norm_backward_op,
    "bias_gelu": bias_gelu.bias_gelu_op,
    "bias_gelu_backward": bias_gelu.bias_gelu_backward_op,
    "flash_alibi_attention": flash_attention.flash_attention_op,
    "flash_alibi_attention_backward": flash_attention.flash_attention_backward_op,
    "alibi_softmax": softmax.alibi_softmax_op,
    "alibi_softmax_backward": softmax.alibi_softmax_backward_op,
}


def _randn(*shape: int, device: torch.device, grad: bool = False) -> torch.Tensor:
    return torch.randn(*shape, device=device).requires_grad_(grad)


def _cases(device: torch.device) -> dict[str, list[tuple]]:
    x = _randn(3, 7, 33, device=device, grad=True)  # 21 rows of 33: a ragged tile on both axes
    w, b = _randn(33, device=device, grad=True), _randn(33, device=device, grad=True)
    rows = x.detach().reshape(-1, 33)
    mean, rstd = rows.mean(-1), rows.var(-1, unbiased=False).add(1e-5).rsqrt()
    q, k, v = (_randn(2, 3, 19, 16, device=device, grad=True) for _ in range(3))  # 19 queries: 16 + a tail
    slopes = reference.alibi_slopes(3, device)
    docs = torch.tensor([[0] * 7 + [1] * 12, [0] * 19], device=device)
    o, lse = flash_attention.flash_attention_op(q, k, v, slopes, True, 0.25, 0, None, None)
    scores = _randn(2, 3, 5, 9, device=device, grad=True)
    padding = torch.tensor([[0, 0, 1, 1, 1, 1, 1, 1, 1], [1] * 9], device=device)
    probs = softmax.alibi_softmax_op(scores, slopes, padding, 0.5, True).detach()
    dy = torch.randn(3, 7, 33, device=device)
    do = torch.randn_like(o)
    delta = (o * do).sum(-1).detach()  # rowsum(O * dO), as context parallel hands it over
    return {
        "layer_norm": [(x, w, b, 1e-5), (x[:, 1:5].transpose(0, 1), w, b, 1e-3)],  # a strided view of the rows
        "layer_norm_backward": [(dy, x.detach(), w.detach(), mean, rstd)],
        "bias_gelu": [(x, b)],
        "bias_gelu_backward": [(dy, x.detach(), b.detach())],
        "flash_alibi_attention": [
            (q, k, v, slopes, True, 0.25, 0, None, None),
            (q, k, v, slopes, True, 0.25, 0, docs, docs),  # packed documents
            (q[:, :, 11:], k, v, slopes, True, 0.25, 5, None, None),  # a chunk at another global offset
            (q, k, v, slopes, False, 0.25, 0, None, None),
        ],
        "flash_alibi_attention_backward": [
            (do, q.detach(), k.detach(), v.detach(), o.detach(), lse.detach(), slopes, True, 0.25, 0, None, None, None),
            (do, q.detach(), k.detach(), v.detach(), None, lse.detach(), slopes, True, 0.25, 0, docs, docs, delta),
        ],
        "alibi_softmax": [(scores, slopes, None, 0.5, True), (scores, slopes, padding, 0.5, True)],
        "alibi_softmax_backward": [(torch.randn_like(probs), probs, 0.5)],
    }


@pytest.mark.parametrize("name", sorted(OPS))
def test_opcheck(name: str, device: torch.device) -> None:
    for args in _cases(device)[name]:
        torch.library.opcheck(OPS[name], args)


def test_every_kernel_op_is_checked() -> None:
    registered = {op for op in torch.ops.bloom} - {"__name__"}
    assert registered == set(OPS), registered


def _block(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor, bias: torch.Tensor, slopes: torch.Tensor) -> torch.Tensor:
    """LayerNorm -> attention over heads of x -> bias + GeLU: the fused ops as a BLOOM block calls them."""
    h = layer_norm.layer_norm(x, w, b)
    batch, seq, width = h.shape
    q = h.view(batch, seq, 2, width // 2).transpose(1, 2)
    attended = flash_attention.flash_alibi_attention(q, q, q, slopes, causal=True)
    return bias_gelu.bias_gelu(attended.transpose(1, 2).reshape(batch, seq, width), bias)


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_compiled_kernels_trace_whole_and_match_eager(backend: str, device: torch.device) -> None:
    """fullgraph=True fails on any graph break; the compiled forward and gradients are the eager ones: the same
    kernels run, in the same order, on the same inputs."""
    torch._dynamo.reset()
    x = _randn(2, 13, 32, device=device, grad=True)
    params = [_randn(32, device=device, grad=True) for _ in range(3)]
    slopes = reference.alibi_slopes(2, device)
    compiled = torch.compile(_block, backend=backend, fullgraph=True)
    results: list[list[torch.Tensor]] = []
    for run in (_block, compiled):
        out = run(x, *params, slopes)
        grads = torch.autograd.grad(out.square().sum(), [x, *params])
        results.append([out, *grads])
    for eager, traced in zip(*results, strict=True):
        torch.testing.assert_close(traced, eager, atol=0, rtol=0)


def test_meta_tensors_record_launches_as_before() -> None:
    """Inside kernels.launch.recording the ops still reach the launchers for meta tensors (kernels.aot compiles
    what they record), forward and backward."""
    x = torch.empty(2, 4096, 1024, device="meta", requires_grad=True)
    w, b = (torch.empty(1024, device="meta", requires_grad=True) for _ in range(2))
    with recording(H100) as launches:
        layer_norm.layer_norm(x, w, b).backward(torch.empty(2, 4096, 1024, device="meta"))
    kernels = [launch.kernel for launch in launches]
    assert kernels == [layer_norm._layer_norm_fwd_kernel, layer_norm._layer_norm_bwd_kernel]
    rows = 2 * 4096
    block_r, _, _ = layer_norm.launch_config(1024, H100.capability)
    assert launches[0].grid == (math.ceil(rows / block_r),)
