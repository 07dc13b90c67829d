"""The noise floor of fp32 training on this CPU, and comparisons stated as multiples of it.

Two layouts of one training do the same arithmetic with the sums in another order (a matmul split over TP ranks,
gradients summed over DP ranks or micro-batches in another order). fp32 rounds each order differently, and ten
steps of AdamW carry that rounding into the weights, by how much depends on the CPU's instruction set and the
BLAS's blocking. So no fixed tolerance holds on every CPU; instead each test measures, on the machine it runs
on, how far the single-process reference moves when only the summation order changes:

    trace, floor = measure_floor(reference_run)   # reference_run(order) -> trace; the base order's is returned

The base order is 1 BLAS thread and micro-batch gradients accumulated first to last (what a rank of
``run_distributed`` does); the other orders reverse the accumulation, cut each micro-batch into one-sample
micro-batches (the sum over samples then happens outside the matmul, as it does across DP ranks), and run on
2 threads. Reversing alone is too gentle a reordering: a sum of two micro-batches is the same either way round, and
the layouts measured 10-20 x further from the reference than it moves. ``floor[key]`` is the largest difference
seen for that quantity of the trace, over those orders. A trace maps a quantity to:

    dict of tensors   whole tensors (weights, moments): the largest per-tensor relative norm ||a - b|| / ||b||;
                      the max-abs is kept under "<key>.max_abs" for reports
    tensor            one output (logits, log-probabilities): relative norm, and max-abs under "<key>.max_abs"
    list of floats    one value per step (losses, grad norms): the largest relative difference
    float             one value (an evaluation sum): its relative difference

Relative norms for whole tensors, because a max-abs over a large tensor picks its noisiest entry, and a fixed
bound on it is what broke: after ten AdamW steps at lr 1e-2 the word embeddings' max-abs moved by 1.3e-5 on one
CPU, past a fixed 1e-5.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

# A difference at the level of fp32 rounding amplified by training is above 1e-9 and far below 1e-3 (the
# relative error of a wrong learning rate by 1% or a lost micro-batch, see the tests that use this module).
PLAUSIBLE_FLOOR = (1e-9, 1e-3)


@dataclass(frozen=True)
class Order:
    """How the reference sums: BLAS threads; micro-batch gradients accumulated last to first; each micro-batch
    run as one-sample micro-batches (the sum over its samples taken outside the matmul, as DP ranks do)."""

    threads: int = 1
    reverse_micro_batches: bool = False
    split_micro_batches: bool = False


BASE = Order()
REORDERED = (Order(1, True, False), Order(1, False, True), Order(2, True, True))


@contextmanager
def pinned_threads(threads: int) -> Iterator[None]:
    """torch's intra-op thread count set for the block and restored after: a reference computed in the pytest
    process must not depend on how many threads that process happens to have."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def relative_norm(got: torch.Tensor, want: torch.Tensor) -> float:
    """||got - want|| / ||want|| in float64 (0 when both are 0)."""
    if got.shape != want.shape:
        raise AssertionError(f"shapes differ: {tuple(got.shape)} != {tuple(want.shape)}")
    a, b = got.detach().double().cpu(), want.detach().double().cpu()
    scale = float(b.norm())
    return float((a - b).norm()) / scale if scale > 0 else float((a - b).norm())


def max_abs(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.detach().double().cpu() - want.detach().double().cpu()).abs().max())


def relative(got: float, want: float) -> float:
    return abs(got - want) / max(abs(want), 1e-30)


def differences(got: Any, want: Any, key: str) -> dict[str, tuple[float, str]]:
    """(largest difference, where) for one quantity of a trace; see the module docstring for the kinds."""
    if isinstance(want, Mapping):
        if got.keys() != want.keys():
            raise AssertionError(f"{key}: tensors differ: {sorted(got.keys() ^ want.keys())}")
        rel = max((relative_norm(got[n], w), n) for n, w in want.items())
        absolute = max((max_abs(got[n], w), n) for n, w in want.items())
        return {key: rel, f"{key}.max_abs": absolute}
    if isinstance(want, torch.Tensor):
        return {key: (relative_norm(got, want), key), f"{key}.max_abs": (max_abs(got, want), key)}
    if isinstance(want, Sequence):
        if len(got) != len(want):
            raise AssertionError(f"{key}: {len(got)} values != {len(want)}")
        return {key: max((relative(g, w), f"{key}[{i}]") for i, (g, w) in enumerate(zip(got, want, strict=True)))}
    return {key: (relative(float(got), float(want)), key)}


@dataclass(frozen=True)
class NoiseFloor:
    """Per quantity, the largest difference between the base order and a reordered run, and where it was."""

    values: dict[str, float]
    where: dict[str, str]

    def __getitem__(self, key: str) -> float:
        return self.values[key]

    def report(self) -> str:
        return ", ".join(f"{k} {v:.3e} ({self.where[k]})" for k, v in sorted(self.values.items()))


def floor_of(base: dict[str, Any], others: Sequence[tuple[str, dict[str, Any]]]) -> NoiseFloor:
    """Per quantity of ``base``, the largest difference of any of the (label, trace) ``others`` from it."""
    values: dict[str, float] = {}
    where: dict[str, str] = {}
    for label, other in others:
        for key, want in base.items():
            for name, (value, at) in differences(other[key], want, key).items():
                if value >= values.get(name, -1.0):
                    values[name], where[name] = value, f"{at}, {label}"
    return NoiseFloor(values, where)


def measure_floor(run: Callable[[Order], dict[str, Any]]) -> tuple[dict[str, Any], NoiseFloor]:
    """Run the reference in the base order and in each reordering; return the base trace and the floor."""
    base = run(BASE)
    return base, floor_of(base, [(str(order), run(order)) for order in REORDERED])


def check_floor(floor: NoiseFloor, keys: Sequence[str]) -> None:
    """The floor is what it should be: nonzero (the reorderings did change the arithmetic, so a bound built on
    it is not 0) and small (the reference does not depend on its summation order beyond rounding)."""
    low, high = PLAUSIBLE_FLOOR
    for key in keys:
        value = floor[key]
        assert low < value < high, f"noise floor of {key} = {value:.3e} is outside [{low:.0e}, {high:.0e}]"


def bound(floor: NoiseFloor, key: str, factor: float) -> float:
    value = factor * floor[key]
    assert math.isfinite(value) and value > 0, f"no usable noise floor for {key}: {floor[key]!r}"
    return value


def assert_within(got: Any, want: Any, key: str, floor: NoiseFloor, factor: float, what: str) -> None:
    """Every difference of quantity ``key`` (see ``differences``) within ``factor`` x its noise floor; the
    message names the tensor or step, the value, the bound and the floor."""
    limit = bound(floor, key, factor)
    value, at = differences(got, want, key)[key]
    assert value <= limit, (
        f"{what}: {at}: difference {value:.3e} > bound {limit:.3e} = {factor:g} x noise floor {floor[key]:.3e} "
        f"({floor.where[key]})"
    )


def assert_outside(got: Any, want: Any, key: str, floor: NoiseFloor, factor: float, what: str) -> float:
    """The bound has teeth: a real bug (``got``) lands beyond ``factor`` x the noise floor. Returns how far,
    as a multiple of the floor."""
    value, at = differences(got, want, key)[key]
    assert value > bound(floor, key, factor), f"{what}: {at}: {value:.3e} is within {factor:g} x {floor[key]:.3e}"
    return value / floor[key]
