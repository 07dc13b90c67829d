"""Which kernel backends exist and which BLOOM_KERNELS asks for: the names (backends, selectable ops, implementation
names, each op's kernel module), the error a bad request raises, and the parsing of the variable (one word for every
op, or op=backend pairs). kernels/registry.py builds its dispatch table from these."""

from __future__ import annotations

import importlib.util
import os
from functools import cache

from kernels.ops import OPS

BACKEND_ENV = "BLOOM_KERNELS"
BACKENDS = ("auto", "triton", "reference")
# The ops whose CUDA backend is chosen by measurement (kernels/selection.py), and every implementation name.
SELECTABLE: tuple[str, ...] = ("layer_norm", "bias_gelu", "flash_alibi_attention", "vocab_cross_entropy")
IMPLEMENTATIONS: tuple[str, ...] = ("reference", "compiled", "triton", "sdpa", "flex")
PEERS = ("sdpa", "flex")  # flash_alibi_attention's peers, kernels/attention_peers.py
# Every op the registry dispatches, and the kernel module that implements it (declared in kernels/ops.py).
KERNEL_MODULES = {name: op.module for name, op in OPS.items()}


class KernelBackendError(RuntimeError):
    """The requested kernel backend cannot run here (message names BLOOM_KERNELS and what is wrong)."""


@cache
def triton_installed() -> bool:
    return importlib.util.find_spec("triton") is not None


def parse(raw: str | None) -> tuple[str, dict[str, str]]:
    """(auto, triton or reference; the per-op backends the value names). Besides the three words, BLOOM_KERNELS may
    name a backend per op, e.g. `layer_norm=reference,flash_alibi_attention=triton`: auto for the ops it leaves out,
    these for CUDA tensors, nothing measured (a run's choice known in advance, or a check with no time to measure)."""
    value = (raw or "auto").strip() or "auto"
    if "=" not in value:
        if value.lower() not in BACKENDS:
            raise KernelBackendError(
                f"{BACKEND_ENV}={value!r} is not one of {', '.join(BACKENDS)}, nor op=backend pairs such as "
                "layer_norm=reference,flash_alibi_attention=triton"
            )
        return value.lower(), {}
    given: dict[str, str] = {}
    for pair in value.split(","):
        op, _, backend = (part.strip() for part in pair.partition("="))
        if op not in SELECTABLE or backend.lower() not in valid_backends(op):
            valid = "; ".join(f"{name}: {', '.join(valid_backends(name))}" for name in SELECTABLE)
            raise KernelBackendError(f"{BACKEND_ENV}: {pair.strip()!r} names no op and backend of ({valid})")
        given[op] = backend.lower()
    return "auto", given


def given() -> dict[str, str]:
    """The per-op backends BLOOM_KERNELS names (see parse), {} when it names none."""
    return parse(os.environ.get(BACKEND_ENV))[1]


def valid_backends(op: str) -> tuple[str, ...]:
    return ("reference", "compiled", "triton", *(PEERS if op == "flash_alibi_attention" else ()))
