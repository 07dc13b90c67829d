"""The MoE cost model's arithmetic, written out by hand, and its all-to-all choice by topology with its reasons; the
node split the hierarchical exchange needs (no process group: the pure rank arithmetic)."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest

from appliance.errors import BadInput
from appliance.hardware.profile import load_hardware
from appliance.parallel.experts.all_to_all import _split_by_node, make_all_to_all, ranks_per_node_from_launcher
from appliance.planner.moe_costs import (
    MoeLinks,
    MoeShape,
    all_to_all_bytes_per_step,
    all_to_all_messages,
    choose_all_to_all,
    expert_compute_per_step,
    expert_memory_per_rank,
    flat_cost,
    hierarchical_cost,
    links_from_hardware,
    moe_plan_notes,
    moe_shape_for_model,
    offload_traffic,
)

# 8 experts of BLOOM's MLP (h 16 -> f 64 -> h 16) in 2 MoE layers over ep 4 on nodes of 2 ranks; a rank routes 32
# tokens per micro-batch, top-2 at capacity factor 1.5: C = ceil(2 x 1.5 x 32 / 8) = 12 slots per expert.
SHAPE = MoeShape(
    num_experts=8,
    top_k=2,
    capacity_factor=1.5,
    moe_layers=2,
    hidden=16,
    tokens=32,
    ep=4,
    ranks_per_node=2,
    micro_batches=3,
)
# Round rates so the times are easy to write out: 1 GB/s and 10 us inside a node, 0.1 GB/s and 100 us across.
LINKS = MoeLinks(
    intra_bandwidth=1e9,
    intra_latency=10e-6,
    inter_bandwidth=1e8,
    inter_latency=100e-6,
    host_bandwidth=2e9,
    disk_bandwidth=5e8,
)


def test_expert_memory_is_weights_grads_and_optimizer_of_the_local_experts() -> None:
    per_expert = 2 * 16 * 64 + 64 + 16  # two weight matrices and two biases: 2128
    memory = expert_memory_per_rank(SHAPE)
    assert memory.parameters == 2 * (8 // 4) * per_expert  # 2 layers x 2 local experts
    assert (memory.weights, memory.grads, memory.optimizer) == (8512 * 2, 8512 * 4, 8512 * 12)
    assert memory.total == 8512 * 18
    assert expert_memory_per_rank(dataclasses.replace(SHAPE, ep=8)).parameters == memory.parameters // 2


def test_all_to_all_bytes_are_tokens_hidden_topk_capacity_and_four_exchanges_per_layer() -> None:
    assert SHAPE.capacity == 12
    # [E, C, h] = 8 x 12 x 16 bf16 = 3072 B per exchange (= 32 tokens x 16 x 2 x 1.5 x 2 B), x 2 x 2 x 2 layers x 3.
    assert all_to_all_bytes_per_step(SHAPE) == 3072 * 2 * 2 * 2 * 3
    flat, hier = flat_cost(SHAPE, LINKS), hierarchical_cost(SHAPE, LINKS)
    assert flat.calls_per_step == hier.calls_per_step == 24
    assert flat.bytes_sent_per_call == 3 / 4 * 3072  # 3 chunks of S/4 leave the rank
    assert flat.inter_node_bytes_per_call == 2 / 4 * 3072  # 2 of them to the other node
    assert hier.bytes_sent_per_call == (1 / 2 + 1 / 2) * 3072  # S/2 inside the node, S/2 across
    assert hier.inter_node_bytes_per_call == flat.inter_node_bytes_per_call
    assert flat.bytes_sent_per_step == 24 * flat.bytes_sent_per_call


def test_message_counts_are_p_minus_one_flat_and_g_plus_p_over_g_hierarchical() -> None:
    assert (flat_cost(SHAPE, LINKS).messages_per_call, hierarchical_cost(SHAPE, LINKS).messages_per_call) == (3, 2)
    assert all_to_all_messages("flat", 64, 8) == 63
    assert all_to_all_messages("hierarchical", 64, 8) == 7 + 7
    assert hierarchical_cost(SHAPE, LINKS).messages_per_step == 2 * 24


def test_alpha_beta_times() -> None:
    chunk = 3072 / 4
    flat = 1 * (10e-6 + chunk / 1e9) + 2 * (100e-6 + chunk / 1e8)
    hier = 1 * 10e-6 + 1536 / 1e9 + 1 * 100e-6 + 1536 / 1e8
    assert flat_cost(SHAPE, LINKS).seconds_per_call == pytest.approx(flat, rel=1e-12)
    assert hierarchical_cost(SHAPE, LINKS).seconds_per_call == pytest.approx(hier, rel=1e-12)
    assert hierarchical_cost(SHAPE, LINKS).seconds_per_step == pytest.approx(24 * hier, rel=1e-12)


def test_capacity_factor_multiplies_expert_compute() -> None:
    compute = expert_compute_per_step(SHAPE)
    # 12 h f FLOPs per slot, 8 experts x 12 slots filled per rank, 2 layers x 3 micro-batches.
    assert compute.flops == 12 * 16 * 64 * (8 * 12) * 2 * 3
    assert compute.useful_flops == 12 * 16 * 64 * (32 * 2) * 2 * 3  # tokens x top_k routed slots
    assert compute.padding_fraction == pytest.approx(1 - 64 / 96)  # = 1 - 1/1.5
    assert expert_compute_per_step(dataclasses.replace(SHAPE, capacity_factor=1.0)).padding_fraction == 0.0


def test_offload_moves_weights_twice_per_microbatch_and_grads_once() -> None:
    memory = expert_memory_per_rank(SHAPE)
    host = offload_traffic(SHAPE, LINKS, "host")
    assert host.bytes_per_step == 2 * memory.weights * 3 + memory.grads
    assert host.seconds_per_step == pytest.approx(host.bytes_per_step / 2e9)
    disk = offload_traffic(SHAPE, LINKS, "disk")
    assert disk.bytes_per_step == host.bytes_per_step + 2 * memory.optimizer  # the update reads and writes them
    assert disk.seconds_per_step == pytest.approx(disk.bytes_per_step / 5e8)  # the drive is the slower hop


def test_one_node_or_one_rank_per_node_is_flat() -> None:
    node = dataclasses.replace(SHAPE, ranks_per_node=8)
    choice = choose_all_to_all(node, LINKS)
    assert (choice.kind, choice.hierarchical) == ("flat", None)
    assert "sit in one node" in choice.reason
    strided = dataclasses.replace(SHAPE, rank_stride=2)  # tp 2: every node holds one rank of the ep group
    choice = choose_all_to_all(strided, LINKS)
    assert choice.kind == "flat" and "one ep rank per node" in choice.reason
    assert choose_all_to_all(dataclasses.replace(SHAPE, ep=1), LINKS).kind == "flat"


def test_many_nodes_pick_hierarchical_on_bloom_cluster() -> None:
    # Jean Zay: 8 A100 per node on NVLink, 400 Gb/s Omni-Path per node. ep 64 = 8 nodes x 8 ranks.
    links = links_from_hardware(load_hardware("jean-zay-a100-48n"))
    assert links.inter_bandwidth == pytest.approx(400 / 8 * 1e9 * 0.8 / 8)  # the node's fabric, 8 ranks sharing
    shape = MoeShape(
        num_experts=64, top_k=2, capacity_factor=1.25, moe_layers=12, hidden=1024, tokens=2048, ep=64, ranks_per_node=8
    )
    choice = choose_all_to_all(shape, links)
    assert choice.kind == "hierarchical"
    assert choice.hierarchical is not None
    assert choice.hierarchical.seconds_per_call < choice.flat.seconds_per_call
    assert "14 messages (7 + 7)" in choice.reason and "against 63" in choice.reason


def test_slow_node_links_keep_flat_with_the_reason() -> None:
    # Inside the node slower than across it: the extra (G-1)/G S inside the node costs more than the latency saved.
    links = dataclasses.replace(LINKS, intra_bandwidth=1e6, inter_bandwidth=1e9, inter_latency=1e-6)
    choice = choose_all_to_all(SHAPE, links)
    assert choice.kind == "flat" and "outweigh" in choice.reason


def test_bad_shapes_name_their_factors() -> None:
    with pytest.raises(BadInput, match=r"num_experts\(6\) % ep\(4\) != 0"):
        dataclasses.replace(SHAPE, num_experts=6)
    with pytest.raises(BadInput, match=r"top_k\(9\) > num_experts\(8\)"):
        dataclasses.replace(SHAPE, top_k=9)
    with pytest.raises(BadInput, match="capacity_factor must be > 0"):
        dataclasses.replace(SHAPE, capacity_factor=0.0)


def test_ep_groups_split_node_by_node() -> None:
    assert _split_by_node([0, 1, 2, 3], 2) == [[0, 1], [2, 3]]
    assert _split_by_node([1, 3, 5, 7], 4) == [[1, 3], [5, 7]]  # tp 2: ep ranks 2 apart, 2 per node of 4
    with pytest.raises(BadInput, match=r"\{0: 3, 1: 1\} members per node"):
        _split_by_node([0, 1, 2, 3], 3)


def test_ranks_per_node_come_from_the_launcher(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    assert ranks_per_node_from_launcher() == 8
    assert ranks_per_node_from_launcher(2) == 2
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    with pytest.raises(BadInput, match="LOCAL_WORLD_SIZE"):
        ranks_per_node_from_launcher()


def test_plan_notes_name_memory_choice_traffic_and_padding() -> None:
    shape = MoeShape(
        num_experts=64, top_k=2, capacity_factor=1.25, moe_layers=12, hidden=1024, tokens=2048, ep=64, ranks_per_node=8
    )
    notes = moe_plan_notes(shape, load_hardware("jean-zay-a100-48n"))
    assert notes[0].startswith("experts: 1 of 64 per rank in each of 12 MoE layers")
    assert notes[1].startswith("expert all-to-all: hierarchical: 14 messages")
    assert f"in {14 * 48} messages" in notes[2]  # 4 exchanges x 12 layers
    assert notes[3].startswith("capacity factor 1.25: 20% of the expert FLOPs")


def test_shape_from_a_model_with_moe_fields() -> None:
    model = SimpleNamespace(
        hidden=16, ffn_hidden=64, moe_num_experts=8, moe_top_k=2, moe_capacity_factor=1.5, moe_layers=2
    )
    shape = moe_shape_for_model(model, ep=4, tokens=32, ranks_per_node=2, micro_batches=3)
    assert shape == dataclasses.replace(SHAPE, ffn_hidden=64)


def test_all_to_all_kinds_are_checked() -> None:
    with pytest.raises(BadInput, match="'ring': must be one of flat, hierarchical"):
        make_all_to_all("ring")  # type: ignore[arg-type]
    with pytest.raises(BadInput, match=r"needs ep_groups \(topology.groups\('ep'\)\)"):
        make_all_to_all("hierarchical")
    assert make_all_to_all("flat").kind == "flat"


def test_tp_shards_expert_memory_compute_and_exchange_bytes() -> None:
    # tp = 2: C = 12 stays a multiple of 2; each expert keeps (2 h f + f)/2 + h = (2048 + 64)/2 + 16 = 1072 parameters
    # per tp rank (the f->h bias whole), every slot costs half the FLOPs, and each exchange sends half the slots.
    at_tp2 = dataclasses.replace(SHAPE, tp=2, rank_stride=2)
    assert expert_memory_per_rank(at_tp2).parameters == 2 * 2 * 1072
    assert expert_compute_per_step(at_tp2).flops == expert_compute_per_step(SHAPE).flops / 2
    assert all_to_all_bytes_per_step(at_tp2) == all_to_all_bytes_per_step(SHAPE) // 2
    # 11 slots at tp = 1 (2 x 1.5 x 29 / 8 = 10.9) round up to 12 at tp = 4 (DeepSpeed's multiple of tp).
    fewer = dataclasses.replace(SHAPE, tokens=29)
    assert (fewer.capacity, dataclasses.replace(fewer, tp=4).capacity) == (11, 12)
    assert "each sharded over tp=2" in moe_plan_notes(at_tp2, load_hardware("jean-zay-a100-48n"))[0]
