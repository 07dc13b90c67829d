"""Each op's signature is declared once (kernels/ops.py); the registry's switch, the torch twin and the Triton
launcher all have exactly that signature, so a call the registry routes means the same thing to every backend."""

from __future__ import annotations

import importlib
import inspect

import pytest
import torch

from kernels import backend_env, reference, registry
from kernels.ops import OPS, Op


def implementations(name: str, op: Op) -> dict[str, object]:
    return {
        "kernels/registry.py": getattr(registry, name),
        "kernels/reference.py": getattr(reference, name),
        f"kernels/{op.module}.py": getattr(importlib.import_module(f"kernels.{op.module}"), name),
    }


@pytest.mark.parametrize("name", sorted(OPS))
def test_registry_twin_and_kernel_have_the_declared_signature(name: str) -> None:
    declared = OPS[name].signature()
    for where, function in implementations(name, OPS[name]).items():
        assert inspect.signature(function) == declared, f"{where}: {name}{inspect.signature(function)} != {declared}"


def test_the_registry_dispatches_exactly_the_declared_ops() -> None:
    assert {name: op.module for name, op in OPS.items()} == backend_env.KERNEL_MODULES
    assert set(OPS) <= set(registry.__all__)


def test_a_changed_default_breaks_the_comparison() -> None:
    """Control: the comparison sees a default, an annotation and a keyword-only marker."""
    declared = OPS["layer_norm"].signature()

    def other_default(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
        raise NotImplementedError

    def other_annotation(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: int = 1) -> torch.Tensor:
        raise NotImplementedError

    def keyword_only(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, *, eps: float = 1e-5) -> torch.Tensor:
        raise NotImplementedError

    for function in (other_default, other_annotation, keyword_only):
        assert inspect.signature(function) != declared
