"""On a machine without a GPU, the whole test session runs Triton kernels in Triton's CPU interpreter.

TRITON_INTERPRET is read when `@triton.jit` decorates a function: our kernels when `kernels.*` is imported, and
Triton's own library (tl.sum, ...) when triton is. torch.compile's machinery imports triton as soon as a module
touches it (kernels/registry.py does), so the first test module collected, in any directory, can import triton
long before tests/kernels/ is reached. Set here, before anything is collected, every import sees it.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"
