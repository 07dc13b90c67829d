"""Flash attention's tile search (kernels/flash_attention_tiles.py tile_candidates, kernels/selection.py
tune_flash_tiles): Hopper gets configurations of its own, every configuration computes attention right, and the
fastest at a run's shape is kept in kernels.json and installed from it by the next launch without timing anything.

Numerics run in Triton's interpreter, with each configuration's tile sizes (warps and stages do not exist there)
and fp32 dots, as launch_config gives the interpreter, at a shape that crosses every block size's borders. Whether
each configuration compiles for sm_80 and sm_90 without spills: tests/kernels/test_kernel_compile.py (slow)."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import pytest
import torch

from kernels import flash_attention, reference
from kernels import selection as sel
from kernels.flash_attention_tiles import FlashConfig, tile_candidates
from kernels.launch import H100, recording
from kernels.selection_cache import SelectionCache

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="interpreter tiles: the CPU's check")


def test_hopper_times_128_key_blocks_the_a100_does_not() -> None:
    for head_dim in (64, 128):
        for documents in (False, True):
            ampere = tile_candidates(head_dim, torch.bfloat16, 80, documents)
            hopper = tile_candidates(head_dim, torch.bfloat16, 90, documents)
            wide = {c for c in hopper if c.fwd_n == 128}  # the forward's 128 x 128
            tutorial = {c for c in hopper if (c.dkdv_m, c.dkdv_n) == (32, 128)}  # the tutorial's dk/dv tile
            assert wide and tutorial and {c for c in wide & tutorial if (c.dq_m, c.dq_n) == (128, 32)}
            assert not [c for c in ampere if 128 in (c.fwd_n, c.dkdv_n)], (head_dim, documents)
            assert len(hopper) == len(set(hopper)) == len(ampere) + 3


def _distinct_tiles(head_dim: int) -> list[FlashConfig]:
    """Every configuration offered at this head dim on sm_80 and sm_90, with and without documents, one per set of
    tile sizes, made runnable by the interpreter (fp32 dots)."""
    found: dict[tuple[int, ...], FlashConfig] = {}
    for capability in (80, 90):
        for documents in (False, True):
            for cfg in tile_candidates(head_dim, torch.bfloat16, capability, documents):
                sizes = (cfg.fwd_m, cfg.fwd_n, cfg.dkdv_m, cfg.dkdv_n, cfg.dq_m, cfg.dq_n, cfg.block_d)
                found.setdefault(sizes, replace(cfg, dot_fp32=True))
    return list(found.values())


def _check_tiles(cfg: FlashConfig, head_dim: int, assert_matches: Callable[..., None]) -> None:
    """Forward and gradients with `cfg`'s tiles against the fp32 twin. 136 queries and keys: one 128 block and a
    ragged 8-row tail, several 32- and 64-blocks; two documents (their border inside a block), so every block is
    masked, the harder path."""
    gen = torch.Generator().manual_seed(head_dim)
    q, k, v = (torch.randn(1, 1, 136, head_dim, generator=gen).bfloat16() for _ in range(3))
    slopes = reference.alibi_slopes(1)
    docs = torch.tensor([[0] * 50 + [1] * 86])
    grad = torch.randn(1, 1, 136, head_dim, generator=gen).bfloat16()
    leaves = [t.float().requires_grad_() for t in (q, k, v)]
    want = reference.flash_alibi_attention(*leaves, slopes, True, q_doc=docs, k_doc=docs)
    want_grads = torch.autograd.grad(want, leaves, grad.float())
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(flash_attention, "tiles", lambda *args: cfg)
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out = flash_attention.flash_alibi_attention(*leaves, slopes, True, q_doc=docs, k_doc=docs)
        grads = torch.autograd.grad(out, leaves, grad)
    assert_matches(out, want, torch.bfloat16)
    for got, expected in zip(grads, want_grads, strict=True):
        assert_matches(got, expected, torch.bfloat16, scale=2.0)


@pytest.mark.parametrize("head_dim", [64, 128])
def test_every_candidate_computes_attention_right_in_the_interpreter(
    head_dim: int, assert_matches: Callable[..., None]
) -> None:
    configs = _distinct_tiles(head_dim)
    assert len(configs) >= 6
    for cfg in configs:
        _check_tiles(cfg, head_dim, assert_matches)


def test_a_wrong_configuration_is_caught(assert_matches: Callable[..., None]) -> None:
    """The positive control of the check above: tiles 32 wide over a head of 64 read half of every row."""
    cfg = replace(tile_candidates(64, torch.bfloat16, 90)[0], dot_fp32=True, block_d=32)
    with pytest.raises(AssertionError):
        _check_tiles(cfg, 64, assert_matches)


# ----- the search picks the fastest and kernels.json keeps it ------------------------------------------------------
SHAPES = sel.RankShapes(
    micro_batch_size=2, seq_len=40, hidden=64, heads=4, head_dim=16, ffn=256, vocab=300, dtype="bfloat16",
    documents=False,
)  # fmt: skip


@pytest.fixture
def on_an_h100(monkeypatch: pytest.MonkeyPatch) -> Iterator[sel.SelectionKey]:
    """The selection's key as on an H100 (the tiles are tuned on GPUs only); the tiles installed afterwards."""
    key = sel.SelectionKey("NVIDIA H100 80GB HBM3", "9.0", torch.__version__, "3.7.1", "0.1.0", SHAPES)
    monkeypatch.setattr(sel, "current_key", lambda shapes, device, project: replace(key, shapes=shapes))
    flash_attention.TUNED_TILES.clear()
    yield key
    flash_attention.TUNED_TILES.clear()


