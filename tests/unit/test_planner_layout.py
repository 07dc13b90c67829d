"""Model shapes (parameter and FLOP counts) and the self-checking layout: validation, parsing, pipeline split."""

from __future__ import annotations

from pathlib import Path

import pytest

from appliance.errors import BadInput
from appliance.planner import Layout, load_model_shape, parse_layout, pipeline_partition

# Published parameter counts (transformers' BloomModel on each hub config).
PUBLISHED_PARAMETERS = {
    "bloom-560m": 559_214_592,
    "bloom-1b1": 1_065_314_304,
    "bloom-1b7": 1_722_408_960,
    "bloom-3b": 3_002_557_440,
    "bloom-7b1": 7_069_016_064,
    "bloom-176b": 176_247_271_424,
}


@pytest.mark.parametrize(("name", "count"), PUBLISHED_PARAMETERS.items())
def test_bloom_parameter_counts(name: str, count: int) -> None:
    assert load_model_shape(name).parameters() == count


def test_flops_match_megatron_formulas_with_causal_attention() -> None:
    m = load_model_shape("bloom-176b")
    B, s, L, h, V = 2048, 2048, 70, 14336, 250880
    # Megatron-DeepSpeed's throughput log with --checkpoint-activations: 96 B s L h^2 (1 + s/6h + V/(16 L h)), where
    # s/6h is the attention over the full s x s square (16 L s h per token). Causal attention computes half of it.
    megatron_hw = 96 * B * s * L * h**2 * (1 + s / (6 * h) + V / (16 * L * h))
    causal_hw = 96 * B * s * L * h**2 * (1 + s / (12 * h) + V / (16 * L * h))
    assert m.flops_per_token(recompute="full") * B * s == pytest.approx(causal_hw, rel=1e-12)
    assert megatron_hw - causal_hw == pytest.approx(8 * L * s * h * B * s, rel=1e-12)
    # Narayanan et al. model FLOPs: 72 B s L h^2 (1 + s/6h + V/(12 L h)); causal: s/12h, 6 L s h per token.
    causal = 72 * B * s * L * h**2 * (1 + s / (12 * h) + V / (12 * L * h))
    assert m.flops_per_token() * B * s == pytest.approx(causal, rel=1e-12)
    # Selective recompute adds only the attention core's causal forward: 2 L s h per token.
    assert m.flops_per_token(recompute="selective") - m.flops_per_token() == pytest.approx(2 * L * s * h)


def test_flops_per_token_of_a_small_shape_by_hand() -> None:
    """The arithmetic written out for bloom-micro-test: L=2, h=64, f=256, V=512 (padded 512), s=32."""
    m = load_model_shape("bloom-micro-test")
    n = 2 * (4 * 64 * 64 + 2 * 64 * 256) + 512 * 64  # 98304 block weights + 32768 LM head = 131072
    assert n == 131072 and m.matmul_parameters() == n
    # 6N = 786432; attention: 2 s h forward per layer and token under the causal mask, x3 with backward = 6 L s h
    assert m.flops_per_token() == 6 * 131072 + 6 * 2 * 32 * 64 == 811008


def test_vocab_padding() -> None:
    tiny = load_model_shape("bloom-tiny-cpu")
    assert tiny.padded_vocab(1) == 8192 and tiny.padded_vocab(2) == 8192
    assert load_model_shape("bloom-micro-test").padded_vocab(8) == 1024
    assert load_model_shape("bloom-176b").padded_vocab(4) == 250880  # 490 x 128 x 4


def test_model_file_errors(tmp_path: Path) -> None:
    path = tmp_path / "m.toml"
    path.write_text("layers = 2\nhidden = 100\nheads = 3\nvocab_size = 10\nseq_len = 8\n")
    with pytest.raises(BadInput, match=r"m\.toml.*hidden\(100\) is not divisible by heads\(3\)"):
        load_model_shape(str(path))
    path.write_text("layers = 2\nhidden = 64\nheads = 4\nvocab_size = 10\nseq_len = 8\nwidth = 3\n")
    with pytest.raises(BadInput, match=r"m\.toml: unknown key 'width'"):
        load_model_shape(str(path))
    path.write_text("layers = 2\nhidden = 64\nheads = 4\nvocab_size = 10\nseq_len = 8\n[train]\nlr = 'fast'\n")
    with pytest.raises(BadInput, match=r"\[train\] lr must be a non-negative number"):
        load_model_shape(str(path))
    with pytest.raises(BadInput, match="unknown models preset 'bloom-9000b'"):
        load_model_shape("bloom-9000b")


def test_validate_names_every_factor() -> None:
    layout = Layout(tp=4, pp=12, dp=8, micro_batch_size=2)
    layout.validate(384, heads=112, layers=70)
    with pytest.raises(BadInput) as err:
        layout.validate(256, heads=112, layers=70)
    assert "tp(4) * pp(12) * dp(8) = 384 != world size 256" in str(err.value)
    with pytest.raises(BadInput) as err:
        Layout(tp=3, pp=16, dp=8).validate(256, heads=112, layers=70)
    message = str(err.value)
    assert "tp(3) * pp(16) * dp(8) = 384 != world size 256" in message
    assert "heads(112) is not divisible by tp(3)" in message
    assert "layers(70) cannot be balanced over pp(16)" in message


