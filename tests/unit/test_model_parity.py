"""Our BLOOM against transformers' BloomForCausalLM on the same random weights: logits, loss and gradients."""

from __future__ import annotations

import pytest
import torch
import transformers
from torch import nn

from appliance.model.bloom import BloomBlock, BloomForCausalLM, causal_lm_loss
from appliance.model.config import BloomConfig
from appliance.model.linear import default_linear_factory

# 12 heads is not a power of two, so the interleaved extra ALiBi slopes are exercised.
CONFIG = BloomConfig(vocab_size=101, hidden_size=96, n_layer=3, n_head=12)


def make_hf(config: BloomConfig, seed: int = 0) -> transformers.BloomForCausalLM:
    """A transformers model with weights far from init (LayerNorms and biases too), so every term matters."""
    hf_config = transformers.BloomConfig(**config.to_hf_dict())
    hf_config._attn_implementation = "eager"
    model = transformers.BloomForCausalLM(hf_config).eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=gen)
            if name.endswith("layernorm.weight") or name.endswith("ln_f.weight"):
                param.copy_(1.0 + 0.2 * noise)
            elif name.endswith("word_embeddings.weight"):
                param.copy_(0.5 * noise)
            else:
                param.copy_(0.08 * noise)
    return model


def make_ours(hf: transformers.BloomForCausalLM, config: BloomConfig = CONFIG, **kwargs: object) -> BloomForCausalLM:
    ours = BloomForCausalLM(config, **kwargs).eval()  # type: ignore[arg-type]
    ours.load_state_dict(hf.state_dict(), strict=True)
    return ours


