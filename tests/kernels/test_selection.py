"""The measured kernel selection (kernels/selection.py): correctness first, then the fastest, with a fake timer."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from dataclasses import replace
from typing import Any

import pytest
import torch

from kernels import attention_peers, backend_env, flash_attention, op_backends, reference, registry
from kernels import selection as sel
from kernels.launch import H100, recording

CPU = torch.device("cpu")
# 2 x 40 tokens, hidden 64, 4 heads of 16, MLP 256, 300 vocabulary rows: every op at once in about a second
SHAPES = sel.RankShapes(
    micro_batch_size=2, seq_len=40, hidden=64, heads=4, head_dim=16, ffn=256, vocab=300, dtype="bfloat16",
    documents=False,
)  # fmt: skip


def fake_timer(ms: dict[tuple[str, str], float], calls: list[tuple[str, str]] | None = None) -> sel.Timer:
    """Reports the given milliseconds for (op, backend) after running the step once (so a step that raises, raises)."""

    def timer(op: str, backend: str, step: Callable[[], object]) -> float:
        step()
        if calls is not None:
            calls.append((op, backend))
        return ms[(op, backend)]

    return timer


def _raises(*args: Any, **kwargs: Any) -> torch.Tensor:
    raise RuntimeError("no kernel image is available for execution on the device")


def test_fastest_correct_candidate_wins_and_wrong_ones_are_rejected_with_reasons() -> None:
    def offered(op: str, device: torch.device) -> dict[str, Callable[..., Any]]:
        twin = getattr(reference, op)
        if op == "layer_norm":
            return {"reference": twin, "compiled": twin, "triton": lambda x, w, b, eps: twin(x, w, b, eps) * 1.1}
        if op == "flash_alibi_attention":  # a kernel that forgot the causal mask, and one that cannot run
            return {
                "reference": twin, "triton": _raises,
                "sdpa": lambda q, k, v, slopes, causal, scale, **docs: twin(q, k, v, slopes, False, scale),
            }  # fmt: skip
        return {"reference": twin}

    calls: list[tuple[str, str]] = []
    ms = {
        ("layer_norm", "reference"): 3.0, ("layer_norm", "compiled"): 1.0, ("layer_norm", "triton"): 0.1,
        ("flash_alibi_attention", "reference"): 9.0, ("flash_alibi_attention", "triton"): 0.1,
        ("flash_alibi_attention", "sdpa"): 0.1,
    }  # fmt: skip
    picked = sel.select(
        SHAPES, CPU, project_version="0.1.0", timer=fake_timer(ms, calls), implementations=offered,
        ops=("layer_norm", "flash_alibi_attention"),
    )  # fmt: skip
    # the fastest of those that match the fp32 twin: the faster wrong or failing ones are never timed
    assert picked.choices == {"layer_norm": "compiled", "flash_alibi_attention": "reference"}
    assert picked.times_ms == {
        "layer_norm": {"reference": 3.0, "compiled": 1.0}, "flash_alibi_attention": {"reference": 9.0},
    }  # fmt: skip
    assert ("layer_norm", "triton") not in calls and ("flash_alibi_attention", "sdpa") not in calls
    assert picked.rejected["layer_norm"]["triton"].startswith("output off by")
    assert picked.rejected["flash_alibi_attention"]["sdpa"].startswith("output off by")  # the missing causal mask
    assert picked.rejected["flash_alibi_attention"]["triton"] == (
        "RuntimeError: no kernel image is available for execution on the device"
    )
    assert "layer_norm: compiled 1 ms (then reference 3); rejected triton" in picked.summary()


def test_a_candidate_that_fails_while_timed_is_rejected_and_the_rest_still_compete() -> None:
    def timer(op: str, backend: str, step: Callable[[], object]) -> float:
        if backend == "compiled":
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return 2.0

    offered = {"reference": reference.bias_gelu, "compiled": reference.bias_gelu}
    picked = sel.select(
        SHAPES, CPU, project_version="0.1.0", timer=timer, implementations=lambda op, d: offered, ops=("bias_gelu",)
    )
    assert picked.choices == {"bias_gelu": "reference"}
    reason = "OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB"
    assert picked.rejected == {"bias_gelu": {"compiled": reason}}


def test_inputs_are_what_a_rank_of_the_run_feeds_each_op() -> None:
    shapes = replace(SHAPES, documents=True)
    attention = sel.op_case("flash_alibi_attention", shapes, CPU)
    (qkv,) = attention.leaves
    assert qkv.shape == (2, 40, 4, 3, 16) and qkv.dtype == torch.bfloat16  # the fused QKV projection's layout
    seen: dict[str, Any] = {}

    def spy(q, k, v, slopes, causal, scale, *, q_doc, k_doc):
        seen.update(q=q, slopes=slopes, q_doc=q_doc, k_doc=k_doc)
        return reference.flash_alibi_attention(q, k, v, slopes, causal, scale, q_doc=q_doc, k_doc=k_doc)

    attention.run(spy)
    assert seen["q"].shape == (2, 4, 40, 16) and not seen["q"].is_contiguous()
    assert seen["q_doc"] is seen["k_doc"] and seen["q_doc"][0].unique().tolist() == [0, 1, 2, 3]
    assert torch.equal(seen["slopes"], reference.alibi_slopes(4))
    loss = sel.op_case("vocab_cross_entropy", SHAPES, CPU)
    hidden, weight = loss.leaves
    assert hidden.shape == (2, 40, 64) and weight.shape == (300, 64) and loss.grad_out is None
    assert [t.shape for t in sel.op_case("layer_norm", SHAPES, CPU).leaves] == [(2, 40, 64), (64,), (64,)]
    assert [t.shape for t in sel.op_case("bias_gelu", SHAPES, CPU).leaves] == [(2, 40, 256), (256,)]


def _selection() -> sel.Selection:
    key = sel.SelectionKey("NVIDIA H100 80GB HBM3", "9.0", "2.11.0+cu130", "3.6.0", "0.1.0", SHAPES)
    return sel.Selection(
        key=key,
        choices={"layer_norm": "compiled"},
        times_ms={"layer_norm": {"compiled": 0.25, "triton": 0.75}},
        rejected={"flash_alibi_attention": {"flex": "RuntimeError: x"}},
        flash_tiles={"chosen": vars(flash_attention.launch_config(16, torch.bfloat16, 90)), "times_ms": {}},
    )


def test_selection_round_trips_through_json_and_refuses_unknown_or_missing_keys() -> None:
    picked = _selection()
    again = sel.Selection.from_json(json.loads(json.dumps(picked.to_json())))
    assert again == picked
    data = picked.to_json()
    del data["key"]["shapes"]["vocab"]
    with pytest.raises(ValueError, match=r"selection.key.shapes: missing keys \['vocab'\]"):
        sel.Selection.from_json(data)
    with pytest.raises(ValueError, match=r"selection: missing keys \[\], unknown keys \['extra'\]"):
        sel.Selection.from_json(picked.to_json() | {"extra": 1})


def test_key_differences_name_every_field_that_changed() -> None:
    key = _selection().key
    other = replace(key, device="NVIDIA H200", torch="2.12.0", shapes=replace(SHAPES, seq_len=4096, documents=True))
    assert key.differences(key) == []
    assert key.differences(other) == [
        "device: 'NVIDIA H100 80GB HBM3' vs 'NVIDIA H200'",
        "torch: '2.11.0+cu130' vs '2.12.0'",
        "shapes.seq_len: 40 vs 4096",
        "shapes.documents: False vs True",
    ]


@pytest.fixture
def clean_tiles() -> Iterator[None]:
    flash_attention.TUNED_TILES.clear()
    yield
    flash_attention.TUNED_TILES.clear()


def _launched_tiles(seq: int, head_dim: int = 16) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages) of the forward the launcher starts on an H100 at this shape."""
    q = torch.empty(2, 4, seq, head_dim, dtype=torch.bfloat16, device="meta")
    with recording(H100) as launches:
        flash_attention.flash_fwd(q, q, q, torch.empty(4, device="meta"), True, 0.25)
    (launch,) = launches
    return tuple(launch.options[name] for name in ("BLOCK_M", "BLOCK_N", "num_warps", "num_stages"))


