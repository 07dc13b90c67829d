"""kernels.json keeps every measurement, one entry per GPU, software, op and shape (kernels/selection_cache.py), and
the block-level check (kernels/selection_block.py) times the compiled block with the chosen ops against the twins.

Fake candidates (the twins, under other names) and fake timers that count their calls: what is measured is what the
timer was asked for, what came from the cache is what it was not."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from dataclasses import asdict, fields, replace
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from kernels import reference, registry
from kernels import selection as sel
from kernels import selection_block as blocks
from kernels.selection_cache import BLOCK, OP_SHAPE_FIELDS, SelectionCache, entry_key

CPU = torch.device("cpu")
SHAPES = sel.RankShapes(
    micro_batch_size=2, seq_len=24, hidden=32, heads=2, head_dim=16, ffn=128, vocab=96, dtype="float32",
    documents=False,
)  # fmt: skip
OPS = ("layer_norm", "bias_gelu", "flash_alibi_attention", "vocab_cross_entropy")
# per op: triton fastest alone, then compiled, then the twin
MS = {"triton": 1.0, "compiled": 2.0, "reference": 3.0}


def offered(op: str, device: torch.device) -> dict[str, Callable[..., Any]]:
    return dict.fromkeys(MS, getattr(reference, op))


class CountingTimer:
    """MS by backend, each step run once; `asked` lists (op, backend) in order."""

    def __init__(self) -> None:
        self.asked: list[tuple[str, str]] = []

    def __call__(self, op: str, backend: str, step: Callable[[], object]) -> float:
        step()
        self.asked.append((op, backend))
        return MS[backend]

    def ops(self) -> set[str]:
        return {op for op, _ in self.asked}


def _select(shapes: sel.RankShapes, cache: SelectionCache, timer: CountingTimer) -> sel.Selection:
    return sel.select(shapes, CPU, project_version="0.1.0", timer=timer, implementations=offered, cache=cache)


def test_a_new_micro_batch_adds_entries_and_an_earlier_one_is_read_back(tmp_path: Path) -> None:
    path = tmp_path / "kernels.json"
    first, second, again = CountingTimer(), CountingTimer(), CountingTimer()
    cache = SelectionCache.load(path)
    measured = _select(SHAPES, cache, first)
    cache.save(path)
    assert first.ops() == set(OPS) and measured.source == "measured" and measured.cached == []
    cache = SelectionCache.load(path)
    _select(replace(SHAPES, micro_batch_size=4), cache, second)
    cache.save(path)
    assert second.ops() == set(OPS)  # every op is fed the micro-batch: all measured at 4
    entries = json.loads(path.read_text())["entries"]
    assert len(entries) == 2 * len(OPS)
    assert sorted({e["key"]["shape"]["micro_batch_size"] for e in entries}) == [2, 4]
    read = _select(SHAPES, SelectionCache.load(path), again)
    assert again.asked == []  # micro-batch 2 is read back, not measured again
    assert read.source == "cache" and read.cached == list(OPS)
    assert read.choices == measured.choices == dict.fromkeys(OPS, "triton")
    assert read.times_ms == measured.times_ms


def _signature(case: sel.OpCase) -> list[Any]:
    """What `case` hands a backend: every argument's shape and dtype (or value), found by a spy that stops there."""
    seen: list[Any] = []

    class Seen(Exception):
        pass

    def spy(*args: Any, **kwargs: Any) -> Any:
        for value in [*args, *kwargs.values()]:
            seen.append((tuple(value.shape), value.dtype, value.sum().item()) if torch.is_tensor(value) else value)
        raise Seen

    with pytest.raises(Seen):
        case.call(spy, case.leaves)
    return seen


def test_each_ops_key_holds_exactly_the_sizes_its_inputs_are_built_from() -> None:
    """A field in OP_SHAPE_FIELDS[op] changes the inputs op is measured on; any other field does not (so an entry
    is reused across it). The block's key holds every field but the vocabulary."""
    changed = {
        "micro_batch_size": 3, "seq_len": 16, "hidden": 48, "heads": 4, "head_dim": 8, "ffn": 64, "vocab": 80,
        "dtype": "bfloat16", "documents": True,
    }  # fmt: skip
    assert set(changed) == {f.name for f in fields(sel.RankShapes)}
    for op in OPS:
        base = _signature(sel.op_case(op, SHAPES, CPU))
        moved = {name for name, value in changed.items()
                 if _signature(sel.op_case(op, replace(SHAPES, **{name: value}), CPU)) != base}  # fmt: skip
        assert moved == set(OP_SHAPE_FIELDS[op]), op
    assert set(OP_SHAPE_FIELDS[BLOCK]) == set(changed) - {"vocab"}


