"""Tensor-parallel layers at tp=2 against the dense single-process computation (fp32: outputs and gradients).

All checks run inside one spawn of two gloo ranks (spawns are the slow part); each test reads its own result.
Each rank builds the dense reference itself from the same seed, so nothing but the layers differs.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from appliance.parallel.mappings import gather_from_sequence_parallel_region, scatter_to_sequence_parallel_region
from appliance.parallel.tensor_parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    allreduce_sequence_parallel_grads,
    gather_state_dicts,
    parallel_lm_logits,
    role_of_parameter,
    shard_from_full,
    shard_state_dict,
    tp_linear_factory,
    vocab_parallel_cross_entropy,
)
from appliance.parallel.testing import run_distributed
from appliance.parallel.topology import ParallelTopology

pytestmark = pytest.mark.distributed

TOLERANCE = 1e-5  # fp32
SEQ, BATCH, HIDDEN, HEADS, VOCAB = 4, 2, 8, 4, 16


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape, (a.shape, b.shape)
    return float((a.detach() - b.detach()).abs().max())


def _column(topology: ParallelTopology) -> dict[str, float]:
    group, rank = topology.tp_group, topology.tp_rank(torch.distributed.get_rank())
    torch.manual_seed(0)
    dense = nn.Linear(HIDDEN, 12)
    torch.manual_seed(0)
    column = ColumnParallelLinear(HIDDEN, 12, group=group, gather_output=True)
    x = torch.randn(SEQ, BATCH, HIDDEN)
    probe = torch.randn(SEQ, BATCH, 12)  # a loss with a different weight per output, so every gradient matters
    x_dense, x_tp = x.clone().requires_grad_(), x.clone().requires_grad_()
    y_dense, y_tp = dense(x_dense), column(x_tp)
    (y_dense * probe).sum().backward()
    (y_tp * probe).sum().backward()
    local = ColumnParallelLinear(HIDDEN, 12, group=group, full_weight=dense.weight, full_bias=dense.bias)
    return {
        "init": _max_diff(column.weight, dense.weight.chunk(2)[rank])
        + _max_diff(column.bias, dense.bias.chunk(2)[rank]),
        "output": _max_diff(y_tp, y_dense),
        "local output": _max_diff(local(x), y_dense.chunk(2, dim=-1)[rank]),
        "input grad": _max_diff(x_tp.grad, x_dense.grad),
        "weight grad": _max_diff(column.weight.grad, dense.weight.grad.chunk(2)[rank]),
        "bias grad": _max_diff(column.bias.grad, dense.bias.grad.chunk(2)[rank]),
    }


def _row(topology: ParallelTopology) -> dict[str, float]:
    group, rank = topology.tp_group, topology.tp_rank(torch.distributed.get_rank())
    torch.manual_seed(1)
    dense = nn.Linear(12, HIDDEN)
    torch.manual_seed(1)
    row = RowParallelLinear(12, HIDDEN, group=group)
    scatter = RowParallelLinear(
        12, HIDDEN, group=group, input_is_parallel=False, full_weight=dense.weight, full_bias=dense.bias
    )
    x = torch.randn(SEQ, BATCH, 12)
    probe = torch.randn(SEQ, BATCH, HIDDEN)
    x_dense = x.clone().requires_grad_()
    x_shard = x.chunk(2, dim=-1)[rank].clone().requires_grad_()
    x_full = x.clone().requires_grad_()
    y_dense, y_tp, y_scatter = dense(x_dense), row(x_shard), scatter(x_full)
    for y in (y_dense, y_tp, y_scatter):
        (y * probe).sum().backward()
    return {
        "init": _max_diff(row.weight, dense.weight.chunk(2, dim=1)[rank]) + _max_diff(row.bias, dense.bias),
        "output": _max_diff(y_tp, y_dense),
        "output, scattered input": _max_diff(y_scatter, y_dense),
        "input grad": _max_diff(x_shard.grad, x_dense.grad.chunk(2, dim=-1)[rank]),
        "input grad, scattered input": _max_diff(x_full.grad, x_dense.grad),
        "weight grad": _max_diff(row.weight.grad, dense.weight.grad.chunk(2, dim=1)[rank]),
        "bias grad": _max_diff(row.bias.grad, dense.bias.grad),
    }


def _batch_first_sequence_parallel(topology: ParallelTopology) -> dict[str, float]:
    """Column then row linear with sequence chunks of a [b, s, h] activation (sequence_dim=1)."""
    group, rank = topology.tp_group, topology.tp_rank(torch.distributed.get_rank())
    torch.manual_seed(6)
    dense_in, dense_out = nn.Linear(HIDDEN, 12), nn.Linear(12, HIDDEN)
    torch.manual_seed(6)
    column = ColumnParallelLinear(HIDDEN, 12, group=group, sequence_parallel=True, sequence_dim=1)
    row = RowParallelLinear(12, HIDDEN, group=group, sequence_parallel=True, sequence_dim=1)
    x = torch.randn(BATCH, SEQ, HIDDEN)
    probe = torch.randn(BATCH, SEQ, HIDDEN)
    x_dense = x.clone().requires_grad_()
    x_chunk = x.chunk(2, dim=1)[rank].clone().requires_grad_()
    y_dense = dense_out(torch.tanh(dense_in(x_dense)))
    y_chunk = row(torch.tanh(column(x_chunk)))
    (y_dense * probe).sum().backward()
    (y_chunk * probe.chunk(2, dim=1)[rank]).sum().backward()
    allreduce_sequence_parallel_grads(row, group)  # the row bias saw only this rank's chunk
    return {
        "output chunk": _max_diff(y_chunk, y_dense.chunk(2, dim=1)[rank]),
        "input grad chunk": _max_diff(x_chunk.grad, x_dense.grad.chunk(2, dim=1)[rank]),
        "column weight grad": _max_diff(column.weight.grad, dense_in.weight.grad.chunk(2)[rank]),
        "row weight grad": _max_diff(row.weight.grad, dense_out.weight.grad.chunk(2, dim=1)[rank]),
        "row bias grad": _max_diff(row.bias.grad, dense_out.bias.grad),
    }


def _vocab(topology: ParallelTopology) -> dict[str, float]:
    group, rank = topology.tp_group, topology.tp_rank(torch.distributed.get_rank())
    torch.manual_seed(2)
    dense = nn.Embedding(VOCAB, HIDDEN)
    torch.manual_seed(2)
    embedding = VocabParallelEmbedding(VOCAB, HIDDEN, group=group)
    ids = torch.randint(0, VOCAB, (SEQ, BATCH))
    ids[0, 0], ids[1, 0] = 0, VOCAB - 1  # both ends of the vocabulary, on different ranks
    probe = torch.randn(SEQ, BATCH, HIDDEN)
    y_dense, y_tp = dense(ids), embedding(ids)
    (y_dense * probe).sum().backward()
    (y_tp * probe).sum().backward()
    # Tied head: logits from the same shard, then the loss without the full logits.
    hidden = torch.randn(SEQ, BATCH, HIDDEN)
    labels = torch.randint(0, VOCAB, (SEQ, BATCH))
    labels[2, 1] = -100
    logits_dense = F.linear(hidden, dense.weight.detach())
    logits_shard = parallel_lm_logits(hidden, embedding.weight.detach(), group)
    loss_dense = F.cross_entropy(logits_dense.view(-1, VOCAB), labels.view(-1))
    loss_tp = vocab_parallel_cross_entropy(logits_shard, labels, group)
    return {
        "init": _max_diff(embedding.weight, dense.weight.chunk(2)[rank]),
        "output": _max_diff(y_tp, y_dense),
        "weight grad": _max_diff(embedding.weight.grad, dense.weight.grad.chunk(2)[rank]),
        "tied logits": _max_diff(logits_shard, logits_dense.chunk(2, dim=-1)[rank]),
        "tied loss": _max_diff(loss_tp, loss_dense),
    }


def _cross_entropy(topology: ParallelTopology) -> dict[str, float]:
    group, rank = topology.tp_group, topology.tp_rank(torch.distributed.get_rank())
    torch.manual_seed(3)
    logits = torch.randn(SEQ, BATCH, VOCAB) * 4
    labels = torch.randint(0, VOCAB, (SEQ, BATCH))
    labels[0, 0], labels[0, 1], labels[3, 1] = 0, VOCAB - 1, -100  # both ends, and one ignored position
    results = {}
    for reduction in ("mean", "sum", "none"):
        full = logits.clone().requires_grad_()
        shard = logits.chunk(2, dim=-1)[rank].clone().requires_grad_()
        dense = F.cross_entropy(full.view(-1, VOCAB), labels.view(-1), reduction=reduction)
        parallel = vocab_parallel_cross_entropy(shard, labels, group, reduction=reduction)
        weights = torch.arange(1.0, dense.numel() + 1).view(dense.shape)  # distinct upstream gradient per token
        (dense * weights).sum().backward()
        (parallel * weights.view(parallel.shape)).sum().backward()
        results[f"loss {reduction}"] = _max_diff(parallel.reshape(-1), dense.reshape(-1))
        results[f"logits grad {reduction}"] = _max_diff(shard.grad, full.grad.chunk(2, dim=-1)[rank])
    # bf16 logits: the loss is still computed in fp32, and the gradient comes back in bf16.
    shard16 = logits.chunk(2, dim=-1)[rank].to(torch.bfloat16).requires_grad_()
    loss16 = vocab_parallel_cross_entropy(shard16, labels, group)
    loss16.backward()
    results["bf16 logits: loss not fp32"] = float(loss16.dtype != torch.float32)
    results["bf16 logits: grad not bf16"] = float(shard16.grad.dtype != torch.bfloat16)
    return results


class Block(nn.Module):
    """A BLOOM-shaped layer: LN -> fused QKV -> causal attention with per-head biases -> dense -> residual,
    LN -> MLP -> residual, on [seq, batch, hidden]. Head bookkeeping follows transformers' BloomAttention."""

    def __init__(self, make_linear: Callable[[int, int, bool, str], nn.Module], tp: int, tp_rank: int) -> None:
        super().__init__()
        self.input_layernorm = nn.LayerNorm(HIDDEN)
        self.self_attention = nn.ModuleDict(
            {
                "query_key_value": make_linear(HIDDEN, 3 * HIDDEN, True, "qkv"),
                "dense": make_linear(HIDDEN, HIDDEN, True, "attn_out"),
            }
        )
        self.post_attention_layernorm = nn.LayerNorm(HIDDEN)
        self.mlp = nn.ModuleDict(
            {
                "dense_h_to_4h": make_linear(HIDDEN, 4 * HIDDEN, True, "mlp_in"),
                "dense_4h_to_h": make_linear(4 * HIDDEN, HIDDEN, True, "mlp_out"),
            }
        )
        self.local_heads = HEADS // tp
        # ALiBi-like per-head slopes, sliced to this rank's heads as the model does with its slopes.
        slopes = torch.tensor([2.0 ** (-(h + 1)) for h in range(HEADS)])
        self.register_buffer("slopes", slopes[tp_rank * self.local_heads : (tp_rank + 1) * self.local_heads])
        with torch.no_grad():  # non-trivial LayerNorm parameters, identical on every rank
            generator = torch.Generator().manual_seed(7)
            for norm in (self.input_layernorm, self.post_attention_layernorm):
                norm.weight.add_(0.1 * torch.randn(HIDDEN, generator=generator))
                norm.bias.add_(0.1 * torch.randn(HIDDEN, generator=generator))

    def attention(self, x: torch.Tensor) -> torch.Tensor:
        fused = self.self_attention["query_key_value"](x)  # [s, b, 3 * hidden / tp], whole heads of this rank
        seq, batch, _ = fused.shape
        head_dim = HIDDEN // HEADS
        q, k, v = fused.view(seq, batch, self.local_heads, 3, head_dim).unbind(dim=3)
        scores = torch.einsum("sbhd,tbhd->bhst", q, k) / math.sqrt(head_dim)
        distance = torch.arange(seq).view(1, seq) - torch.arange(seq).view(seq, 1)
        scores = scores + self.slopes.view(1, -1, 1, 1) * distance.clamp(max=0)
        scores = scores.masked_fill(distance > 0, float("-inf"))
        context = torch.einsum("bhst,tbhd->sbhd", scores.softmax(dim=-1), v)
        return self.self_attention["dense"](context.reshape(seq, batch, self.local_heads * head_dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.input_layernorm(x))
        mlp = self.mlp
        return x + mlp["dense_4h_to_h"](F.gelu(mlp["dense_h_to_4h"](self.post_attention_layernorm(x))))


def _dense_factory(in_features: int, out_features: int, bias: bool, role: str) -> nn.Module:
    return nn.Linear(in_features, out_features, bias=bias)


def _block(topology: ParallelTopology) -> dict[str, float]:
    group, rank = topology.tp_group, topology.tp_rank(torch.distributed.get_rank())
    torch.manual_seed(4)
    x = torch.randn(SEQ, BATCH, HIDDEN)
    probe = torch.randn(SEQ, BATCH, HIDDEN)
    torch.manual_seed(5)
    dense = Block(_dense_factory, 1, 0)
    x_dense = x.clone().requires_grad_()
    y_dense = dense(x_dense)
    (y_dense * probe).sum().backward()
    dense_grads = {name: p.grad for name, p in dense.named_parameters()}
    results = {}
    for sequence_parallel in (False, True):
        torch.manual_seed(5)  # same construction order as the dense block: same initial weights, sliced
        block = Block(tp_linear_factory(topology, sequence_parallel=sequence_parallel), 2, rank)
        x_tp = x.clone().requires_grad_()
        if sequence_parallel:
            # [s/tp, b, h] in the LayerNorm/residual regions; gathered at the end for the comparison.
            local = block(scatter_to_sequence_parallel_region(x_tp, group))
            y_tp = gather_from_sequence_parallel_region(local, group, tensor_parallel_output_grad=False)
        else:
            y_tp = block(x_tp)
        (y_tp * probe).sum().backward()
        if sequence_parallel:
            allreduce_sequence_parallel_grads(block, group)
        tag = "sequence parallel" if sequence_parallel else "tensor parallel"
        results[f"{tag} output"] = _max_diff(y_tp, y_dense)
        results[f"{tag} input grad"] = _max_diff(x_tp.grad, x_dense.grad)
        worst_init, worst_grad = 0.0, 0.0
        for name, param in block.named_parameters():
            role, is_bias = role_of_parameter(name)
            expected_param = shard_from_full(dict(dense.named_parameters())[name], role, rank, 2, is_bias=is_bias)
            expected_grad = shard_from_full(dense_grads[name], role, rank, 2, is_bias=is_bias)
            worst_grad = max(worst_grad, _max_diff(param.grad, expected_grad))
            worst_init = max(worst_init, _max_diff(param, expected_param))  # no optimizer step was taken
        results[f"{tag} parameter grads"] = worst_grad
        results[f"{tag} init"] = worst_init
    return results


def _all_checks(topology: ParallelTopology) -> dict[str, dict[str, float]]:
    return {
        "column": _column(topology),
        "row": _row(topology),
        "batch-first sequence parallel": _batch_first_sequence_parallel(topology),
        "vocab": _vocab(topology),
        "cross_entropy": _cross_entropy(topology),
        "block": _block(topology),
    }


@pytest.fixture(scope="module")
def tp2_results() -> list[dict[str, dict[str, float]]]:
    return run_distributed(_all_checks, 2, tp=2, timeout_s=120)


def _assert_close(results: list[dict[str, Any]], key: str) -> None:
    for rank, per_rank in enumerate(results):
        for check, error in per_rank[key].items():
            assert error < TOLERANCE, f"{key} {check} on rank {rank}: max |diff| {error:.3e}"


def test_column_parallel_linear_equals_dense(tp2_results: list[dict[str, Any]]) -> None:
    _assert_close(tp2_results, "column")


def test_row_parallel_linear_equals_dense(tp2_results: list[dict[str, Any]]) -> None:
    _assert_close(tp2_results, "row")


def test_batch_first_sequence_parallel_linears_equal_dense(tp2_results: list[dict[str, Any]]) -> None:
    _assert_close(tp2_results, "batch-first sequence parallel")


def test_vocab_parallel_embedding_and_tied_head_equal_dense(tp2_results: list[dict[str, Any]]) -> None:
    _assert_close(tp2_results, "vocab")


def test_vocab_parallel_cross_entropy_equals_dense(tp2_results: list[dict[str, Any]]) -> None:
    _assert_close(tp2_results, "cross_entropy")


def test_block_with_and_without_sequence_parallel_equals_dense(tp2_results: list[dict[str, Any]]) -> None:
    _assert_close(tp2_results, "block")


def test_fused_qkv_rows_split_by_whole_heads_as_transformers_reads_them() -> None:
    from transformers import BloomConfig
    from transformers.models.bloom.modeling_bloom import BloomAttention

    tp, heads, hidden = 2, 4, 16
    full = BloomAttention(BloomConfig(hidden_size=hidden, n_head=heads), layer_idx=0)
    x = torch.randn(2, 3, hidden)
    q, k, v = full._reshape(full.query_key_value(x))  # [batch, heads, seq, head_dim] each
    for rank in range(tp):
        local = BloomAttention(BloomConfig(hidden_size=hidden // tp, n_head=heads // tp), layer_idx=0)
        weight = shard_from_full(full.query_key_value.weight, "qkv", rank, tp)
        bias = shard_from_full(full.query_key_value.bias, "qkv", rank, tp, is_bias=True)
        q_r, k_r, v_r = local._reshape(F.linear(x, weight, bias))
        mine = slice(rank * heads // tp, (rank + 1) * heads // tp)
        for whole, part in ((q, q_r), (k, k_r), (v, v_r)):
            torch.testing.assert_close(part, whole[:, mine], rtol=0, atol=1e-6)


def test_state_dict_shards_round_trip_with_transformers_names() -> None:
    from transformers import BloomConfig, BloomForCausalLM

    config = BloomConfig(vocab_size=32, hidden_size=16, n_head=4, n_layer=1)
    full = {name: t.detach().clone() for name, t in BloomForCausalLM(config).state_dict().items()}
    assert role_of_parameter("transformer.h.0.self_attention.query_key_value.weight") == ("qkv", False)
    assert role_of_parameter("transformer.h.0.self_attention.dense.bias") == ("attn_out", True)
    assert role_of_parameter("transformer.h.0.mlp.dense_h_to_4h.bias") == ("mlp_in", True)
    assert role_of_parameter("transformer.h.0.mlp.dense_4h_to_h.weight") == ("mlp_out", False)
    assert role_of_parameter("transformer.word_embeddings.weight") == ("embedding", False)
    assert role_of_parameter("transformer.word_embeddings_layernorm.weight") == ("replicated", False)
    shards = [shard_state_dict(full, rank, 2) for rank in range(2)]
    assert shards[1]["transformer.h.0.mlp.dense_4h_to_h.weight"].shape == (16, 32)
    assert shards[1]["transformer.h.0.self_attention.dense.bias"].shape == (16,)
    assert shards[0]["lm_head.weight"].shape == (16, 16)
    rebuilt = gather_state_dicts(shards)
    assert rebuilt.keys() == full.keys()
    for name, tensor in full.items():
        assert torch.equal(rebuilt[name], tensor), name
    shards[1]["transformer.ln_f.weight"][0] += 1
    with pytest.raises(ValueError, match="differs between tp rank 0 and tp rank 1"):
        gather_state_dicts(shards)


def test_factory_returns_plain_linear_at_tp1() -> None:
    make = tp_linear_factory(ParallelTopology(tp=1, pp=1, dp=1, world_size=1))
    layer = make(8, 24, True, "qkv")
    assert type(layer) is nn.Linear and layer.weight.shape == (24, 8)
    with pytest.raises(ValueError, match="unknown linear role"):
        make(8, 8, True, "lm_head")


def test_layers_and_loss_run_in_one_process_without_a_process_group() -> None:
    torch.manual_seed(0)
    dense = nn.Linear(HIDDEN, 12)
    torch.manual_seed(0)
    column = ColumnParallelLinear(HIDDEN, 12)
    x = torch.randn(SEQ, BATCH, HIDDEN)
    assert torch.equal(column(x), dense(x))
    logits = torch.randn(SEQ, BATCH, VOCAB, requires_grad=True)
    labels = torch.randint(0, VOCAB, (SEQ, BATCH))
    loss = vocab_parallel_cross_entropy(logits, labels)
    (grad,) = torch.autograd.grad(loss, logits)
    reference = F.cross_entropy(logits.view(-1, VOCAB), labels.view(-1))
    (reference_grad,) = torch.autograd.grad(reference, logits)
    torch.testing.assert_close(loss, reference, rtol=0, atol=TOLERANCE)
    torch.testing.assert_close(grad, reference_grad, rtol=0, atol=TOLERANCE)
