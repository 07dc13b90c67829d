"""2D tensor parallelism (tp2d = 2: a 2 x 2 mesh of 4 gloo ranks) trains like one process.

One launch; each rank builds the single-process BloomForCausalLM from the same seed, its own Bloom2D with its
blocks of those weights (parallel/bloom2d.py), and trains both a few steps on the same micro-batches:

* float64, a probe objective sum(logits * probe) through the tied head (every layer, the embedding lookup and the
  head's product included; the vocabulary-parallel cross-entropy computes in float32 by design, so it is left out
  here): per-step objective, every parameter's gradient and every weight after SGD steps, gathered from the mesh,
  within 1e-12 relative of the single process. fp64 rounds at 1e-16; the 2D run sums the same products in another
  order (SUMMA's q partial products, the LayerNorm's statistics in q pieces), measured ~1e-15; a lost or doubled
  contribution is O(1).
* float32, the real loss (the one vocabulary-parallel cross-entropy over the mesh row) and AdamW: losses, gradients
  and weights within FP32_FACTOR x the noise floor, the single-process fp32 run against the same run in float64
  (fp32's own rounding at these sizes, measured in the rank; tests/distributed/noise_floor.py's check_floor keeps it
  plausible).

The same launch also checks the checkpoint reshard 2D -> one process -> 1D (tp = 2) -> one process on the trained
weights, that each 2D block is the sharding.py cut of the gathered weights, and that the bound has teeth (a block
product that forgets SUMMA's reduction lands far outside).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from noise_floor import NoiseFloor, check_floor, relative_norm

from appliance.model import ops
from appliance.model.bloom import BloomForCausalLM
from appliance.model.config import BloomConfig
from appliance.parallel.bloom2d import Bloom2D, build_tp2d_model
from appliance.parallel.sharding import (
    gather_state_dicts,
    gather_state_dicts_2d,
    shard_from_full_2d,
    shard_state_dict,
)
from appliance.parallel.summa import gather_partial_grad
from appliance.parallel.testing import collective_guard, run_distributed
from appliance.parallel.topology import ParallelTopology

pytestmark = pytest.mark.distributed

CONFIG = BloomConfig(vocab_size=32, hidden_size=16, n_layer=2, n_head=4)
Q, BATCH, SEQ, STEPS, SEED = 2, 4, 8, 3, 11
FP64_BOUND = 1e-12  # see the module docstring: measured ~1e-15
# A 2D result and the single-process one are two fp32 evaluations of the same value in another summation order, each
# within about fp32's rounding (the floor) of the float64 value; measured up to ~2 x the floor, 10 x leaves room.
FP32_FACTOR = 10.0
TEETH = 10.0


def _batches(dtype: torch.dtype) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(ids [BATCH, SEQ], probe over the logits [BATCH, SEQ, vocab]) per step, the same on every rank."""
    g = torch.Generator().manual_seed(SEED)
    return [
        (torch.randint(0, CONFIG.vocab_size, (BATCH, SEQ), generator=g),
         torch.randn(BATCH, SEQ, CONFIG.vocab_size, generator=g, dtype=torch.float64).to(dtype))
        for _ in range(STEPS)
    ]  # fmt: skip


def _fp64_layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float) -> torch.Tensor:
    # ops.layer_norm keeps float32 statistics by design (so float64 input would round to fp32); the float64 proof
    # needs the same LayerNorm in the input's dtype, as LayerNorm2D computes it.
    return F.layer_norm(x, (x.shape[-1],), weight, bias, eps)


def _reference(dtype: torch.dtype, objective: str) -> tuple[BloomForCausalLM, dict[str, Any]]:
    """The single-process model trained STEPS steps; its initial state, per-step values, first gradients, weights."""
    model = BloomForCausalLM(CONFIG, seed=SEED).to(dtype)
    initial = {k: v.detach().clone() for k, v in model.state_dict().items()}
    trace = _train(model, objective, lambda ids, probe: _reference_value(model, ids, probe, objective))
    return model, {"initial": initial, **trace}


def _reference_value(model: BloomForCausalLM, ids: torch.Tensor, probe: torch.Tensor, objective: str) -> torch.Tensor:
    if objective == "loss":
        return model.loss(ids, ids)
    hidden = model.final_hidden(ids)
    return (F.linear(hidden, model.lm_head.weight) * probe).sum()


