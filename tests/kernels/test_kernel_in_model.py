"""The model swaps in the fused kernels through the registry: with BLOOM_KERNELS=triton, a tiny BLOOM gives the same
logits and gradients as with the reference ops, on the kernel tests' device (a CUDA GPU where there is one, else the
CPU under Triton's interpreter: conftest.py)."""

from __future__ import annotations

import pytest
import torch

from appliance.model.bloom import BloomForCausalLM
from appliance.model.config import BloomConfig


def _run(
    monkeypatch: pytest.MonkeyPatch, backend: str, device: torch.device
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    monkeypatch.setenv("BLOOM_KERNELS", backend)
    torch.manual_seed(0)
    config = BloomConfig(vocab_size=64, hidden_size=24, n_layer=2, n_head=3)  # head dim 8, 3 heads (odd count)
    model = BloomForCausalLM(config)
    model.init_weights(seed=1)
    model.to(device)
    ids = torch.randint(0, 64, (2, 9)).to(device)  # an odd sequence length
    logits = model(ids)
    logits.float().square().mean().backward()
    return logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_fused_path_matches_reference_logits_and_grads(monkeypatch: pytest.MonkeyPatch, device: torch.device) -> None:
    ref_logits, ref_grads = _run(monkeypatch, "reference", device)
    calls: list[str] = []
    import kernels.registry as registry

    original = registry.flash_alibi_attention

    def counting(*args, **kwargs):  # type: ignore[no-untyped-def]
        calls.append("flash")
        return original(*args, **kwargs)

    monkeypatch.setattr(registry, "flash_alibi_attention", counting)
    fused_logits, fused_grads = _run(monkeypatch, "triton", device)
    assert calls == ["flash", "flash"]  # one per layer: the model really took the fused attention
    torch.testing.assert_close(fused_logits, ref_logits, rtol=1e-4, atol=1e-5)
    assert fused_grads.keys() == ref_grads.keys()
    for name, grad in ref_grads.items():
        torch.testing.assert_close(fused_grads[name], grad, rtol=1e-3, atol=1e-5, msg=name)


def test_alibi_bias_is_built_only_for_the_materialized_path_and_shared(
    monkeypatch: pytest.MonkeyPatch, device: torch.device
) -> None:
    """Pass: the flash path never builds the ALiBi bias and mask; the materialized path builds them once per
    length and device, the same tensors for every block (and every step)."""
    from appliance.model.alibi import RankAlibi

    built: list[tuple[torch.Tensor, torch.Tensor]] = []
    original = RankAlibi.bias_and_mask

    def spy(self: RankAlibi, *args: object) -> tuple[torch.Tensor, torch.Tensor]:
        built.append(original(self, *args))  # type: ignore[arg-type]
        return built[-1]

    monkeypatch.setattr(RankAlibi, "bias_and_mask", spy)
    _run(monkeypatch, "triton", device)
    assert built == []
    _run(monkeypatch, "reference", device)
    _run(monkeypatch, "reference", device)
    assert len(built) == 4  # two blocks, two runs
    assert all(bias is built[0][0] and mask is built[0][1] for bias, mask in built)
