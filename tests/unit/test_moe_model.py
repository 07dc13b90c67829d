"""BLOOM-MoE in one process: config and preset checks, the ep layout key, the MoE block on DeepSpeed's layer, its
load-balancing loss, the layout-free parameter names, and a dense model left exactly as it was."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from appliance.errors import BadInput
from appliance.model.bloom import BloomForCausalLM
from appliance.model.config import BloomConfig, config_for_shape
from appliance.model.mlp import BloomMLP
from appliance.model.moe import BloomMoE, canonical_moe_name, deepspeed_moe_name
from appliance.planner.layout import Layout, parse_layout
from appliance.planner.model_shape import load_model_shape, model_from_table

TINY = {"vocab_size": 256, "hidden_size": 32, "n_layer": 4, "n_head": 4}
MOE = BloomConfig(
    **TINY, moe_num_experts=4, moe_top_k=2, moe_drop_tokens=False, moe_random_routing=False, moe_aux_loss_coef=0.1
)


def test_config_checks_name_every_moe_field() -> None:
    with pytest.raises(ValueError) as e:
        BloomConfig(**TINY, moe_num_experts=2, moe_top_k=3, moe_every=0, moe_capacity_factor=0.0, moe_aux_loss_coef=-1)
    for field in ("moe_top_k", "moe_every", "moe_capacity_factor", "moe_aux_loss_coef"):
        assert field in str(e.value)
    with pytest.raises(ValueError, match=r"moe_top_k\(2\) > moe_num_experts\(1\)"):
        BloomConfig(**TINY, moe_num_experts=1, moe_top_k=2)
    with pytest.raises(ValueError, match=r"moe_every\(5\) > n_layer\(4\)"):
        BloomConfig(**TINY, moe_num_experts=2, moe_every=5)


def test_every_other_block_is_moe_and_parameters_count_the_experts() -> None:
    assert MOE.moe_blocks == [1, 3]
    model = BloomForCausalLM(MOE, seed=1)
    assert [type(b.mlp) for b in model.transformer.h] == [BloomMLP, BloomMoE, BloomMLP, BloomMoE]
    stored = sum(p.numel() for p in model.parameters())  # the tied head is one parameter
    assert stored == MOE.num_parameters()
    dense = BloomConfig(**TINY)
    # Per MoE block: 3 more MLPs than a dense block (8 x 32^2 + 5 x 32 each) and a [4, 32] gate.
    assert MOE.num_parameters() - dense.num_parameters() == 2 * (3 * (8 * 32 * 32 + 5 * 32) + 4 * 32)


def test_presets_size_the_moe_models_and_keep_dense_ones_unchanged() -> None:
    tiny, big, dense = (load_model_shape(n) for n in ("bloom-moe-tiny-cpu", "bloom-moe-176b", "bloom-176b"))
    assert tiny.moe_layers == 2 and tiny.moe_num_experts == 4
    config = config_for_shape(tiny, tiny.padded_vocab())
    assert config.moe_blocks == [1, 3] and config.num_parameters() == tiny.parameters()
    # BLOOM-176B's shape with 16 experts in 35 blocks: dense 176,247,271,424 + 35 x (15 MLPs + gate).
    h = 14336
    assert big.parameters() == dense.parameters() + 35 * (15 * (8 * h * h + 5 * h) + 16 * h)
    assert big.all_expert_parameters() == 35 * 16 * (8 * h * h + 5 * h)
    # Top-1: each token's work is BLOOM-176B's plus the gates.
    assert big.matmul_parameters() == dense.matmul_parameters() + 35 * 16 * h
    assert dense.moe_layers == 0 and dense.all_expert_parameters() == 0
    assert "moe_num_experts" not in config_for_shape(dense, dense.padded_vocab()).to_hf_dict()


def test_preset_moe_keys_are_checked(tmp_path: Path) -> None:
    table = {"layers": 4, "hidden": 32, "heads": 4, "vocab_size": 256, "seq_len": 16}
    with pytest.raises(BadInput, match="moe_top_k must be 1 or 2"):
        model_from_table({**table, "moe_num_experts": 4, "moe_top_k": 3}, "x.toml")
    with pytest.raises(BadInput, match="'moe_drop_tokens' has a bad value"):
        model_from_table({**table, "moe_num_experts": 4, "moe_drop_tokens": 1}, "x.toml")


def test_ep_layout_key() -> None:
    layout = parse_layout("tp=1,pp=2,dp=4,ep=2,mbs=2")
    assert layout.ep == 2 and layout.to_dict()["ep"] == 2 and "ep=2" in layout.describe()
    assert parse_layout(layout.describe()) == layout
    assert parse_layout("tp=1,pp=1,dp=2").ep == 1  # plans from before ep read as ep = 1
    with pytest.raises(BadInput, match=r"dp\(2\) % ep\(4\) != 0"):
        parse_layout("tp=1,pp=1,dp=2,ep=4")
    with pytest.raises(BadInput, match=r"ep\(2\) > 1 needs an MoE model"):
        Layout(tp=1, pp=1, dp=2, ep=2).validate(2, 4, 4)
    with pytest.raises(BadInput, match=r"moe_num_experts\(6\) is not divisible by ep\(4\)"):
        Layout(tp=1, pp=1, dp=4, ep=4).validate(4, 4, 4, moe_num_experts=6)
    Layout(tp=1, pp=1, dp=4, ep=4).validate(4, 4, 4, moe_num_experts=8)


def test_names_are_layout_free_and_round_trip() -> None:
    local = "deepspeed_moe.experts.deepspeed_experts.1.dense_h_to_4h.weight"
    assert canonical_moe_name(local, expert_offset=2) == "experts.3.dense_h_to_4h.weight"
    assert deepspeed_moe_name("experts.3.dense_h_to_4h.weight", expert_offset=2) == local
    assert canonical_moe_name("h.1.mlp.deepspeed_moe.gate.wg.weight") == "h.1.mlp.gate.weight"
    assert canonical_moe_name("h.0.mlp.dense_h_to_4h.weight") == "h.0.mlp.dense_h_to_4h.weight"
    model = BloomForCausalLM(MOE, seed=1)
    names = list(model.state_dict())
    assert "transformer.h.1.mlp.experts.3.dense_4h_to_h.bias" in names and "transformer.h.3.mlp.gate.weight" in names
    assert not [n for n in names if "deepspeed" in n]
    again = BloomForCausalLM(MOE, seed=2)
    again.load_state_dict(model.state_dict())
    ids = torch.randint(0, 256, (2, 8))
    assert torch.equal(again(ids), model(ids))


def test_loss_adds_the_weighted_load_balancing_loss() -> None:
    model = BloomForCausalLM(MOE, seed=1)
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    loss = model.loss(ids, ids)
    aux = model.moe_aux_loss()
    # GShard's loss is experts * sum_e(token share x mean gate probability): 1 when perfectly balanced, per layer.
    assert 2.0 <= float(aux.detach()) < 8.0
    hidden = model.final_hidden(ids)
    from appliance.model import ops

    lm = ops.vocab_cross_entropy(hidden[:, :-1], model.lm_head.weight, ids[:, 1:])
    torch.testing.assert_close(loss, lm + 0.1 * aux)
    loss.backward()
    gate = model.transformer.h[1].mlp.deepspeed_moe.gate.wg.weight
    assert gate.grad is not None and float(gate.grad.abs().sum()) > 0
    counts = model.transformer.h[1].mlp.expert_counts
    assert int(counts.sum()) == 2 * 32  # top-2: every token counted at two experts


def test_a_dense_model_is_unchanged() -> None:
    """0 experts is BLOOM: the same parameters, names and numbers as before MoE existed."""
    dense = BloomForCausalLM(BloomConfig(**TINY), seed=1)
    assert not [n for n in dense.state_dict() if "gate" in n or "experts" in n]
    assert float(dense.moe_aux_loss()) == 0.0
    ids = torch.randint(0, 256, (2, 8))
    from appliance.model import ops

    torch.testing.assert_close(
        dense.loss(ids, ids), ops.vocab_cross_entropy(dense.final_hidden(ids)[:, :-1], dense.lm_head.weight, ids[:, 1:])
    )


def test_the_planner_sizes_the_176b_active_preset_with_experts_over_tp() -> None:
    """The planner sizes bloom-moe-176b on BLOOM's 384 A100s with its experts sharded over tp, never with
    sequence parallelism or cp (the engine refuses both for experts)."""
    from appliance.hardware import load_hardware
    from appliance.planner import make_plan

    plan = make_plan(load_hardware("jean-zay-a100-48n"), load_model_shape("bloom-moe-176b"))
    assert plan.layout.tp > 1 and not plan.layout.sequence_parallel and plan.layout.cp == 1
    assert plan.model.parameters() > 1.0e12


def test_moe_layout_allows_tp_and_refuses_sequence_parallel_and_tp2d() -> None:
    from appliance.parallel.experts.parallel import check_moe_layout
    from appliance.parallel.topology import ParallelTopology

    moe = BloomConfig(**TINY, moe_num_experts=4)
    check_moe_layout(moe, ParallelTopology(tp=2, pp=1, dp=2, ep=2, world_size=4))
    with pytest.raises(BadInput, match=r"sequence_parallel with tp\(2\) > 1 and experts"):
        check_moe_layout(moe, ParallelTopology(tp=2, pp=1, dp=2, ep=2, world_size=4), sequence_parallel=True)
    with pytest.raises(BadInput, match=r"tp2d\(2\) > 1 with experts"):
        check_moe_layout(moe, ParallelTopology(tp=4, pp=1, dp=1, world_size=4, tp2d=2))


def test_capacity_over_tp_rounds_up_to_a_multiple_of_tp() -> None:
    """With token dropping at tp = 2 the gate's floor is raised to the capacity rounded up to 2: 25 tokens over 4
    experts at capacity factor 2 is ceil(12.5) = 13 slots, 14 over tp; never past the token count."""
    config = BloomConfig(**TINY, moe_num_experts=4, moe_capacity_factor=2.0, moe_eval_capacity_factor=2.0)
    layer = BloomMoE(config, tp_size=2)
    assert layer._capacity_over_tp(25, 4) == 14
    assert layer._capacity_over_tp(24, 4) == 12
    assert layer._capacity_over_tp(1, 1) == 1  # 2 slots would exceed the one token: left to the tp split's check
    assert BloomMoE(config)._capacity_over_tp(25, 4) == 13
