"""Tensor-parallel layers at tp=2 against the dense single-process computation (fp32: outputs and gradients).

All checks run inside one spawn of two gloo ranks (spawns are the slow part); each test reads its own result.
Each rank builds the dense reference itself from the same seed, so nothing but the layers differs. Results are
relative norms against the dense ones, bounded by a multiple of fp32's rounding at these sizes, measured in the
rank; initial weight slices are copies and must be bit-identical. The same launch shows the collective guard at
work on the mappings' collectives.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from noise_floor import NoiseFloor, check_floor, pinned_threads, relative_norm
from torch import nn

from appliance.parallel.tensor.cross_entropy import HeadInput, lm_head_input, vocab_parallel_loss, vocab_parallel_scores
from appliance.parallel.tensor.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    allreduce_sequence_parallel_grads,
    tp_linear_factory,
)
from appliance.parallel.tensor.mappings import gather_from_sequence_parallel_region, scatter_to_sequence_parallel_region
from appliance.parallel.tensor.param_splits import (
    gather_state_dicts,
    role_of_parameter,
    shard_from_full,
    shard_state_dict,
)
from appliance.parallel.testing import WrongDeviceError, collective_guard, run_distributed
from appliance.parallel.topology import ParallelTopology

pytestmark = pytest.mark.distributed

SEQ, BATCH, HIDDEN, HEADS, VOCAB = 4, 2, 8, 4, 16
# A TP result and the dense one are two fp32 evaluations of the same exact value, in another summation order, so
# each is within about fp32's rounding error (the floor: the dense block in fp32 against float64) of it and their
# relative difference is within about twice that; measured at most 0.75 x the floor, so 10 x leaves room.
FACTOR = 10.0
TEETH = 10.0  # a missing all-reduce must land this far beyond the bound


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return relative_norm(a, b)


def _exact(a: torch.Tensor, b: torch.Tensor) -> float:
    """Copies of the same numbers (initial slices, no arithmetic): 0 when bit-identical, else infinitely off."""
    return 0.0 if a.shape == b.shape and torch.equal(a.detach(), b.detach()) else math.inf


def _rounding_floor() -> dict[str, float]:
    """fp32's own rounding at these sizes: the dense block's output, input gradient and parameter gradients (every
    op the layers here have: linears of each role, LayerNorm, softmax attention, GeLU), fp32 against float64."""
    torch.manual_seed(4)
    x, probe = torch.randn(SEQ, BATCH, HIDDEN), torch.randn(SEQ, BATCH, HIDDEN)
    torch.manual_seed(5)
    narrow = Block(_dense_factory, 1, 0)
    wide = copy.deepcopy(narrow).double()
    outputs, inputs = [], []
    for block, dtype in ((narrow, torch.float32), (wide, torch.float64)):
        inputs.append(x.to(dtype, copy=True).requires_grad_())
        outputs.append(block(inputs[-1]))
        (outputs[-1] * probe.to(dtype)).sum().backward()
    return {
        "output": _relative(outputs[0], outputs[1]),
        "input grad": _relative(inputs[0].grad, inputs[1].grad),
        "parameter grads": max(
            _relative(a.grad, b.grad) for a, b in zip(narrow.parameters(), wide.parameters(), strict=True)
        ),
    }


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
        "init": max(_exact(column.weight, dense.weight.chunk(2)[rank]), _exact(column.bias, dense.bias.chunk(2)[rank])),
        "output": _relative(y_tp, y_dense),
        "local output": _relative(local(x), y_dense.chunk(2, dim=-1)[rank]),
        "input grad": _relative(x_tp.grad, x_dense.grad),
        "weight grad": _relative(column.weight.grad, dense.weight.grad.chunk(2)[rank]),
        "bias grad": _relative(column.bias.grad, dense.bias.grad.chunk(2)[rank]),
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
        "init": max(_exact(row.weight, dense.weight.chunk(2, dim=1)[rank]), _exact(row.bias, dense.bias)),
        "output": _relative(y_tp, y_dense),
        "output, scattered input": _relative(y_scatter, y_dense),
        "input grad": _relative(x_shard.grad, x_dense.grad.chunk(2, dim=-1)[rank]),
        "input grad, scattered input": _relative(x_full.grad, x_dense.grad),
        "weight grad": _relative(row.weight.grad, dense.weight.grad.chunk(2, dim=1)[rank]),
        "bias grad": _relative(row.bias.grad, dense.bias.grad),
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
        "output chunk": _relative(y_chunk, y_dense.chunk(2, dim=1)[rank]),
        "input grad chunk": _relative(x_chunk.grad, x_dense.grad.chunk(2, dim=1)[rank]),
        "column weight grad": _relative(column.weight.grad, dense_in.weight.grad.chunk(2)[rank]),
        "row weight grad": _relative(row.weight.grad, dense_out.weight.grad.chunk(2, dim=1)[rank]),
        "row bias grad": _relative(row.bias.grad, dense_out.bias.grad),
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
    # Tied head: the loss against the same shard, without any logits, and its gradients.
    hidden = torch.randn(BATCH, SEQ, HIDDEN)
    labels = torch.randint(0, VOCAB, (BATCH, SEQ))
    labels[1, 2] = -100
    weight_dense, weight_shard = dense.weight.detach().clone(), embedding.weight.detach().clone()
    results = {
        "init": _exact(embedding.weight, dense.weight.chunk(2)[rank]),
        "output": _relative(y_tp, y_dense),
        "weight grad": _relative(embedding.weight.grad, dense.weight.grad.chunk(2)[rank]),
    }
    for sequence_parallel in (False, True):
        tag = "sequence-parallel " if sequence_parallel else ""
        h_dense, w_dense = hidden.clone().requires_grad_(), weight_dense.clone().requires_grad_()
        loss_dense = F.cross_entropy(F.linear(h_dense, w_dense).view(-1, VOCAB), labels.view(-1))
        loss_dense.backward()
        h_tp, w_tp = hidden.clone().requires_grad_(), weight_shard.clone().requires_grad_()
        h_in = scatter_to_sequence_parallel_region(h_tp, group, dim=1) if sequence_parallel else h_tp
        head = lm_head_input(h_in, w_tp, group, sequence_parallel=sequence_parallel, sequence_dim=1)
        loss_tp = vocab_parallel_loss(head, labels, group)
        loss_tp.backward()
        results[f"{tag}tied loss"] = _relative(loss_tp, loss_dense)
        results[f"{tag}tied hidden grad"] = _relative(h_tp.grad, h_dense.grad)
        results[f"{tag}tied weight grad"] = _relative(w_tp.grad, w_dense.grad.chunk(2)[rank])
    return results


def _cross_entropy(topology: ParallelTopology) -> dict[str, float]:
    """The chunked vocabulary-parallel loss and scores against F.cross_entropy / log_softmax / argmax on the full
    logits, for every reduction (gradients of the two that train)."""
    group, rank = topology.tp_group, topology.tp_rank(torch.distributed.get_rank())
    torch.manual_seed(3)
    hidden = torch.randn(SEQ, BATCH, HIDDEN)
    weight = torch.randn(VOCAB, HIDDEN)
    labels = torch.randint(0, VOCAB, (SEQ, BATCH))
    labels[0, 0], labels[0, 1], labels[3, 1] = 0, VOCAB - 1, -100  # both ends, and one ignored position
    results = {}
    for reduction in ("mean", "sum", "none"):
        h_dense, w_dense = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        dense = F.cross_entropy(F.linear(h_dense, w_dense).view(-1, VOCAB), labels.view(-1), reduction=reduction)
        train = reduction != "none"
        h_tp = hidden.clone().requires_grad_(train)
        w_tp = weight.chunk(2)[rank].clone().requires_grad_(train)
        parallel = vocab_parallel_loss(HeadInput(h_tp, w_tp), labels, group, reduction=reduction)
        results[f"loss {reduction}"] = _relative(parallel.reshape(-1), dense.reshape(-1))
        if train:
            dense.backward()
            parallel.backward()
            results[f"hidden grad {reduction}"] = _relative(h_tp.grad, h_dense.grad)
            results[f"weight grad {reduction}"] = _relative(w_tp.grad, w_dense.grad.chunk(2)[rank])
    logits = F.linear(hidden, weight)
    logprobs, argmax = vocab_parallel_scores(HeadInput(hidden, weight.chunk(2)[rank]), labels.clamp(min=0), group)
    assert logprobs is not None
    dense_logprobs = torch.log_softmax(logits, dim=-1).gather(-1, labels.clamp(min=0)[..., None]).squeeze(-1)
    results["target log-probabilities"] = _relative(logprobs, dense_logprobs)
    results["greedy tokens"] = 0.0 if torch.equal(argmax, logits.argmax(dim=-1)) else math.inf
    # bf16: the loss is still computed in fp32, and the gradient comes back in bf16.
    h16 = hidden.to(torch.bfloat16).requires_grad_()
    loss16 = vocab_parallel_loss(HeadInput(h16, weight.chunk(2)[rank].to(torch.bfloat16)), labels, group)
    loss16.backward()
    results["bf16: loss not fp32"] = math.inf if loss16.dtype != torch.float32 else 0.0
    results["bf16: grad not bf16"] = math.inf if h16.grad.dtype != torch.bfloat16 else 0.0
    return results


def _deepspeed_oracle(topology: ParallelTopology) -> dict[str, float]:
    """Our chunked vocabulary-parallel loss against DeepSpeed's own (deepspeed.sequence.cross_entropy, which takes
    this rank's logits shard and its vocab_start/vocab_end): loss, hidden gradient (its logits gradient through
    the head, summed over TP as the logits' input needs) and the embedding shard's gradient, mean and sum."""
    from deepspeed.sequence.cross_entropy import vocab_parallel_cross_entropy

    from appliance.parallel.step.deepspeed_comm import init_deepspeed_comm

    init_deepspeed_comm("gloo")
    group, rank = topology.tp_group, topology.tp_rank(torch.distributed.get_rank())
    torch.manual_seed(8)
    hidden, weight = torch.randn(BATCH, SEQ + 3, HIDDEN), torch.randn(VOCAB, HIDDEN)
    labels = torch.randint(0, VOCAB, (BATCH, SEQ + 3))
    labels[0, 0], labels[1, 1], labels[1, 4] = 0, VOCAB - 1, -100
    shard = weight.chunk(2)[rank]
    per_rank = VOCAB // 2
    results = {}
    for reduction in ("mean", "sum"):
        h_ds, w_ds = hidden.clone().requires_grad_(), shard.clone().requires_grad_()
        oracle = vocab_parallel_cross_entropy(
            F.linear(h_ds, w_ds), labels, tp_group=group, vocab_start_index=rank * per_rank,
            vocab_end_index=(rank + 1) * per_rank, reduction=reduction,
        )  # fmt: skip
        oracle.backward()
        torch.distributed.all_reduce(h_ds.grad, group=group)  # each rank's logits slice gives part of it
        h_ours, w_ours = hidden.clone().requires_grad_(), shard.clone().requires_grad_()
        ours = vocab_parallel_loss(HeadInput(h_ours, w_ours), labels, group, reduction=reduction)
        ours.backward()
        results[f"loss {reduction}"] = _relative(ours, oracle)
        results[f"hidden grad {reduction}"] = _relative(h_ours.grad, h_ds.grad)
        results[f"weight grad {reduction}"] = _relative(w_ours.grad, w_ds.grad)
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
        fused = _linear(self.self_attention["query_key_value"], x)  # [s, b, 3 * hidden / tp], whole heads of this rank
        seq, batch, _ = fused.shape
        head_dim = HIDDEN // HEADS
        q, k, v = fused.view(seq, batch, self.local_heads, 3, head_dim).unbind(dim=3)
        scores = torch.einsum("sbhd,tbhd->bhst", q, k) / math.sqrt(head_dim)
        distance = torch.arange(seq).view(1, seq) - torch.arange(seq).view(seq, 1)
        scores = scores + self.slopes.view(1, -1, 1, 1) * distance.clamp(max=0)
        scores = scores.masked_fill(distance > 0, float("-inf"))
        context = torch.einsum("bhst,tbhd->sbhd", scores.softmax(dim=-1), v)
        return _linear(self.self_attention["dense"], context.reshape(seq, batch, self.local_heads * head_dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.input_layernorm(x))
        mlp = self.mlp
        return x + _linear(
            mlp["dense_4h_to_h"], F.gelu(_linear(mlp["dense_h_to_4h"], self.post_attention_layernorm(x)))
        )


def _linear(layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """A factory linear's full output: its bias added here when it leaves it to the caller (skip_bias_add)."""
    out = layer(x)
    return out + layer.bias if getattr(layer, "skip_bias_add", False) else out


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
        results[f"{tag} output"] = _relative(y_tp, y_dense)
        results[f"{tag} input grad"] = _relative(x_tp.grad, x_dense.grad)
        worst_init, worst_grad = 0.0, 0.0
        for name, param in block.named_parameters():
            role, is_bias = role_of_parameter(name)
            expected_param = shard_from_full(dict(dense.named_parameters())[name], role, rank, 2, is_bias=is_bias)
            expected_grad = shard_from_full(dense_grads[name], role, rank, 2, is_bias=is_bias)
            worst_grad = max(worst_grad, _relative(param.grad, expected_grad))
            worst_init = max(worst_init, _exact(param, expected_param))  # no optimizer step was taken
        results[f"{tag} parameter grads"] = worst_grad
        results[f"{tag} init"] = worst_init
    return results


