"""The hierarchical all-to-all equals the flat one (and DeepSpeed's) bitwise, forward and backward, on 4 gloo ranks
simulating 2 nodes x 2 GPUs; installed with use_all_to_all, DeepSpeed's own MoE layer gives bitwise the same output
and gradients through it; its messages and bytes are the cost model's. One launch for every assertion."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist

from appliance.parallel.experts.all_to_all import (
    AllToAllCounter,
    flat_all_to_all,
    hierarchical_all_to_all,
    hierarchical_groups,
    restore_deepspeed_all_to_all,
    use_all_to_all,
)
from appliance.parallel.step.deepspeed_comm import init_deepspeed_comm
from appliance.parallel.testing import collective_guard, run_distributed
from appliance.parallel.topology import ParallelTopology
from appliance.planner.moe_costs import MoeShape, all_to_all_messages, flat_cost, hierarchical_cost

pytestmark = pytest.mark.distributed

RANKS, RANKS_PER_NODE = 4, 2
# Dispatched tokens as DeepSpeed's MoE layer hands them over: [E, C, h] with E = 8 experts (2 per ep rank),
# C = 3 slots, h = 5: odd sizes, so a chunk or a transpose in the wrong place cannot line up by accident.
EXPERTS, SLOTS, HIDDEN = 8, 3, 5
SHAPE = MoeShape(
    num_experts=EXPERTS,
    top_k=1,
    capacity_factor=1.0,
    moe_layers=1,
    hidden=HIDDEN,
    tokens=EXPERTS * SLOTS,  # C = ceil(1 x 1.0 x 24 / 8) = 3
    ep=RANKS,
    ranks_per_node=RANKS_PER_NODE,
    act_bytes=4,
)


def _tokens(rank: int, salt: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(1000 * salt + rank)
    return torch.randn(EXPERTS, SLOTS, HIDDEN, generator=generator)


def _counts(counter: AllToAllCounter) -> tuple[int, int, int, int]:
    return counter.calls, counter.collectives, counter.messages, counter.bytes_sent


def _exchanges(topology: ParallelTopology) -> dict[str, Any]:
    """Every exchange on this rank: flat, hierarchical, DeepSpeed's own and ours installed in DeepSpeed's place."""
    from deepspeed.moe import sharded_moe

    rank, world = dist.get_rank(), dist.group.WORLD
    ep_groups = ParallelTopology(tp=1, pp=1, dp=RANKS, ep=RANKS, world_size=RANKS).groups("ep")
    groups = hierarchical_groups(ep_groups, ranks_per_node=RANKS_PER_NODE)
    x, weight = _tokens(rank, 0), _tokens(rank, 1)
    out: dict[str, Any] = {"x": x, "weight": weight}
    assert groups.intra is not None and groups.inter is not None
    intra, inter = (dist.get_process_group_ranks(g) for g in (groups.intra, groups.inter))
    out["split"] = (groups.ep_ranks_per_node, groups.nodes, sorted(intra), sorted(inter))
    guard = collective_guard()

    for kind in ("flat", "hierarchical"):
        counter = AllToAllCounter()
        before = guard.calls["all_to_all_single"]
        leaf = x.clone().requires_grad_()
        y = flat_all_to_all(leaf, world, counter) if kind == "flat" else hierarchical_all_to_all(leaf, groups, counter)
        (y * weight).sum().backward()  # the input's gradient is weight sent back through the exchange
        out[kind] = (y.detach(), leaf.grad, _counts(counter), guard.calls["all_to_all_single"] - before)

    init_deepspeed_comm("gloo")  # the process group exists: DeepSpeed wraps it
    out["deepspeed"] = sharded_moe._AllToAll.apply(world, x)
    layer = _moe_layer()
    out["layer deepspeed"] = _layer_pass(layer, rank)
    counter = use_all_to_all("hierarchical", ep_groups=ep_groups, ranks_per_node=RANKS_PER_NODE)
    try:
        out["installed"] = (sharded_moe._AllToAll.apply(world, x), _counts(counter))
        counter.reset()
        out["layer hierarchical"] = (*_layer_pass(layer, rank), _counts(counter))
    finally:
        restore_deepspeed_all_to_all()
    out["restored"] = sharded_moe._AllToAll.__module__
    return out


def _moe_layer() -> torch.nn.Module:
    """DeepSpeed's MoE layer over the 4 ranks: 8 experts (2 a rank), top-2, each a small MLP h 6 -> 12 -> 6."""
    from deepspeed.moe.layer import MoE

    torch.manual_seed(0)  # the same experts and gate on every rank (each keeps its own 2 experts of the 8)
    expert = torch.nn.Sequential(torch.nn.Linear(6, 12), torch.nn.GELU(), torch.nn.Linear(12, 6))
    return MoE(6, expert, num_experts=EXPERTS, ep_size=RANKS, k=2, capacity_factor=1.5, min_capacity=1)


