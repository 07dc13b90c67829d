"""Context-parallel attention (Ulysses and ring) at cp=2 and cp=4 against single-process attention over the whole
sequence: outputs and dq, dk, dv, fp32 and fp64, with and without packed documents.

One spawn per world size runs every case (spawns are the slow part); the CP group is the whole world (tp = pp = 1).
Each rank builds the full q, k, v and output gradient from one seed, keeps its tokens (split_sequence), runs
context_parallel_attention and backward, and returns its slices; here they go back to global order and meet
ops.attention_core with BLOOM's bias slope * k_pos and the causal (and document) mask on the whole sequence.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from noise_floor import relative_norm

from appliance.model import ops
from appliance.model.alibi import alibi_bias, alibi_slopes
from appliance.parallel.context.attention import context_parallel_attention, sequence_positions, split_sequence
from appliance.parallel.testing import collective_guard, run_distributed
from appliance.parallel.topology import ParallelTopology
from kernels import op_backends

pytestmark = pytest.mark.distributed

BATCH, HEADS, SEQ, HEAD_DIM = 2, 4, 24, 8  # 24 tokens: 3 per zigzag piece at cp=4, heads divisible by 4
MODES = ("ulysses", "ring")
DTYPES = (torch.float32, torch.float64)
CASES = [(mode, dtype, docs) for mode in MODES for dtype in DTYPES for docs in (False, True)]
CASE_IDS = [f"{mode}-{str(dtype)[6:]}-{'docs' if docs else 'one-doc'}" for mode, dtype, docs in CASES]


def full_inputs(dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    """q, k, v, dout [B, H, S, D] and document ids [B, S] of the whole sequence, the same in every process."""
    gen = torch.Generator().manual_seed(21)
    q, k, v, dout = (torch.randn(BATCH, HEADS, SEQ, HEAD_DIM, generator=gen, dtype=torch.float64) for _ in range(4))
    # documents of 5, 11 and 8 tokens in sample 0, one of 24 in sample 1: boundaries inside zigzag pieces
    docs = torch.tensor([[0] * 5 + [1] * 11 + [2] * 8, [0] * SEQ])
    return (*(t.to(dtype) for t in (q, k, v, dout)), docs)


def _run_cases(topology: ParallelTopology, cases: list[tuple[str, torch.dtype, bool]]) -> dict[str, Any]:
    group = dist.group.WORLD  # tp = pp = 1 and dp = world: the whole world is one CP group
    cp, rank = dist.get_world_size(), dist.get_rank()
    guard = collective_guard()
    results: dict[str, Any] = {}
    for mode, dtype, with_docs in cases:
        q, k, v, dout, docs = full_inputs(dtype)
        local = [split_sequence(t, cp, rank, mode, dim=2).requires_grad_() for t in (q, k, v)]
        local_docs = split_sequence(docs, cp, rank, mode, dim=1) if with_docs else None
        before = guard.calls.copy()
        op_backends.reset_call_counts()
        out = context_parallel_attention(
            *local, alibi_slopes(HEADS).to(dtype), HEAD_DIM**-0.5, group=group, mode=mode, seq_len=SEQ,
            doc_ids=local_docs,
        )  # fmt: skip
        out.backward(split_sequence(dout, cp, rank, mode, dim=2))
        traffic = guard.calls - before
        results[f"{mode}-{dtype}-{with_docs}"] = {
            "out": out.detach(), "dq": local[0].grad, "dk": local[1].grad, "dv": local[2].grad,
            "calls": dict(traffic), "kernels": op_backends.call_counts(),
        }  # fmt: skip
    return results


def _launch(cp: int, cases: list[tuple[str, torch.dtype, bool]] = CASES) -> list[dict[str, Any]]:
    return run_distributed(_run_cases, cp, cases, dp=cp, timeout_s=600)


@pytest.fixture(scope="module")
def cp2() -> list[dict[str, Any]]:
    return _launch(2)


@pytest.fixture(scope="module")
def cp4() -> list[dict[str, Any]]:
    return _launch(4)


TRITON_CASES = [case for case in CASES if case[1] == torch.float32]


@pytest.fixture(scope="module")
def cp2_triton() -> Any:
    """cp=2 with the Triton flash kernel (the GPU path) run by Triton's CPU interpreter in the ranks: Ulysses
    calls it on the whole sequence, ring on each chunk pair with offsets, document ids and the LSE."""
    with pytest.MonkeyPatch.context() as env:
        env.setenv("BLOOM_KERNELS", "triton")
        env.setenv("TRITON_INTERPRET", "1")  # read when the ranks import the kernels
        return _launch(2, TRITON_CASES)


def reference(dtype: torch.dtype, with_docs: bool, permute_keys: bool = False) -> dict[str, torch.Tensor]:
    """Single-process attention over the whole sequence: out, dq, dk, dv. permute_keys runs the same attention with
    the keys (and values, bias, mask columns) in reversed order: another summation order of the same math."""
    q, k, v, dout, docs = full_inputs(dtype)
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    positions = torch.arange(SEQ)
    mask = (positions[None, :] <= positions[:, None]).view(1, 1, SEQ, SEQ)
    if with_docs:
        mask = mask & (docs[:, None, :, None] == docs[:, None, None, :])
    alibi = alibi_bias(alibi_slopes(HEADS), None, SEQ)
    order = torch.arange(SEQ - 1, -1, -1) if permute_keys else positions
    out = ops.attention_core(q, k[:, :, order], v[:, :, order], alibi[..., order], mask[..., order], HEAD_DIM**-0.5)
    out.backward(dout)
    return {"out": out.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad}


def global_order(per_rank: list[torch.Tensor], mode: str) -> torch.Tensor:
    """The ranks' token slices [B, H, S/cp, D] put back at their global positions."""
    cp = len(per_rank)
    full = torch.empty(BATCH, HEADS, SEQ, HEAD_DIM, dtype=per_rank[0].dtype)
    for rank, part in enumerate(per_rank):
        full[:, :, sequence_positions(SEQ, cp, rank, mode)] = part
    return full


