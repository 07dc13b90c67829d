"""A compiled BloomBlock whose graph holds the bloom:: custom ops computes what the eager block does.

tests/distributed/test_compile.py compares compiled and eager training on CPU ranks, where the registry runs the
torch twins: no bloom:: op is in the graphs it compares. Here BLOOM_KERNELS=triton routes LayerNorm, bias + GeLU and
flash attention to the Triton kernels (in Triton's interpreter), the block is compiled as parallelize.compile_blocks
compiles it (torch.compile of its forward, fullgraph, inductor), and a backend that hands inductor the graph dynamo
traced records which ops that graph holds. Outputs and gradients must equal the eager block's: inductor's own
kernels there are the residual adds and the bias adds beside the custom ops."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from appliance.model.bloom import BloomBlock
from appliance.model.config import BloomConfig

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter's check; GPUs run test_compile's")
BLOOM_OPS = {"bloom.layer_norm.default", "bloom.bias_gelu.default", "bloom.flash_alibi_attention.default"}


def _run(block: BloomBlock, forward: Callable[..., torch.Tensor], docs: torch.Tensor) -> list[torch.Tensor]:
    x = torch.randn(2, 24, 32, generator=torch.Generator().manual_seed(1), requires_grad=True)
    out = forward(x, None, docs)
    return [out, *torch.autograd.grad(out.square().sum(), [x, *block.parameters()])]


def _compiled_ops(
    kernels: str, monkeypatch: pytest.MonkeyPatch, inductor: bool = True
) -> tuple[set[str], list[list[torch.Tensor]]]:
    """The call targets of the graph dynamo hands the backend (inductor, or the graph itself run eagerly) for one
    BloomBlock, and (eager, compiled) results."""
    from torch._inductor.compile_fx import compile_fx

    monkeypatch.setenv("BLOOM_KERNELS", kernels)
    torch._dynamo.reset()
    torch.manual_seed(0)
    block = BloomBlock(BloomConfig(vocab_size=64, hidden_size=32, n_layer=1, n_head=2))
    block.alibi.slopes(torch.device("cpu"))
    docs = torch.tensor([[0] * 10 + [1] * 14, [0] * 24])
    targets: set[str] = set()

    def inductor_recording(graph: torch.fx.GraphModule, inputs: list[Any]) -> Any:
        targets.update(str(node.target) for node in graph.graph.nodes if node.op == "call_function")
        return compile_fx(graph, inputs) if inductor else graph.forward

    compiled = torch.compile(block.forward, fullgraph=True, backend=inductor_recording)
    results = [_run(block, block.forward, docs), _run(block, compiled, docs)]
    torch._dynamo.reset()
    return targets, results


def test_the_compiled_block_holds_the_bloom_ops_and_matches_eager(monkeypatch: pytest.MonkeyPatch) -> None:
    targets, (eager, compiled) = _compiled_ops("triton", monkeypatch)
    assert targets >= BLOOM_OPS, sorted(targets)
    for got, want in zip(compiled, eager, strict=True):
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)


def test_the_twins_leave_no_bloom_op_in_the_graph(monkeypatch: pytest.MonkeyPatch) -> None:
    """The positive control: the same recording finds none with the torch twins (the CPU default). Dynamo's graph
    is the same whichever backend gets it: inductor's minute of C++ builds is left out here."""
    targets, _ = _compiled_ops("reference", monkeypatch, inductor=False)
    assert targets and not {t for t in targets if t.startswith("bloom.")}