def test_an_entry_is_used_only_when_its_whole_key_matches() -> None:
    cache = SelectionCache()
    _select(SHAPES, cache, CountingTimer())
    # Another GPU, capability or software: each op measured again.
    for name, value in [("device", "NVIDIA H200"), ("capability", "9.0"), ("torch", "2.12.0"), ("triton", "9.9"),
                        ("project", "0.2.0")]:  # fmt: skip
        moved = SelectionCache({replace(key, **{name: value}): record for key, record in cache.items()})
        timer = CountingTimer()
        _select(SHAPES, moved, timer)
        assert timer.ops() == set(OPS) and moved.added, name
    # Another size: only the ops fed that size.
    for name, value in [("vocab", 80), ("ffn", 64), ("heads", 4), ("documents", True), ("hidden", 48)]:
        timer = CountingTimer()
        picked = _select(replace(SHAPES, **{name: value}), _copy(cache), timer)
        assert timer.ops() == {op for op in OPS if name in OP_SHAPE_FIELDS[op]}, name
        assert set(picked.cached) == {op for op in OPS if name not in OP_SHAPE_FIELDS[op]}, name


def _copy(cache: SelectionCache) -> SelectionCache:
    return SelectionCache(dict(cache.items()))


FORMAT_1 = {  # kernels.json as the previous version wrote it: one selection, keyed with the rank's whole shape
    "key": {"device": "cpu", "capability": "", "torch": torch.__version__, "triton": "", "project": "0.1.0",
            "shapes": asdict(SHAPES)},
    "choices": {"layer_norm": "compiled", "bias_gelu": "reference"},
    "times_ms": {"layer_norm": {"compiled": 0.5, "reference": 0.75}, "bias_gelu": {"reference": 0.25}},
    "rejected": {"layer_norm": {"triton": "output off by 1"}},
    "flash_tiles": None,
    "source": "measured",
}  # fmt: skip


def test_the_previous_format_is_read_as_one_entry_per_op(tmp_path: Path) -> None:
    import triton

    path = tmp_path / "kernels.json"
    path.write_text(json.dumps(FORMAT_1 | {"key": FORMAT_1["key"] | {"triton": triton.__version__}}))
    timer = CountingTimer()
    picked = _select(SHAPES, SelectionCache.load(path), timer)
    assert timer.ops() == {"flash_alibi_attention", "vocab_cross_entropy"}  # the ops it did not hold
    assert picked.cached == ["layer_norm", "bias_gelu"]
    assert picked.choices["layer_norm"] == "compiled" and picked.rejected["layer_norm"] == {"triton": "output off by 1"}


def test_a_damaged_file_or_another_format_is_measured_again_and_replaced(tmp_path: Path) -> None:
    path = tmp_path / "kernels.json"
    for text in ("{not json", json.dumps({"format": 3, "entries": []}), json.dumps({"format": 2, "entries": [1]})):
        path.write_text(text)
        cache = SelectionCache.load(path)
        timer = CountingTimer()
        _select(SHAPES, cache, timer)
        assert timer.ops() == set(OPS), text
        cache.save(path)
        assert json.loads(path.read_text())["format"] == 2 and not list(tmp_path.glob(".kernels.json.tmp*"))


# ----- the block-level check ----------------------------------------------------------------------------------------
@pytest.fixture
def restore_registry() -> Iterator[None]:
    yield
    registry.use({})


def _block_step(count: list[int]) -> blocks.BlockStep:
    """A compiled stand-in block (LayerNorm, then bias + GeLU, through the registry as BloomBlock calls them), with
    a count of the forward + backward steps run."""
    x = torch.randn(2, 8, 16, requires_grad=True)
    w, b, bias = torch.ones(16), torch.zeros(16), torch.zeros(16)

    def block(x: torch.Tensor) -> torch.Tensor:
        return registry.bias_gelu(registry.layer_norm(x, w, b), bias) + x

    def build() -> Callable[[], object]:
        torch._dynamo.reset()
        forward = torch.compile(block, fullgraph=True, backend="eager")

        def step() -> object:
            count.append(1)
            return torch.autograd.grad(forward(x).sum(), [x])

        return step

    return build


def block_timer(ms: dict[tuple[str, str], float], asked: list[dict[str, str]]) -> sel.Timer:
    """The block's time by what the registry runs for CUDA tensors when it is timed: ms[(layer_norm's, bias_gelu's)]."""

    def timer(op: str, label: str, step: Callable[[], object]) -> float:
        assert op == BLOCK
        step()
        chosen = registry.chosen()
        asked.append(chosen)
        return ms[(chosen["layer_norm"], chosen["bias_gelu"])]

    return timer


def _selection(choices: dict[str, str]) -> sel.Selection:
    key = sel.current_key(SHAPES, CPU, "0.1.0")
    return sel.Selection(key=key, choices=dict(choices), times_ms={op: {} for op in choices})


PER_OP = {"layer_norm": "triton", "bias_gelu": "triton", "flash_alibi_attention": "triton",
          "vocab_cross_entropy": "triton"}  # fmt: skip


