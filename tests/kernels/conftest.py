"""Kernel tests run the Triton kernels through Triton's CPU interpreter when there is no GPU.

TRITON_INTERPRET is read when `@triton.jit` decorates a kernel, so tests/conftest.py sets it before any test module
is collected. With a GPU the kernels compile for it and the same tests run on CUDA tensors.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

ON_GPU = torch.cuda.is_available()
if not ON_GPU:
    # tests/conftest.py set it before any test module was collected; reloading kernel modules built without it
    # would not do (Triton's own library functions keep the mode triton was imported in).
    assert os.environ.get("TRITON_INTERPRET") == "1", "tests/conftest.py sets TRITON_INTERPRET=1 on CPU machines"

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

# (atol, rtol) against the fp32 reference run on the same (rounded) inputs. bf16 keeps 8 mantissa bits, so one
# rounding of the output is already ~0.4% relative; accumulated products in bf16 dots need a little more.
TOLERANCE = {torch.float32: (2e-5, 2e-5), torch.bfloat16: (3e-2, 3e-2)}


@pytest.fixture
def device() -> torch.device:
    return torch.device("cuda" if ON_GPU else "cpu")


@pytest.fixture
def triton_backend(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("BLOOM_KERNELS", "triton")


@pytest.fixture
def assert_matches() -> Callable[..., None]:
    """assert_matches(actual, expected_fp32, dtype, scale=1.0): closeness with the tolerance of `dtype`.

    `scale` widens the tolerance for quantities that sum many rounded terms (weight gradients, attention grads).
    """

    def check(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype, scale: float = 1.0) -> None:
        atol, rtol = TOLERANCE[dtype]
        assert actual.dtype == dtype or actual.dtype == torch.float32, actual.dtype
        assert torch.isfinite(actual).all()
        torch.testing.assert_close(actual.float().cpu(), expected.float().cpu(), atol=atol * scale, rtol=rtol * scale)

    return check