def _missing_all_reduce(topology: ParallelTopology) -> dict[str, float]:
    """A bug the bound must catch: a row-parallel linear whose partial sums are never all-reduced."""
    rank = topology.tp_rank(torch.distributed.get_rank())
    torch.manual_seed(1)
    dense = nn.Linear(12, HIDDEN)
    x = torch.randn(SEQ, BATCH, 12)
    partial = F.linear(x.chunk(2, dim=-1)[rank], dense.weight.chunk(2, dim=1)[rank], dense.bias)
    return {"row output without its all-reduce": _relative(partial, dense(x))}


def _wrong_device(topology: ParallelTopology) -> str | None:
    """The guard expecting another device (as on a GPU rank) refuses the CPU tensor, before any rank sends."""
    guard = collective_guard()
    expected, guard.device = guard.device, torch.device("meta")
    try:
        torch.distributed.all_reduce(torch.ones(3, 4))
    except WrongDeviceError as e:
        return str(e)
    finally:
        guard.device = expected
    return None


def _all_checks(topology: ParallelTopology) -> dict[str, Any]:
    with pinned_threads(1):
        floor = _rounding_floor()
    results: dict[str, Any] = {
        "floor": floor,
        "column": _column(topology),
        "row": _row(topology),
        "batch-first sequence parallel": _batch_first_sequence_parallel(topology),
        "vocab": _vocab(topology),
        "cross_entropy": _cross_entropy(topology),
        "deepspeed oracle": _deepspeed_oracle(topology),
        "block": _block(topology),
        "teeth": _missing_all_reduce(topology),
    }
    results["collectives"] = dict(collective_guard().calls)
    results["wrong device"] = _wrong_device(topology)
    return results