def test_the_block_with_the_twins_wins_where_it_is_faster_and_is_cached(restore_registry: None) -> None:
    ms = {("triton", "triton"): 4.0, ("reference", "triton"): 3.0, ("triton", "reference"): 3.5,
          ("reference", "reference"): 2.0}  # fmt: skip
    asked: list[dict[str, str]] = []
    ran: list[int] = []
    picked, cache = _selection(PER_OP), SelectionCache()
    blocks.check_block(picked, _block_step(ran), block_timer(ms, asked), cache)
    assert len(asked) == 4 and len(ran) == 4  # every combination built and run under its own choices
    assert {(c["layer_norm"], c["bias_gelu"]) for c in asked} == set(ms)
    assert all(c["flash_alibi_attention"] == "triton" for c in asked)  # the others as chosen per op
    assert picked.choices == PER_OP | {"layer_norm": "reference", "bias_gelu": "reference"}
    assert picked.block is not None and picked.block["chosen"] == "layer_norm=reference,bias_gelu=reference"
    assert picked.summary().splitlines()[-1].startswith("block: layer_norm=reference,bias_gelu=reference 2 ms, ")
    assert registry.chosen() == dict.fromkeys(PER_OP, "triton")  # the defaults again: apply() installs the choice
    assert cache.added == [entry_key(asdict(picked.key), BLOCK, asdict(SHAPES))]
    # The same per-op choices again: read from the cache, nothing built.
    again = _selection(PER_OP)
    blocks.check_block(again, _block_step(ran), block_timer(ms, asked), cache)
    assert len(ran) == 4 and again.choices == picked.choices and again.cached == [BLOCK]
    # Other per-op choices: the entry does not apply, measured again.
    other = _selection(PER_OP | {"bias_gelu": "reference"})
    blocks.check_block(other, _block_step(ran), block_timer(ms, asked), cache)
    assert len(ran) == 6 and other.choices["layer_norm"] == "reference"


def test_the_per_op_choice_stays_where_the_block_says_so(restore_registry: None) -> None:
    """The positive control: the same check keeps the per-op winners when their block is the fastest."""
    ms = {("triton", "triton"): 1.0, ("reference", "triton"): 3.0, ("triton", "reference"): 3.5,
          ("reference", "reference"): 2.0}  # fmt: skip
    picked = _selection(PER_OP)
    blocks.check_block(picked, _block_step([]), block_timer(ms, []), None)
    assert picked.choices == PER_OP and picked.block is not None and picked.block["chosen"] == blocks.PER_OP


def test_nothing_is_timed_where_the_fusible_ops_run_as_twins_already(restore_registry: None) -> None:
    """The twin, or torch.compile of it (traced into the block's graph like the twin), is what the check would
    switch to: there is nothing to compare."""
    picked = _selection(PER_OP | {"layer_norm": "compiled", "bias_gelu": "reference"})
    blocks.check_block(picked, _block_step([]), block_timer({}, []), None)  # {}: any timing would raise
    assert picked.block is None
    assert list(blocks.combinations(PER_OP | {"layer_norm": "compiled"})) == [blocks.PER_OP, "bias_gelu=reference"]


def test_the_check_runs_inside_the_selection_rank_0_makes(tmp_path: Path, restore_registry: None) -> None:
    """kernel_choice.agree on one gloo rank: per-op measurement, then the block, both kept in kernels.json; a second
    launch at the same shapes measures nothing."""
    from appliance.model.config import BloomConfig
    from appliance.parallel.step import kernel_choice
    from appliance.parallel.topology import ParallelTopology

    config = BloomConfig(vocab_size=96, hidden_size=32, n_layer=1, n_head=2)
    topology = ParallelTopology(tp=1, pp=1, dp=1, world_size=1)
    step = kernel_choice.block_step_for(config, topology, SHAPES, CPU, backend="eager")
    assert step is not None
    assert kernel_choice.block_step_for(config, replace(topology, tp=2, world_size=2), SHAPES, CPU) is None
    timer_calls: list[tuple[str, str]] = []

    def timer(op: str, backend: str, run: Callable[[], object]) -> float:
        run()
        timer_calls.append((op, backend))
        return 1.0 if op == BLOCK and backend != blocks.PER_OP else MS.get(backend, 2.0)

    path = tmp_path / "kernels.json"
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        first = kernel_choice.agree(SHAPES, CPU, cache_file=path, timer=timer, implementations=offered,
                                    block_step=step)  # fmt: skip
        blocks_timed = [c for c in timer_calls if c[0] == BLOCK]
        assert len(blocks_timed) == 4 and first.block is not None
        assert first.choices["layer_norm"] == "reference" or first.choices["bias_gelu"] == "reference"
        timer_calls.clear()
        second = kernel_choice.agree(SHAPES, CPU, cache_file=path, timer=timer, implementations=offered,
                                     block_step=step)  # fmt: skip
    finally:
        dist.destroy_process_group()
    assert timer_calls == [] and second.source == "cache" and second.choices == first.choices
    record = kernel_choice.kernel_record(second, CPU)
    assert record["cached"] == [*OPS, BLOCK] and record["block"]["chosen"] == first.block["chosen"]
