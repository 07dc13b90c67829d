"""Every rank runs the kernels rank 0 measured (appliance/parallel/step/kernel_choice.py agree), on two gloo ranks whose
timers disagree; a rank whose key differs stops every rank, naming both."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from appliance.parallel.testing import run_distributed
from appliance.parallel.topology import ParallelTopology

pytestmark = pytest.mark.distributed

CPU = torch.device("cpu")


def _shapes() -> Any:
    from kernels.selection import RankShapes

    return RankShapes(2, 24, 32, 2, 16, 128, 160, "float32", False)


def _registry_for_test() -> None:
    """The registry's use/chosen where this tree's registry lacks them (they arrive with its selection API)."""
    from kernels import registry

    if not hasattr(registry, "use"):
        chosen: dict[str, str] = {}
        registry.use = lambda choices: chosen.update(choices)  # type: ignore[attr-defined]
        registry.chosen = lambda: dict(chosen)  # type: ignore[attr-defined]
        ops = ("layer_norm", "bias_gelu", "flash_alibi_attention", "vocab_cross_entropy")
        registry.SELECTABLE = ops  # type: ignore[attr-defined]


def _twins(op: str, device: torch.device) -> dict[str, Callable[..., Any]]:
    from kernels import reference

    twin = getattr(reference, op)
    return {"reference": twin, "compiled": twin}  # both correct: the timer alone decides


def choose_on_rank(topology: ParallelTopology, cache: str, key_device: str | None) -> dict[str, Any]:
    from appliance.parallel.step import kernel_choice
    from kernels import registry

    _registry_for_test()
    rank = dist.get_rank()
    timed: list[tuple[str, str]] = []

    def timer(op: str, backend: str, step: Callable[[], object]) -> float:
        timed.append((op, backend))
        # rank 0 finds "compiled" faster; rank 1 would find "reference" faster
        return {("compiled", 0): 1.0, ("reference", 0): 2.0, ("compiled", 1): 2.0, ("reference", 1): 1.0}[
            (backend, rank)
        ]

    if key_device is not None and rank == 1:  # this rank sits on another GPU model
        real = kernel_choice.current_key
        kernel_choice.current_key = lambda *a: replace(real(*a), device=key_device)  # type: ignore[assignment]
    try:
        selection = kernel_choice.agree(_shapes(), CPU, cache_file=Path(cache), timer=timer, implementations=_twins)
    except kernel_choice.KernelChoiceError as error:
        return {"error": str(error)}
    return {"choices": selection.choices, "source": selection.source, "timed": timed, "chosen": registry.chosen()}


def test_every_rank_ends_with_rank_0s_choice_and_the_cache_serves_the_next_launch(tmp_path: Path) -> None:
    cache = tmp_path / "kernels.json"
    first = run_distributed(choose_on_rank, 2, str(cache), None, dp=2)
    ops = list(first[0]["choices"])
    assert len(ops) >= 4 and set(first[0]["choices"].values()) == {"compiled"}
    for rank in first:
        assert rank["choices"] == first[0]["choices"] and rank["source"] == "measured"
        assert {op: rank["chosen"][op] for op in ops} == first[0]["choices"]  # installed in the registry
    assert first[0]["timed"] and first[1]["timed"] == []  # rank 1 measured nothing: its timer would disagree
    written = json.loads(cache.read_text())  # one entry per op, each with rank 0's choice
    assert {e["key"]["op"]: e["record"]["choice"] for e in written["entries"]} == first[0]["choices"]

    again = run_distributed(choose_on_rank, 2, str(cache), None, dp=2)
    assert [rank["source"] for rank in again] == ["cache", "cache"]
    assert again[0]["timed"] == [] and again[0]["choices"] == first[0]["choices"]


def test_a_rank_on_another_gpu_stops_every_rank_naming_both(tmp_path: Path) -> None:
    results = run_distributed(choose_on_rank, 2, str(tmp_path / "kernels.json"), "NVIDIA A100-SXM4-80GB", dp=2)
    for rank in results:
        assert rank["error"].startswith("kernel selection: ranks differ from rank 0")
        assert "rank 1 vs rank 0: device: 'NVIDIA A100-SXM4-80GB' vs 'cpu'" in rank["error"]