def test_fastest_tiles_are_installed_for_the_run_shape_only(clean_tiles: None) -> None:
    key = _selection().key  # an H100 (capability 9.0) at SHAPES: head dim 16, 40 tokens, bf16
    candidates = flash_attention.tile_candidates(16, torch.bfloat16, 90)
    assert len(candidates) >= 4 and candidates[0] == flash_attention.launch_config(16, torch.bfloat16, 90)
    fastest = candidates[2]
    case = sel.op_case("flash_alibi_attention", SHAPES, CPU)
    tiles_seen = []

    def attention(*args: Any, **kwargs: Any) -> torch.Tensor:  # the twin, noting the tiles a launch would take
        tiles_seen.append(flash_attention.tiles(16, torch.bfloat16, 90, False, 40, 40))
        return reference.flash_alibi_attention(*args, **kwargs)

    def timer(op: str, backend: str, step: Callable[[], object]) -> float:
        step()
        return 1.0 if tiles_seen[-1] == fastest else 2.0

    record = sel.tune_flash_tiles(case, attention, case.expected(), key, timer)
    assert set(tiles_seen) == set(candidates)  # each candidate checked and timed with its own tiles
    assert record["chosen"] == vars(fastest) and len(record["times_ms"]) == len(candidates)
    assert min(record["times_ms"], key=record["times_ms"].get) == sel.tile_label(fastest)
    assert _launched_tiles(40) == (fastest.fwd_m, fastest.fwd_n, fastest.warps, fastest.stages)
    default = candidates[0]
    assert _launched_tiles(41) == (default.fwd_m, default.fwd_n, default.warps, default.stages)  # another shape

    # Another rank installs the same tiles from the selection it receives.
    flash_attention.TUNED_TILES.clear()
    picked = replace(_selection(), choices={}, flash_tiles=record)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(registry, "use", lambda choices: None, raising=False)
        sel.Selection.from_json(json.loads(json.dumps(picked.to_json()))).apply()
    assert _launched_tiles(40) == (fastest.fwd_m, fastest.fwd_n, fastest.warps, fastest.stages)