def fp32_bound(with_docs: bool) -> dict[str, float]:
    """Per quantity, 10 x the noise floor of fp32 attention at this size: the larger of the reference's distance
    to fp64 and its distance to itself with the keys summed in reverse order. Context-parallel attention sums in
    yet another order (chunk by chunk, merged through exp/log of the LSE), so it lands within a few floors of the
    reference; 10 leaves room for CPUs that round differently without letting a wrong bias or mask through (those
    move the result by O(1))."""
    base, exact = reference(torch.float32, with_docs), reference(torch.float64, with_docs)
    reordered = reference(torch.float32, with_docs, permute_keys=True)
    floors = {key: max(relative_norm(base[key], exact[key]), relative_norm(reordered[key], base[key])) for key in base}
    for key, floor in floors.items():
        assert 1e-9 < floor < 1e-5, f"fp32 floor of {key} is {floor:.2e}: not at the level of fp32 rounding"
    return {key: 10 * floor for key, floor in floors.items()}


# fp64: the same math in another order, rounding at 1e-16 relative; 1e-12 is far from any real error.
FP64_BOUND = 1e-12


@pytest.mark.parametrize("cp", [2, 4])
@pytest.mark.parametrize(("mode", "dtype", "with_docs"), CASES, ids=CASE_IDS)
def test_cp_attention_equals_whole_sequence_attention(
    request: pytest.FixtureRequest, cp: int, mode: str, dtype: torch.dtype, with_docs: bool
) -> None:
    ranks = request.getfixturevalue(f"cp{cp}")
    key = f"{mode}-{dtype}-{with_docs}"
    want = reference(dtype, with_docs)
    bounds = fp32_bound(with_docs) if dtype == torch.float32 else dict.fromkeys(want, FP64_BOUND)
    for name in ("out", "dq", "dk", "dv"):
        got = global_order([r[key][name] for r in ranks], mode)
        assert got.dtype == dtype
        assert ranks[0][key]["kernels"].get(("flash_alibi_attention", "triton"), 0) == 0  # the CPU path here
        error = relative_norm(got, want[name])
        assert error <= bounds[name], f"cp={cp} {key} {name}: relative error {error:.3e} > {bounds[name]:.3e}"