def _train(
    model: torch.nn.Module, objective: str, value: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
) -> dict[str, Any]:
    """STEPS steps (SGD for the probe, AdamW for the loss); values per step, first gradients, final weights."""
    params = dict(model.named_parameters())
    optimizer: torch.optim.Optimizer = (
        torch.optim.AdamW(params.values(), lr=1e-2, weight_decay=0.1)
        if objective == "loss"
        else torch.optim.SGD(params.values(), lr=1e-3)
    )
    dtype = next(iter(params.values())).dtype
    values, grads = [], {}
    for step, (ids, probe) in enumerate(_batches(dtype)):
        optimizer.zero_grad()
        out = value(ids, probe)
        out.backward()
        values.append(out.detach())
        if step == 0:
            grads = {n: p.grad.detach().clone() for n, p in params.items() if p.grad is not None}
        optimizer.step()
    return {"values": values, "grads": grads, "weights": {n: p.detach().clone() for n, p in params.items()}}


def _value_2d(model: Bloom2D, ids: torch.Tensor, probe: torch.Tensor, objective: str) -> torch.Tensor:
    """This rank's part of the objective: the mesh row's loss share, or its probe over its logits block."""
    if objective == "loss":
        return model.loss(ids, ids)
    mesh = model.mesh
    # The row's hidden slices gathered; each column's logits give a partial gradient of them, summed back over the
    # row by the gather's backward (the loss path's cross-entropy sums it over the row itself: Embedding2D.head_input).
    hidden = gather_partial_grad(model.final_hidden(ids), -1, mesh.row_group)
    logits = F.linear(hidden, model.transformer.word_embeddings.vocab_slice())  # [b/q, s, vocab/q]
    probe_block = mesh.batch_slice(probe).chunk(mesh.q, dim=-1)[mesh.col]
    return (logits * probe_block).sum()


def _mesh_all(value: Any, topology: ParallelTopology) -> list[Any]:
    out: list[Any] = [None] * dist.get_world_size(topology.tp_group)
    dist.all_gather_object(out, value, group=topology.tp_group)
    return out


def _run_2d(topology: ParallelTopology, dtype: torch.dtype, objective: str, initial: dict[str, torch.Tensor]) -> dict:
    model = build_tp2d_model(CONFIG, topology, initial, dtype)
    cut_ok = all(
        torch.equal(p, shard_from_full_2d(initial[n], model.mesh.row, model.mesh.col, Q))
        for n, p in model.named_parameters()
    )
    trace = _train(model, objective, lambda ids, probe: _value_2d(model, ids, probe, objective))
    # Per step, the whole objective: the probe's blocks sum over the mesh, the loss's row shares over the column.
    group = topology.tp_group if objective == "probe" else topology.tp_col_group
    totals = []
    for v in trace["values"]:
        total = v.detach().clone()
        dist.all_reduce(total, group=group)
        totals.append(total)
    grads = gather_state_dicts_2d(_mesh_all(trace["grads"], topology), Q)
    weights = gather_state_dicts_2d(_mesh_all(trace["weights"], topology), Q)
    return {"values": totals, "grads": grads, "weights": weights, "cut_ok": cut_ok}


def _largest(got: dict[str, Any], want: dict[str, Any]) -> dict[str, tuple[float, str]]:
    """Per quantity, the largest relative difference and where."""
    out = {"values": max((relative_norm(g, w), f"step {i}") for i, (g, w) in
                         enumerate(zip(got["values"], want["values"], strict=True)))}  # fmt: skip
    for key in ("grads", "weights"):
        if got[key].keys() != want[key].keys():
            raise AssertionError(f"{key}: names differ: {sorted(got[key].keys() ^ want[key].keys())}")
        out[key] = max((relative_norm(got[key][n], w), n) for n, w in want[key].items())
    return out


def _without_summa_reduction(topology: ParallelTopology, initial: dict[str, torch.Tensor]) -> float:
    """The bound's teeth: the probe's first gradients when the weight gradient skips the column reduction (each
    rank keeps its own row's partial), against the single process; must land beyond TEETH x the bound."""
    from appliance.parallel import summa

    original = summa._reduce

    def row_only(tensor: torch.Tensor, root: int, group: Any) -> torch.Tensor:
        return tensor if group is topology.tp_col_group else original(tensor, root, group)

    summa._reduce = row_only
    try:
        got = _run_2d(topology, torch.float64, "probe", initial)
    finally:
        summa._reduce = original
    return got