def padded_batch(vocab: int, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """Three rows of 11: unpadded, right-padded by 4, left-padded by 5 (pad id 3 where masked)."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(4, vocab, (3, 11), generator=gen)
    mask = torch.ones_like(ids)
    mask[1, -4:] = 0
    mask[2, :5] = 0
    return ids.masked_fill(mask == 0, 3), mask


@pytest.fixture(scope="module")
def models() -> tuple[transformers.BloomForCausalLM, BloomForCausalLM]:
    hf = make_hf(CONFIG)
    return hf, make_ours(hf)


def test_state_dict_names_match_transformers(models):
    hf, ours = models
    assert list(ours.state_dict()) == list(hf.state_dict())
    assert ours.lm_head.weight is ours.transformer.word_embeddings.weight
    assert {n for n, _ in ours.named_parameters()} == {n for n, _ in hf.named_parameters()}
    assert sum(p.numel() for p in ours.parameters()) == CONFIG.num_parameters()


@pytest.mark.parametrize("padded", [False, True])
def test_logits_match_transformers(models, padded):
    hf, ours = models
    ids, mask = padded_batch(CONFIG.vocab_size)
    if not padded:
        mask = torch.ones_like(mask)
    with torch.no_grad():
        expected = hf(input_ids=ids, attention_mask=mask).logits
        got = ours(ids, mask)
        got_no_mask = ours(ids)
    real = mask.bool()
    assert expected.abs().max() > 1.0  # the weights make logits that differ in more than rounding
    assert (got[real] - expected[real]).abs().max() < 1e-4
    if not padded:
        assert (got_no_mask - expected).abs().max() < 1e-4


def test_padding_does_not_change_real_positions(models):
    """A left-padded row gives the same logits as the same tokens unpadded (ALiBi counts only real tokens)."""
    _, ours = models
    ids, mask = padded_batch(CONFIG.vocab_size)
    with torch.no_grad():
        padded = ours(ids[2:3], mask[2:3])[0, 5:]
        alone = ours(ids[2:3, 5:])[0]
    assert (padded - alone).abs().max() < 1e-4


def test_loss_and_gradients_match_transformers():
    hf = make_hf(CONFIG, seed=2)
    ours = make_ours(hf)
    ids, mask = padded_batch(CONFIG.vocab_size, seed=3)
    labels = ids.masked_fill(mask == 0, -100)
    # The first real token of the left-padded row would be predicted from a padding position, whose query row is
    # fully masked. transformers adds the mask to the scores, so a gradient leaks through the rounded-away scores of
    # that row; ours masks them out (the true derivative is 0). Leave that prediction out so both are exact.
    labels[2, 5] = -100
    hf_loss = hf(input_ids=ids, attention_mask=mask, labels=labels).loss
    our_loss = ours.loss(ids, labels, mask)
    assert our_loss.dtype == torch.float32
    assert abs(our_loss.item() - hf_loss.item()) < 1e-5
    hf_loss.backward()
    our_loss.backward()
    hf_grads = dict(hf.named_parameters())
    for name, param in ours.named_parameters():
        expected = hf_grads[name].grad
        assert param.grad is not None and expected is not None, name
        scale = expected.abs().max().item()
        assert (param.grad - expected).abs().max().item() <= 1e-4 * max(scale, 1e-2), name


def test_checkpointed_blocks_give_the_same_gradients(models):
    hf, _ = models
    ids, mask = padded_batch(CONFIG.vocab_size)
    labels = ids.masked_fill(mask == 0, -100)
    grads = []
    for flag in (False, True):
        model = make_ours(hf, checkpoint_blocks=flag).train()
        model.loss(ids, labels, mask).backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
    for name, grad in grads[0].items():
        assert torch.allclose(grad, grads[1][name], atol=1e-6), name


def test_bf16_runs_close_to_fp32(models):
    hf, _ = models
    ours = make_ours(hf).to(torch.bfloat16)
    assert ours.lm_head.weight is ours.transformer.word_embeddings.weight
    ids, mask = padded_batch(CONFIG.vocab_size)
    with torch.no_grad():
        reference = make_ours(hf)(ids, mask)
        logits = ours(ids, mask)
    assert logits.dtype == torch.bfloat16
    real = mask.bool()
    # bf16 keeps 8 bits of mantissa; through 3 blocks the logits stay within a few percent of their range.
    assert (logits.float()[real] - reference[real]).abs().max() < 0.05 * reference.abs().max()
    loss = causal_lm_loss(logits, ids.masked_fill(mask == 0, -100))
    assert loss.dtype == torch.float32 and torch.isfinite(loss)


def test_plain_linear_factory_matches_fused_bias_path(models):
    """A factory of plain nn.Linear (bias added inside the linear) computes the same model."""
    hf, ours = models
    roles = []

    def factory(in_features: int, out_features: int, bias: bool, role: str) -> nn.Module:
        roles.append((in_features, out_features, bias, role))
        return nn.Linear(in_features, out_features, bias=bias)

    plain = make_ours(hf, linear_factory=factory)
    h = CONFIG.hidden_size
    assert roles[:4] == [(h, 3 * h, True, "qkv"), (h, h, True, "attn_out"), (h, 4 * h, True, "mlp_in"),
                         (4 * h, h, True, "mlp_out")]  # fmt: skip
    assert len(roles) == 4 * CONFIG.n_layer
    ids, mask = padded_batch(CONFIG.vocab_size)
    with torch.no_grad():
        assert torch.allclose(plain(ids, mask), ours(ids, mask), atol=1e-5)


def test_seeded_init_is_reproducible_and_transformers_like():
    a = BloomForCausalLM(CONFIG, seed=7)
    b = BloomForCausalLM(CONFIG)
    b.init_weights(torch.Generator().manual_seed(7))  # a generator stands for its seed
    for (name, pa), pb in zip(a.state_dict().items(), b.state_dict().values(), strict=True):
        assert torch.equal(pa, pb), name
    block = a.transformer.h[0]
    assert isinstance(block, BloomBlock)
    assert torch.equal(block.self_attention.query_key_value.bias, torch.zeros(3 * CONFIG.hidden_size))
    assert torch.equal(block.input_layernorm.weight, torch.ones(CONFIG.hidden_size))
    std = block.mlp.dense_h_to_4h.weight.std().item()
    assert abs(std - CONFIG.initializer_range) < 0.002


def test_default_factory_rejects_unknown_role():
    with pytest.raises(ValueError, match="unknown linear role"):
        default_linear_factory(4, 4, True, "gate")


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"hidden_size": 100, "n_head": 12}, r"hidden_size\(100\) % n_head\(12\)"),
        ({"n_layer": 0}, "n_layer must be a positive integer"),
        ({"vocab_size": -1, "n_head": 0}, "vocab_size .*; n_head"),
        ({"hidden_dropout": 1.0}, "hidden_dropout"),
    ],
)
def test_config_validation_names_the_factor(kwargs, message):
    base = {"vocab_size": 10, "hidden_size": 96, "n_layer": 2, "n_head": 12}
    with pytest.raises(ValueError, match=message):
        BloomConfig(**(base | kwargs))


def test_config_round_trips_through_transformers():
    hf_config = transformers.BloomConfig(**CONFIG.to_hf_dict())
    assert hf_config.num_attention_heads == 12 and hf_config.tie_word_embeddings
    assert BloomConfig.from_hf_dict(hf_config.to_dict()) == CONFIG
    assert (
        BloomConfig.from_hf_dict({"vocab_size": 10, "n_embed": 8, "num_hidden_layers": 1, "n_head": 2}).hidden_size == 8
    )
    with pytest.raises(ValueError, match="model_type"):
        BloomConfig.from_hf_dict(CONFIG.to_hf_dict() | {"model_type": "gpt2"})