@pytest.mark.parametrize(
    ("mode", "with_docs"),
    [(m, d) for m, _, d in TRITON_CASES],
    ids=["ulysses-one-doc", "ulysses-docs", "ring-one-doc", "ring-docs"],
)
def test_cp_attention_on_the_flash_kernel(cp2_triton: list[dict[str, Any]], mode: str, with_docs: bool) -> None:
    key = f"{mode}-{torch.float32}-{with_docs}"
    assert all(r[key]["kernels"].get(("flash_alibi_attention", "triton"), 0) > 0 for r in cp2_triton)
    assert not any(("flash_alibi_attention", "reference") in r[key]["kernels"] for r in cp2_triton)
    want, bounds = reference(torch.float32, with_docs), fp32_bound(with_docs)
    for name in ("out", "dq", "dk", "dv"):
        error = relative_norm(global_order([r[key][name] for r in cp2_triton], mode), want[name])
        assert error <= bounds[name], f"{key} {name}: relative error {error:.3e} > {bounds[name]:.3e}"


@pytest.mark.parametrize("cp", [2, 4])
@pytest.mark.parametrize("dtype", DTYPES, ids=["float32", "float64"])
@pytest.mark.parametrize("with_docs", [False, True], ids=["one-doc", "docs"])
def test_ring_equals_ulysses(request: pytest.FixtureRequest, cp: int, dtype: torch.dtype, with_docs: bool) -> None:
    ranks = request.getfixturevalue(f"cp{cp}")
    bound = max(fp32_bound(with_docs).values()) if dtype == torch.float32 else FP64_BOUND
    for name in ("out", "dq", "dk", "dv"):
        ring = global_order([r[f"ring-{dtype}-{with_docs}"][name] for r in ranks], "ring")
        ulysses = global_order([r[f"ulysses-{dtype}-{with_docs}"][name] for r in ranks], "ulysses")
        assert relative_norm(ring, ulysses) <= bound, name


@pytest.mark.parametrize("cp", [2, 4])
def test_cp_collectives_carry_tensors_on_the_compute_device(request: pytest.FixtureRequest, cp: int) -> None:
    # Every rank's collective guard raised WrongDeviceError for a tensor off the device q lives on (cpu here), so
    # the ranks finishing is the device check; the counts show the guard saw each mode's traffic: Ulysses's
    # all-to-alls (q, k, v, context forward; their gradients backward) and, with documents, the ids' all-gather;
    # ring's batched isend/irecv, cp - 1 hops of k/v forward, again backward, and cp hops of dk/dv.
    for calls in (r[f"{mode}-{dtype}-{docs}"]["calls"] for r in request.getfixturevalue(f"cp{cp}")
                  for mode, dtype, docs in CASES if mode == "ulysses"):  # fmt: skip
        assert calls.get("all_to_all_single") == 8, calls
    for rank in request.getfixturevalue(f"cp{cp}"):
        assert rank[f"ulysses-{torch.float32}-True"]["calls"].get("all_gather") == 1
        for dtype in DTYPES:
            assert rank[f"ring-{dtype}-False"]["calls"].get("batch_isend_irecv") == 3 * cp - 2


def test_sequence_positions() -> None:
    assert sequence_positions(12, 1, 0, "ring").tolist() == list(range(12))
    assert sequence_positions(12, 3, 1, "ulysses").tolist() == [4, 5, 6, 7]
    # ring at cp=3: 6 pieces of 2; rank 1 holds pieces 1 and 4
    assert sequence_positions(12, 3, 1, "ring").tolist() == [2, 3, 8, 9]
    every = torch.cat([sequence_positions(16, 4, r, "ring") for r in range(4)])
    assert sorted(every.tolist()) == list(range(16))
    # zigzag balances causal work: sum over held queries of (position + 1) visible keys is the same on every rank
    work = {int((sequence_positions(16, 4, r, "ring") + 1).sum()) for r in range(4)}
    assert len(work) == 1
    with pytest.raises(ValueError, match=r"seq_len\(12\).*2 \* cp\(4\)"):
        sequence_positions(12, 4, 0, "ring")
    with pytest.raises(ValueError, match=r"seq_len\(10\).*cp\(4\)"):
        sequence_positions(10, 4, 0, "ulysses")
    x = torch.arange(24).view(2, 12)
    assert split_sequence(x, 2, 1, "ring", dim=1).tolist() == [[3, 4, 5, 6, 7, 8], [15, 16, 17, 18, 19, 20]]