def test_layout_self_checks() -> None:
    with pytest.raises(BadInput, match=r"global batch\(100\) is not divisible by mbs\(2\) \* dp\(8\) = 16"):
        Layout(tp=4, pp=12, dp=8, micro_batch_size=2, global_batch_size=100)
    with pytest.raises(BadInput, match="zero_stage must be 0, 1 or 2"):
        Layout(tp=1, pp=1, dp=1, zero_stage=3)
    with pytest.raises(BadInput, match="sequence parallelism needs tp > 1"):
        Layout(tp=1, pp=1, dp=2, sequence_parallel=True)
    with pytest.raises(BadInput, match="tp must be a positive integer"):
        Layout(tp=0, pp=1, dp=1)
    assert Layout(tp=4, pp=12, dp=8, micro_batch_size=2, global_batch_size=2048).micro_batches == 128


def test_parse_layout() -> None:
    bloom = parse_layout("tp=4,pp=12,dp=8,mbs=2")
    assert bloom == Layout(4, 12, 8, 2, 0, 1, "full", False)  # unnamed fields take BLOOM-176B's settings
    full = parse_layout("tp=2, pp=1, dp=2, mbs=4, gbs=64, zero=2, recompute=selective, sp=1")
    assert full == Layout(2, 1, 2, 4, 64, 2, "selective", True)
    assert parse_layout(full.describe()) == full


def test_zero2_with_a_pipeline_is_refused_and_never_searched() -> None:
    """DeepSpeed's pipeline engine runs ZeRO 0/1 only: the planner must not propose what cannot run."""
    with pytest.raises(BadInput, match="ZeRO-2 cannot run with pipeline parallelism"):
        parse_layout("tp=2,pp=2,dp=2,mbs=4,gbs=64,zero=2")
    from appliance.hardware import load_hardware
    from appliance.planner import load_model_shape, make_plan

    plan = make_plan(load_hardware("jean-zay-a100-48n"), load_model_shape("bloom-176b"), global_batch_size=2048)
    assert not (plan.layout.zero_stage == 2 and plan.layout.pp > 1)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("", "--layout is empty"),
        ("tp=4,pp=12", "missing dp"),
        ("tp=4,pp=12,dp=8,mbs=two", "'mbs=two': 'two' is not a non-negative integer"),
        ("tp=4,pp=12,dp=8,xp=2", "unknown key 'xp' in 'xp=2'"),
        ("tp=4,pp=12,dp=8,cp=2,cp_mode=flat", "'cp_mode=flat': cp_mode must be one of ulysses, ring"),
        ("tp=4,pp=12,dp=8,cp=0", "cp must be a positive integer"),
        ("tp=4,pp=12,dp=8,recompute=most", "'recompute=most': recompute must be one of none, selective, full"),
        ("tp=4,pp=12,dp=8,sp=maybe", "'sp=maybe': sp must be 0 or 1"),
        ("tp=4,tp=2,pp=1,dp=1", "'tp' is given twice"),
        ("tp=4,pp=12,dp8", "'dp8' is not key=value"),
        ("tp=4,pp=12,dp=8,zero=3", "zero_stage must be 0, 1 or 2"),
    ],
)
def test_parse_layout_errors(text: str, message: str) -> None:
    with pytest.raises(BadInput) as err:
        parse_layout(text)
    assert message in str(err.value)


def test_pipeline_partition() -> None:
    bloom = pipeline_partition(70, 12)  # BLOOM: embedding ends count as blocks, 72 / 12 = 6
    assert bloom.method == "type:transformer|embedding"
    assert bloom.layers_per_stage == (5, *[6] * 10, 5)
    assert pipeline_partition(70, 5).layers_per_stage == (14,) * 5
    assert pipeline_partition(2, 2).layers_per_stage == (1, 1)
    assert pipeline_partition(24, 1).layers_per_stage == (24,)
    assert pipeline_partition(70, 8).layers_per_stage == (8, *[9] * 6, 8)
    with pytest.raises(BadInput, match=r"layers\(70\) cannot be balanced over pp\(16\)"):
        pipeline_partition(70, 16)


def test_context_parallel_layout() -> None:
    layout = parse_layout("tp=2,pp=2,dp=2,cp=4,cp_mode=ring")
    assert (layout.cp, layout.cp_mode, layout.world_size) == (4, "ring", 32)
    # Ring cuts each sequence into 2 * cp pieces for the zigzag order; Ulysses into cp.
    assert layout.sequence_chunks == 8 and parse_layout("tp=1,pp=1,dp=1,cp=4").sequence_chunks == 4
    assert parse_layout(layout.describe()) == layout
    assert parse_layout("tp=1,pp=1,dp=2").to_dict()["cp"] == 1  # plans state cp even when it is 1
    layout.validate(32, heads=8, layers=4, seq_len=64)
    with pytest.raises(BadInput) as err:
        layout.validate(16, heads=8, layers=4, seq_len=36)
    message = str(err.value)
    assert "tp(2) * pp(2) * dp(2) * cp(4) = 32 != world size 16" in message
    assert "seq_len(36) is not divisible by 8 (cp(4) chunks, two per rank for the zigzag order)" in message
    # Ulysses gives each CP rank (heads / tp) / cp whole heads after its all-to-all.
    with pytest.raises(BadInput, match=r"heads\(8\) / tp\(2\) = 4 heads per TP rank is not divisible by cp\(8\)"):
        parse_layout("tp=2,pp=1,dp=1,cp=8").validate(16, heads=8, layers=4, seq_len=64)


def test_sequence_parallel_needs_each_cp_ranks_tokens_divisible_by_tp() -> None:
    parse_layout("tp=2,pp=1,dp=1,sp=1,cp=2").validate(4, heads=8, layers=2, seq_len=12)
    with pytest.raises(BadInput, match=r"seq_len\(12\) / cp\(2\) = 6 tokens per CP rank is not divisible by tp\(4\)"):
        parse_layout("tp=4,pp=1,dp=1,sp=1,cp=2").validate(8, heads=8, layers=2, seq_len=12)