@pytest.fixture(scope="module")
def tp2_results() -> list[dict[str, Any]]:
    return run_distributed(_all_checks, 2, tp=2, timeout_s=120)


def _bound(floor: dict[str, float]) -> float:
    return FACTOR * max(floor.values())


def _assert_close(results: list[dict[str, Any]], key: str) -> None:
    for rank, per_rank in enumerate(results):
        floor, limit = max(per_rank["floor"].values()), _bound(per_rank["floor"])
        for check, error in per_rank[key].items():
            assert error <= limit, (
                f"{key} {check} on rank {rank}: relative difference {error:.3e} > bound {limit:.3e} "
                f"= {FACTOR:g} x fp32 rounding floor {floor:.3e}"
            )


def test_fp32_rounding_floor_is_nonzero_but_small(tp2_results: list[dict[str, Any]]) -> None:
    """Pass: fp32 rounds the dense block away from float64 (so the bound is not 0), at the level of rounding."""
    for per_rank in tp2_results:
        check_floor(NoiseFloor(per_rank["floor"], {k: "dense block" for k in per_rank["floor"]}), ["output"])
        assert max(per_rank["floor"].values()) < 1e-5, per_rank["floor"]


def test_a_missing_all_reduce_lands_far_outside_the_bound(tp2_results: list[dict[str, Any]]) -> None:
    for rank, per_rank in enumerate(tp2_results):
        for check, error in per_rank["teeth"].items():
            assert error > TEETH * _bound(per_rank["floor"]), (rank, check, error, per_rank["floor"])