def _launched_forward(seq: int) -> tuple[int, int, int, int]:
    q = torch.empty(2, 4, seq, 16, dtype=torch.bfloat16, device="meta")
    with recording(H100) as launches:
        flash_attention.flash_fwd(q, q, q, torch.empty(4, device="meta"), True, 0.25)
    (launch,) = launches
    return tuple(launch.options[name] for name in ("BLOCK_M", "BLOCK_N", "num_warps", "num_stages"))


def test_the_fastest_tiles_are_kept_in_kernels_json_and_installed_from_it(
    on_an_h100: sel.SelectionKey, tmp_path: Path
) -> None:
    candidates = tile_candidates(16, torch.bfloat16, 90)
    fastest = next(c for c in candidates if c.fwd_n == 128)  # one of Hopper's own
    asked: list[str] = []

    def triton_stand_in(*args: Any, **kwargs: Any) -> torch.Tensor:  # the twin, noting the tiles a launch takes
        asked.append(sel.tile_label(flash_attention.tiles(16, torch.bfloat16, 90, False, 40, 40)))
        return reference.flash_alibi_attention(*args, **kwargs)

    def timer(op: str, backend: str, step: Callable[[], object]) -> float:
        step()
        if backend.startswith("triton "):  # a tile configuration: "triton <label>"
            return 1.0 if backend == f"triton {sel.tile_label(fastest)}" else 2.0
        return {"triton": 1.5, "reference": 9.0}[backend]

    def offered(op: str, device: torch.device) -> dict[str, Callable[..., Any]]:
        return {"reference": reference.flash_alibi_attention, "triton": triton_stand_in}

    path = tmp_path / "kernels.json"
    cache = SelectionCache.load(path)
    picked = sel.select(SHAPES, torch.device("cpu"), project_version="0.1.0", timer=timer, implementations=offered,
                        ops=("flash_alibi_attention",), cache=cache)  # fmt: skip
    cache.save(path)
    assert picked.flash_tiles is not None and picked.flash_tiles["chosen"] == asdict(fastest)
    assert len(picked.flash_tiles["times_ms"]) == len(candidates)
    (entry,) = json.loads(path.read_text())["entries"]
    assert entry["record"]["flash_tiles"]["chosen"] == asdict(fastest)

    # The next launch: nothing checked or timed, the tiles installed by apply().
    flash_attention.TUNED_TILES.clear()
    asked.clear()
    again = sel.select(SHAPES, torch.device("cpu"), project_version="0.1.0", timer=None, implementations=offered,
                       ops=("flash_alibi_attention",), cache=SelectionCache.load(path))  # fmt: skip
    assert asked == [] and again.cached == ["flash_alibi_attention"] and flash_attention.TUNED_TILES == {}
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(sel.registry, "use", lambda choices: None)
        again.apply()
    assert _launched_forward(40) == (fastest.fwd_m, fastest.fwd_n, fastest.warps, fastest.stages)
    default = candidates[0]
    assert _launched_forward(48) == (default.fwd_m, default.fwd_n, default.warps, default.stages)  # another shape
