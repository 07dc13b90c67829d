"""Counter-based initial weights (appliance/model/initial_weights.py): the hash, the normal draws, slices drawn on
their own, the model's init, and a rank's shards drawn without the whole model.

The draws are fixed functions of (seed, name, index), so every statistical check below passes or fails the same way
on every run; its bound is 5 standard errors of the statistic for independent N(0, 1) draws, which a correct
generator meets except with probability ~6e-7 per check (and then for this one seed, forever: a real defect shows
as many standard errors, not five).
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from appliance.model import initial_weights as iw
from appliance.model.bloom import BloomForCausalLM
from appliance.model.config import BloomConfig
from appliance.parallel.checkpoint.weight_shards import init_shards_
from appliance.parallel.tensor.layers import COLUMN_ROLES, ColumnParallelLinear, RowParallelLinear
from appliance.parallel.tensor.param_splits import role_of_parameter, shard_from_full, split_dim

CONFIG = BloomConfig(vocab_size=256, hidden_size=64, n_layer=2, n_head=4)
SIDE = 1024  # a [1024, 1024] draw: n = 2^20 samples


def _draw(name: str = "w", seed: int = 0, shape: tuple[int, int] = (SIDE, SIDE)) -> torch.Tensor:
    return iw.normal_(torch.empty(shape), iw.stream_key(seed, name), 1.0)


def test_hash_is_splitmix64_on_every_counter() -> None:
    key = iw.stream_key(1234, "transformer.h.0.mlp.dense_h_to_4h.weight")
    # Low counters, one where (q + 1) G wraps past 2^63 into the sign bit, and the largest pair index of BLOOM-176B's
    # embedding (250,880 x 14,336 / 2 pairs).
    counters = [0, 1, 2, 3, 1 << 31, (1 << 62) + 12345, 250_880 * 14_336 // 2 - 1]
    got = iw.pair_hashes(torch.tensor(counters, dtype=torch.int64), key)
    for q, z in zip(counters, got.tolist(), strict=True):
        assert z & iw.MASK64 == iw.mix64(key + (q + 1) * iw.GOLDEN), q
    # The published splitmix64 stream for seed 0 (Vigna's reference code): its first output.
    assert iw.mix64(iw.GOLDEN) == 0xE220A8397B1DCDAF


def test_normals_match_box_muller_in_float64() -> None:
    """The float32 polynomial ln, cos and sin against torch's float64 functions on the same 24-bit integers."""
    key = iw.stream_key(7, "w")
    pairs = torch.arange(1 << 18, dtype=torch.int64)
    cos, sin = iw.normal_pairs(pairs, key)
    z = iw.pair_hashes(pairs, key)
    u = (((z >> 40) & 0xFFFFFF) + 1).double() * 2.0**-24
    theta = 2 * math.pi * (((z >> 16) & 0xFFFFFF).double() + 0.5) * 2.0**-24
    rho = torch.sqrt(-2 * torch.log(u))
    # float32 keeps ~7 digits: 2^-23 relative error on values up to 5.8 is 7e-7; the series are truncated below 2e-9.
    assert float((cos.double() - rho * torch.cos(theta)).abs().max()) < 2e-6
    assert float((sin.double() - rho * torch.sin(theta)).abs().max()) < 2e-6


def test_a_large_draw_has_the_moments_of_a_standard_normal() -> None:
    x = _draw().double()
    n = x.numel()
    assert abs(float(x.mean())) < 5 / math.sqrt(n)  # standard error of the mean: 1 / sqrt(n)
    assert abs(float(x.std()) - 1) < 5 / math.sqrt(2 * n)  # of the standard deviation: 1 / sqrt(2n)
    kurtosis = float((x**4).mean() / x.var() ** 2)
    assert abs(kurtosis - 3) < 5 * math.sqrt(24 / n)  # of the kurtosis: sqrt(24 / n)
    beyond = float((x.abs() > 3).double().mean())  # P(|N| > 3) = 0.0027
    assert abs(beyond - 0.0027) < 5 * math.sqrt(0.0027 / n)
    assert float(x.abs().max()) <= math.sqrt(-2 * math.log(2.0**-24)) + 1e-5  # the 24-bit cap, 5.77