def test_collective_guard_sees_the_mappings_and_refuses_a_wrong_device(tp2_results: list[dict[str, Any]]) -> None:
    """Pass: the guard counted the TP collectives, including the two the mappings bound at import, and with its
    expected device set to another one it refused a CPU tensor handed to all_reduce, naming device and shape."""
    for per_rank in tp2_results:
        calls = per_rank["collectives"]
        assert all(calls.get(name, 0) > 0 for name in ("all_reduce", "all_gather_single", "reduce_scatter_single"))
        assert per_rank["wrong device"] == (
            "torch.distributed.all_reduce was handed a tensor on cpu of shape (3, 4); this rank computes on meta"
        )


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


def test_vocab_parallel_cross_entropy_equals_deepspeeds(tp2_results: list[dict[str, Any]]) -> None:
    """Pass: loss and gradients equal those of DeepSpeed's vocabulary-parallel cross-entropy at tp=2."""
    _assert_close(tp2_results, "deepspeed oracle")


def test_block_with_and_without_sequence_parallel_equals_dense(tp2_results: list[dict[str, Any]]) -> None:
    _assert_close(tp2_results, "block")


@pytest.fixture(scope="module")
def local_bound() -> float:
    """The bound for comparisons in this process, from the floor measured here at a pinned thread count."""
    with pinned_threads(1):
        return _bound(_rounding_floor())