def _layer_pass(layer: torch.nn.Module, rank: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """One forward and backward: the output, the input's gradient and every parameter's."""
    layer.zero_grad()
    torch.manual_seed(1)  # top-2 gating draws Gumbel noise for the second expert and random token priority
    x = torch.randn(2, 5, 6, generator=torch.Generator().manual_seed(rank)).requires_grad_()
    y, aux_loss, _ = layer(x)
    (y.square().sum() + aux_loss).backward()
    assert x.grad is not None
    return y.detach(), [x.grad, *(p.grad.clone() for p in layer.parameters() if p.grad is not None)]


@pytest.fixture(scope="module")
def results() -> list[dict[str, Any]]:
    return run_distributed(_exchanges, RANKS, dp=RANKS, timeout_s=180)


def test_forward_is_bitwise_the_flat_exchange_and_deepspeeds(results: list[dict[str, Any]]) -> None:
    for rank, found in enumerate(results):
        # Chunk j of the output is chunk `rank` of rank j's input: the exchange, written out.
        expected = torch.cat([results[j]["x"].chunk(RANKS)[rank] for j in range(RANKS)])
        assert torch.equal(found["flat"][0], expected), f"rank {rank}"
        assert torch.equal(found["hierarchical"][0], expected), f"rank {rank}"
        assert torch.equal(found["deepspeed"], expected), f"rank {rank}"
        assert torch.equal(found["installed"][0], expected), f"rank {rank}"
        assert found["restored"] == "deepspeed.moe.sharded_moe", f"rank {rank}"


def test_sub_groups_are_the_node_and_the_same_local_index_across_nodes(results: list[dict[str, Any]]) -> None:
    for rank, found in enumerate(results):
        node, local = divmod(rank, RANKS_PER_NODE)
        assert found["split"] == (2, 2, [2 * node, 2 * node + 1], [local, local + 2]), f"rank {rank}"


def test_deepspeed_moe_layer_is_bitwise_the_same_with_the_hierarchical_exchange(
    results: list[dict[str, Any]],
) -> None:
    hier = hierarchical_cost(SHAPE, _no_links())
    for rank, found in enumerate(results):
        y, grads = found["layer deepspeed"]
        y_hier, grads_hier, counts = found["layer hierarchical"]
        assert torch.equal(y_hier, y), f"rank {rank}"
        assert len(grads) == len(grads_hier) == 1 + 1 + 2 * 2 * 2, (
            f"rank {rank}: input, gate, 2 experts x 2 linears x w, b"
        )
        assert all(torch.equal(a, b) for a, b in zip(grads, grads_hier, strict=True)), f"rank {rank}"
        # Dispatch and combine, forward and backward, each through our exchange: 4 calls of 2 messages.
        assert counts[:3] == (4, 8, 4 * hier.messages_per_call), f"rank {rank}"


def test_backward_is_the_inverse_exchange(results: list[dict[str, Any]]) -> None:
    for rank, found in enumerate(results):
        expected = torch.cat([results[j]["weight"].chunk(RANKS)[rank] for j in range(RANKS)])
        assert torch.equal(found["flat"][1], expected), f"rank {rank}"
        assert torch.equal(found["hierarchical"][1], expected), f"rank {rank}"


def test_messages_and_bytes_are_the_cost_models(results: list[dict[str, Any]]) -> None:
    flat, hier = flat_cost(SHAPE, _no_links()), hierarchical_cost(SHAPE, _no_links())
    assert (flat.messages_per_call, hier.messages_per_call) == (3, 1 + 1)
    assert all_to_all_messages("hierarchical", RANKS, RANKS_PER_NODE) == 2
    for rank, found in enumerate(results):
        # Forward and backward: 2 exchanges; flat = 1 collective each, hierarchical = 2 (intra, then inter).
        assert found["flat"][2] == (2, 2, 2 * flat.messages_per_call, 2 * flat.bytes_sent_per_call), f"rank {rank}"
        assert found["hierarchical"][2] == (2, 4, 2 * hier.messages_per_call, 2 * hier.bytes_sent_per_call)
        assert (found["flat"][3], found["hierarchical"][3]) == (2, 4), f"rank {rank}: collectives the guard saw"
        assert found["installed"][1] == (1, 2, hier.messages_per_call, hier.bytes_sent_per_call), f"rank {rank}"


def _no_links() -> Any:
    from appliance.planner.moe_costs import MoeLinks

    return MoeLinks(1e9, 1e-5, 1e9, 1e-5, 1e9, 1e9)