def test_tiles_that_fail_leave_the_launchers_default(clean_tiles: None) -> None:
    case = sel.op_case("flash_alibi_attention", SHAPES, CPU)
    record = sel.tune_flash_tiles(case, _raises, case.expected(), _selection().key, fake_timer({}))
    assert record["times_ms"] == {} and len(record["rejected"]) >= 4
    assert flash_attention.TUNED_TILES == {}


# ----- through the registry's own candidates -----------------------------------------------------------------------
@pytest.fixture
def registry_api(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """backend_env.SELECTABLE, op_backends.implementations, registry.use: the kernels' own (branch compile-ops);
    while this tree lacks them, a minimal stand-in with the same contract for the candidates the CPU
    offers (reference, triton in the interpreter, the attention peers)."""
    if not hasattr(op_backends, "implementations"):
        from kernels import bias_gelu, cross_entropy, layer_norm

        triton = {
            "layer_norm": layer_norm.layer_norm, "bias_gelu": bias_gelu.bias_gelu,
            "flash_alibi_attention": flash_attention.flash_alibi_attention,
            "vocab_cross_entropy": cross_entropy.vocab_cross_entropy,
        }  # fmt: skip

        def implementations(op: str, device: torch.device) -> dict[str, Callable[..., Any]]:
            found = {"reference": getattr(reference, op)}
            if torch.device(device).type == "cuda" or not torch.cuda.is_available():  # CPU: the interpreter only
                found["triton"] = triton[op]
            if op == "flash_alibi_attention":
                for name in ("sdpa", "flex"):
                    peer = getattr(attention_peers, f"{name}_alibi_attention")
                    found[name] = lambda q, k, v, s, c=True, sc=None, *, q_doc=None, k_doc=None, peer=peer: peer(
                        q, k, v, s, c, sc, q_doc=q_doc, k_doc=k_doc
                    )
            return found

        chosen: dict[str, str] = {}
        monkeypatch.setattr(backend_env, "SELECTABLE", tuple(triton), raising=False)
        monkeypatch.setattr(op_backends, "implementations", implementations, raising=False)
        monkeypatch.setattr(registry, "use", lambda choices: chosen.update(choices), raising=False)
        monkeypatch.setattr(registry, "chosen", lambda: dict(chosen), raising=False)
    yield
    registry.use({})


def test_attention_candidates_on_cpu(registry_api: None) -> None:
    # Every candidate the registry offers on CPU runs the model's attention correctly but FlexAttention, which has
    # no backward on CPU: it is rejected with torch's reason, and the fastest of the others is chosen.
    shapes = replace(SHAPES, documents=True)
    offered = op_backends.implementations("flash_alibi_attention", CPU)
    assert {"reference", "sdpa", "flex"} <= set(offered)
    ms = {("flash_alibi_attention", b): float(i + 1) for i, b in enumerate(reversed(list(offered)))}
    ms[("flash_alibi_attention", "sdpa")] = 0.5
    picked = sel.select(shapes, CPU, project_version="0.1.0", timer=fake_timer(ms), ops=("flash_alibi_attention",))
    assert picked.choices == {"flash_alibi_attention": "sdpa"}
    assert set(picked.rejected["flash_alibi_attention"]) == {"flex"}
    assert "backward on CPU" in picked.rejected["flash_alibi_attention"]["flex"]
    assert set(picked.times_ms["flash_alibi_attention"]) == set(offered) - {"flex"}
    assert picked.flash_tiles is None  # no GPU: the interpreter's tiles are not tuned
    picked.apply()
    assert registry.chosen()["flash_alibi_attention"] == "sdpa"


def test_every_selectable_op_has_inputs(registry_api: None) -> None:
    for op in backend_env.SELECTABLE:
        case = sel.op_case(op, SHAPES, CPU)
        assert case.mismatch(op_backends.implementations(op, CPU)["reference"], case.expected()) is None
    with pytest.raises(ValueError, match="no inputs for op 'softmax'"):
        sel.op_case("softmax", SHAPES, CPU)