def test_fused_qkv_rows_split_by_whole_heads_as_transformers_reads_them(local_bound: float) -> None:
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
        for name, whole, part in (("q", q, q_r), ("k", k, k_r), ("v", v, v_r)):
            assert _relative(part, whole[:, mine]) <= local_bound, (rank, name)


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


def test_factory_returns_single_device_linears_at_tp1_and_skips_the_fused_biases() -> None:
    """Pass: at tp=1 the factory gives the single-device layers, and at every tp the three linears whose bias goes
    into bias+GeLU or bias+dropout+residual leave it to the model (the layers of tp=2 are built in _block)."""
    make = tp_linear_factory(ParallelTopology(tp=1, pp=1, dp=1, world_size=1))
    layer = make(8, 24, True, "qkv")
    assert type(layer) is nn.Linear and layer.weight.shape == (24, 8)
    for role in ("mlp_in", "attn_out", "mlp_out"):
        skipping = make(8, 8, True, role)
        x = torch.randn(2, 8)
        assert skipping.skip_bias_add and torch.equal(skipping(x), F.linear(x, skipping.weight)), role
    with pytest.raises(ValueError, match="unknown linear role"):
        make(8, 8, True, "lm_head")


def test_layers_and_loss_run_in_one_process_without_a_process_group(local_bound: float) -> None:
    torch.manual_seed(0)
    dense = nn.Linear(HIDDEN, 12)
    torch.manual_seed(0)
    column = ColumnParallelLinear(HIDDEN, 12)
    x = torch.randn(SEQ, BATCH, HIDDEN)
    assert torch.equal(column(x), dense(x))
    hidden = torch.randn(SEQ, BATCH, HIDDEN, requires_grad=True)
    weight = torch.randn(VOCAB, HIDDEN)
    labels = torch.randint(0, VOCAB, (SEQ, BATCH))
    loss = vocab_parallel_loss(HeadInput(hidden, weight), labels)
    (grad,) = torch.autograd.grad(loss, hidden)
    reference = F.cross_entropy(F.linear(hidden, weight).view(-1, VOCAB), labels.view(-1))
    (reference_grad,) = torch.autograd.grad(reference, hidden)
    assert _relative(loss, reference) <= local_bound
    assert _relative(grad, reference_grad) <= local_bound