def _check(topology: ParallelTopology) -> dict[str, Any]:
    """Everything, on each rank of the 2 x 2 mesh."""
    out: dict[str, Any] = {"groups": (dist.get_process_group_ranks(topology.tp_row_group),
                                      dist.get_process_group_ranks(topology.tp_col_group))}  # fmt: skip
    original_norm = ops.layer_norm
    ops.layer_norm = _fp64_layer_norm  # type: ignore[assignment]
    try:
        _, exact = _reference(torch.float64, "probe")
        _, exact_loss = _reference(torch.float64, "loss")
    finally:
        ops.layer_norm = original_norm  # type: ignore[assignment]
    got64 = _run_2d(topology, torch.float64, "probe", exact["initial"])
    out["fp64"] = _largest(got64, exact)
    out["cut_ok"] = got64["cut_ok"]

    _, want32 = _reference(torch.float32, "loss")
    got32 = _run_2d(topology, torch.float32, "loss", want32["initial"])
    floor = _largest(want32, exact_loss)
    # The loss comes out of the cross-entropy in float32 at every input precision, so the float64 run's loss often
    # rounds to the same float32 value (measured floor 0): two summation orders are at least one rounding of the
    # result apart, float32's epsilon.
    floor["values"] = max(floor["values"], (torch.finfo(torch.float32).eps, "float32 rounding of the loss"))
    out["fp32"], out["floor"], out["cut_ok"] = _largest(got32, want32), floor, out["cut_ok"] and got32["cut_ok"]

    # Reshard the trained 2D weights: gathered -> 1D tp = 2 shards -> one process, and back onto the mesh.
    trained = got32["weights"]
    one_d = [shard_state_dict(trained, rank, 2) for rank in range(2)]
    out["reshard_1d_exact"] = all(torch.equal(v, trained[k]) for k, v in gather_state_dicts(one_d).items())
    mesh_again = [
        {k: shard_from_full_2d(v, r, c, Q) for k, v in gather_state_dicts(one_d).items()}
        for r in range(Q) for c in range(Q)
    ]  # fmt: skip
    out["reshard_2d_exact"] = all(torch.equal(v, trained[k]) for k, v in gather_state_dicts_2d(mesh_again, Q).items())

    broken = _without_summa_reduction(topology, exact["initial"])
    out["broken"] = _largest(broken, exact)
    out["calls"] = dict(collective_guard().calls)
    return out


@pytest.fixture(scope="module")
def results() -> list[dict[str, Any]]:
    return run_distributed(_check, Q * Q, tp=Q * Q, tp2d=Q, timeout_s=600)


def test_mesh_groups_are_rows_and_columns(results: list[dict[str, Any]]) -> None:
    assert [r["groups"] for r in results] == [([0, 1], [0, 2]), ([0, 1], [1, 3]), ([2, 3], [0, 2]), ([2, 3], [1, 3])]
    assert results[0]["calls"].get("broadcast", 0) > 0 and results[0]["calls"].get("reduce", 0) > 0


def test_blocks_are_the_sharding_cut(results: list[dict[str, Any]]) -> None:
    assert all(r["cut_ok"] for r in results)


@pytest.mark.parametrize("quantity", ["values", "grads", "weights"])
def test_fp64_equals_one_process(results: list[dict[str, Any]], quantity: str) -> None:
    for rank, r in enumerate(results):
        value, where = r["fp64"][quantity]
        assert value <= FP64_BOUND, f"rank {rank}: fp64 {quantity} at {where}: {value:.3e} > {FP64_BOUND:.0e}"


@pytest.mark.parametrize("quantity", ["values", "grads", "weights"])
def test_fp32_within_noise_floor(results: list[dict[str, Any]], quantity: str) -> None:
    for rank, r in enumerate(results):
        floor = NoiseFloor({quantity: r["floor"][quantity][0]}, {quantity: r["floor"][quantity][1]})
        check_floor(floor, [quantity])
        value, where = r["fp32"][quantity]
        limit = FP32_FACTOR * floor[quantity]
        assert value <= limit, f"rank {rank}: fp32 {quantity} at {where}: {value:.3e} > {limit:.3e} ({floor.report()})"


def test_bound_has_teeth(results: list[dict[str, Any]]) -> None:
    value, where = results[0]["broken"]["grads"]
    assert value > TEETH * FP64_BOUND, f"a SUMMA without its column reduction stayed within the bound at {where}"


def test_checkpoint_reshards_between_2d_1d_and_one_process(results: list[dict[str, Any]]) -> None:
    assert all(r["reshard_1d_exact"] and r["reshard_2d_exact"] for r in results)