def _correlation(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double().flatten(), b.double().flatten()
    return float(torch.corrcoef(torch.stack([a, b]))[0, 1])


def test_neighbours_parameters_and_seeds_are_uncorrelated() -> None:
    x = _draw()
    bound = 5 / math.sqrt(x.numel() // 2)  # standard error of a correlation over m pairs: 1 / sqrt(m)
    assert abs(_correlation(x[:, 0::2], x[:, 1::2])) < bound  # the cos and sin of one Box-Muller pair
    assert abs(_correlation(x[:, 1:-1:2], x[:, 2::2])) < bound  # across pairs, within a row
    assert abs(_correlation(x[:-1:2], x[1::2])) < bound  # the same column of neighbouring rows
    for other in (_draw(name="w2"), _draw(seed=1)):
        assert abs(_correlation(x, other)) < 5 / math.sqrt(x.numel())
        assert not torch.equal(x, other)


@pytest.mark.parametrize(
    ("rows", "cols"),
    [((0, 37), (0, 53)), ((5, 20), (3, 50)), ((0, 37), (1, 2)), ((36, 37), (0, 53)), ((10, 30), (26, 53))],
)
def test_any_slice_drawn_alone_equals_the_same_slice_of_the_whole(rows: tuple[int, int], cols: tuple[int, int]) -> None:
    """Odd sizes and offsets (a slice may start or end inside a Box-Muller pair), and chunks of 7 pairs against one
    chunk for the whole: the numbers depend on the element's position only."""
    key = iw.stream_key(3, "w")
    whole = iw.normal_(torch.empty(37, 53), key, 0.02)
    part = torch.empty(rows[1] - rows[0], cols[1] - cols[0])
    iw.normal_(part, key, 0.02, full_shape=(37, 53), offset=(rows[0], cols[0]), pairs_per_chunk=7)
    assert torch.equal(part, whole[rows[0] : rows[1], cols[0] : cols[1]])


def test_the_thread_count_changes_no_bit() -> None:
    """A chunk of 2^16 pairs is past torch's grain (32,768 elements), so its ops split over the threads."""
    key = iw.stream_key(5, "w")
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = iw.normal_(torch.empty(256, 1024), key, 1.0)
        torch.set_num_threads(2)
        two = iw.normal_(torch.empty(256, 1024), key, 1.0)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, two)


def test_a_slice_outside_the_whole_is_refused() -> None:
    with pytest.raises(ValueError, match=r"slice at \(4, 0\) of shape \(2, 3\) lies outside \(5, 3\)"):
        iw.normal_(torch.empty(2, 3), 0, 1.0, full_shape=(5, 3), offset=(4, 0))


def test_the_model_draws_matrices_only_and_reads_a_generator_as_its_seed() -> None:
    model = BloomForCausalLM(CONFIG, seed=7)
    again = BloomForCausalLM(CONFIG, seed=torch.Generator().manual_seed(7))
    other = BloomForCausalLM(CONFIG, seed=8)
    for (name, param), same, different in zip(
        model.named_parameters(), again.parameters(), other.parameters(), strict=True
    ):
        assert torch.equal(param, same), name
        kind = iw.initial_kind(name)
        if kind == "normal":
            assert not torch.equal(param, different), name
            assert abs(float(param.detach().std()) - CONFIG.initializer_range) < 5 * 0.02 / math.sqrt(
                2 * param.numel()
            ), name
        else:
            assert torch.equal(param, torch.full_like(param, 1.0 if kind == "ones" else 0.0)), name
    assert model.lm_head.weight is model.transformer.word_embeddings.weight


def test_building_the_model_draws_no_default_init() -> None:
    """The layers are built on the meta device: torch's default inits (kaiming for nn.Linear, N(0, 1) for
    nn.Embedding, drawn from the global generator) never run, so the global generator is untouched."""
    state = torch.random.get_rng_state()
    BloomForCausalLM(CONFIG)
    assert torch.equal(torch.random.get_rng_state(), state)


def test_empty_module_keeps_parameter_attributes() -> None:
    layer = iw.empty_module(lambda: ColumnParallelLinear(8, 12, sequence_parallel=True), "cpu")
    assert layer.weight.device == torch.device("cpu") and layer.weight.shape == (12, 8)
    assert layer.weight.tensor_model_parallel and layer.weight.partition_dim == 0  # type: ignore[attr-defined]
    assert layer.bias is not None and layer.bias.tensor_model_parallel  # type: ignore[attr-defined]


@pytest.mark.parametrize("tp", [2, 4])
def test_a_ranks_shards_are_slices_of_the_single_process_model(tp: int) -> None:
    """init_shards_ on shard-shaped tensors (no process group needed: it only computes indices) against
    shard_from_full of the whole model, for every parameter and TP rank: column (QKV, MLP in), row (attention out,
    MLP out) and vocabulary cuts, and the replicated LayerNorms and row-parallel biases."""
    whole = dict(BloomForCausalLM(CONFIG, seed=11).named_parameters())
    for rank in range(tp):
        shards: list[tuple[str, torch.Tensor]] = []
        for name, param in whole.items():
            role, is_bias = role_of_parameter(name)
            dim = split_dim(role, is_bias=is_bias)
            shape = list(param.shape)
            if dim is not None:
                shape[dim] //= tp
            shards.append((name, torch.full(shape, float("nan"))))
        init_shards_(shards, CONFIG, 11, rank, tp)
        for name, shard in shards:
            role, is_bias = role_of_parameter(name)
            assert torch.equal(shard, shard_from_full(whole[name], role, rank, tp, is_bias=is_bias)), (name, rank)


def test_a_tensor_parallel_model_is_not_initialised_as_a_whole() -> None:
    def factory(in_features: int, out_features: int, bias: bool, role: str) -> nn.Module:
        layer = ColumnParallelLinear if role in COLUMN_ROLES else RowParallelLinear
        return layer(in_features, out_features, bias)

    with pytest.raises(ValueError, match=r"query_key_value\.weight is a tensor-parallel shard"):
        BloomForCausalLM(CONFIG, linear_factory=factory)


def test_an_unknown_parameter_has_no_initial_value() -> None:
    with pytest.raises(ValueError, match=r"no initial value for parameter 'transformer\.h\.0\.gate'"):
        iw.initial_kind("transformer.h.0.gate")
