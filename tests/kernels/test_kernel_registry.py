"""Backend selection: BLOOM_KERNELS override, per-device dispatch, apex opt-in."""

from __future__ import annotations

import pytest
import torch

from kernels import registry


def test_auto_picks_reference_for_cpu_tensors(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(registry.BACKEND_ENV, raising=False)
    assert registry.get_backend(torch.zeros(1)) == "reference"
    assert registry.get_backend("cpu") == "reference"
    assert registry.get_backend(torch.device("cuda", 0)) == "triton"
    assert registry.get_backend() == ("triton" if torch.cuda.is_available() else "reference")


@pytest.mark.parametrize("value", ["triton", "reference", " Triton "])
def test_env_forces_backend(monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    monkeypatch.setenv(registry.BACKEND_ENV, value)
    expected = value.strip().lower()
    assert registry.get_backend(torch.zeros(1)) == expected
    assert registry.get_backend(torch.device("cuda")) == expected


def test_bad_env_value_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(registry.BACKEND_ENV, "cuda")
    with pytest.raises(registry.KernelBackendError, match="BLOOM_KERNELS='cuda'"):
        registry.get_backend(torch.zeros(1))


def _grad_fn_names(monkeypatch: pytest.MonkeyPatch, backend: str, device: torch.device) -> list[str]:
    """Which autograd node each registry op produced under `backend`."""
    monkeypatch.setenv(registry.BACKEND_ENV, backend)
    x = torch.randn(2, 3, 8, device=device, requires_grad=True)
    w, b = torch.ones(8, device=device), torch.zeros(8, device=device)
    slopes = registry.alibi_slopes(2, device)
    q = torch.randn(1, 2, 3, 8, device=device, requires_grad=True)
    outs = [
        registry.layer_norm(x, w, b, 1e-5),
        registry.bias_gelu(x, b),
        registry.alibi_softmax(q @ q.transpose(-1, -2), slopes, None, 0.5),
        registry.flash_alibi_attention(q, q, q, slopes),
        registry.vocab_cross_entropy(
            x, torch.randn(5, 8, device=device), torch.tensor([[0, 1, 2], [3, 4, 0]], device=device)
        ),
    ]
    return [type(out.grad_fn).__name__ for out in outs]


def test_dispatch_reaches_each_backend(monkeypatch: pytest.MonkeyPatch, device: torch.device) -> None:
    fused = _grad_fn_names(monkeypatch, "triton", device)
    assert fused[:4] == [
        "LayerNormFunctionBackward",
        "BiasGeluFunctionBackward",
        "AlibiSoftmaxFunctionBackward",
        "FlashAlibiAttentionFunctionBackward",
    ]
    plain = _grad_fn_names(monkeypatch, "reference", device)
    assert not any(name in fused[:4] for name in plain[:4])  # plain torch autograd nodes


def test_triton_on_cpu_without_interpreter_is_explained(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(registry.BACKEND_ENV, "triton")
    monkeypatch.setattr(registry, "_interpreting", lambda: False)
    with pytest.raises(registry.KernelBackendError, match="TRITON_INTERPRET=1"):
        registry.bias_gelu(torch.zeros(2, 4), torch.zeros(4))


def test_apex_layer_norm_is_opt_in_and_cuda_only(monkeypatch: pytest.MonkeyPatch, device: torch.device) -> None:
    monkeypatch.setattr(registry, "_apex_requested", False)
    # NVIDIA apex is not installed here (and the index's unrelated `apex` has no apex.normalization either)
    if registry.nvidia_apex_layer_norm() is None:
        assert registry.use_apex_layer_norm(True) is False
    if device.type == "cpu":  # asked for by env, apex is still never looked up for CPU tensors
        monkeypatch.setenv(registry.APEX_ENV, "1")
        monkeypatch.setenv(registry.BACKEND_ENV, "triton")
        monkeypatch.setattr(registry, "nvidia_apex_layer_norm", lambda: pytest.fail("apex looked up for CPU"))
        y = registry.layer_norm(torch.randn(2, 4, requires_grad=True), torch.ones(4), torch.zeros(4))
        assert type(y.grad_fn).__name__ == "LayerNormFunctionBackward"


def test_call_counts_name_each_op_and_the_backend_that_ran_it(
    monkeypatch: pytest.MonkeyPatch, device: torch.device
) -> None:
    registry.reset_call_counts()
    _grad_fn_names(monkeypatch, "reference", device)
    _grad_fn_names(monkeypatch, "triton", device)
    ops = ("layer_norm", "bias_gelu", "alibi_softmax", "flash_alibi_attention", "vocab_cross_entropy")
    assert registry.call_counts() == {(op, backend): 1 for op in ops for backend in ("reference", "triton")}
    registry.reset_call_counts()
    assert registry.call_counts() == {}
