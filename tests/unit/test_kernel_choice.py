"""The engine side of the measured kernel selection: when it measures, the cache's key, ds_config.json's record and
the `kernels` event (appliance/parallel/step/kernel_choice.py, train/from_spec.py, monitor/)."""

from __future__ import annotations

import io
import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from appliance.model.config import BloomConfig
from appliance.monitor.events import make_event
from appliance.monitor.headless import HeadlessPrinter
from appliance.monitor.state import RunState
from appliance.parallel.step import kernel_choice
from appliance.parallel.topology import ParallelTopology
from appliance.rundir import RunDir
from kernels.selection import RankShapes, Selection, SelectionKey

SHAPES = RankShapes(2, 2048, 1024, 16, 64, 4096, 250880, "bfloat16", False)
KEY = SelectionKey("NVIDIA H100 80GB HBM3", "9.0", "2.11.0+cu130", "3.6.0", "0.1.0", SHAPES)
SELECTION = Selection(
    key=KEY,
    choices={"flash_alibi_attention": "sdpa", "layer_norm": "compiled"},
    times_ms={"flash_alibi_attention": {"sdpa": 3.25, "triton": 4.5}, "layer_norm": {"compiled": 0.125}},
    rejected={"flash_alibi_attention": {"flex": "RuntimeError: out of resource"}},
)


def test_rank_shapes_split_heads_mlp_and_vocabulary_over_tp() -> None:
    config = BloomConfig(vocab_size=250880, hidden_size=1024, n_layer=24, n_head=16)
    topology = ParallelTopology(tp=2, pp=1, dp=2, world_size=4)
    shapes = kernel_choice.rank_shapes(config, topology, micro_batch_size=2, seq_len=2048, dtype="bf16")
    assert shapes == RankShapes(2, 2048, 1024, 8, 64, 2048, 125440, "bfloat16", False)


def test_nothing_is_measured_on_cpu_or_when_a_backend_is_forced(monkeypatch: pytest.MonkeyPatch) -> None:
    config = BloomConfig(vocab_size=512, hidden_size=64, n_layer=2, n_head=4)
    topology = ParallelTopology(tp=1, pp=1, dp=1, world_size=1)
    monkeypatch.setattr(kernel_choice, "agree", lambda *a, **k: pytest.fail("measured"))
    common: dict[str, Any] = dict(micro_batch_size=2, seq_len=64, dtype="fp32", cache_file=None)
    monkeypatch.setenv("BLOOM_KERNELS", "auto")
    assert kernel_choice.choose_kernels(config, topology, device=torch.device("cpu"), **common) is None
    assert kernel_choice.kernel_record(None, torch.device("cpu")) == {
        "source": "default", "backend": "reference", "choices": {}, "times_ms": {}, "backend_env": "BLOOM_KERNELS=auto",
    }  # fmt: skip
    monkeypatch.setenv("BLOOM_KERNELS", "reference")  # a GPU run with the twins forced: no CUDA call at all
    assert kernel_choice.choose_kernels(config, topology, device=torch.device("cuda", 0), **common) is None
    record = kernel_choice.kernel_record(None, torch.device("cuda", 0))
    assert record["source"] == "forced" and record["backend"] == "reference"
    assert record["backend_env"] == "BLOOM_KERNELS=reference"


def test_a_new_micro_batch_keeps_the_earlier_ones_measurement(tmp_path: Path) -> None:
    """kernels.json after launches at micro-batches 2, 4 and 2 again on one gloo rank: the third reads what the first
    measured (the file held one selection, keyed with the micro-batch, which the second replaced)."""
    from dataclasses import replace

    import torch.distributed as dist

    from kernels import reference

    small = RankShapes(2, 24, 32, 2, 16, 128, 96, "float32", False)
    timed: list[tuple[int, str]] = []

    def timer(op: str, backend: str, step: Any) -> float:
        step()
        timed.append((len(launches), op))
        return {"reference": 2.0, "compiled": 1.0}[backend]

    def offered(op: str, device: torch.device) -> dict[str, Any]:
        return dict.fromkeys(("reference", "compiled"), getattr(reference, op))

    cache, launches = tmp_path / "kernels.json", []
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        for micro_batch in (2, 4, 2):
            launches.append(micro_batch)
            shapes = replace(small, micro_batch_size=micro_batch)
            picked = kernel_choice.agree(shapes, torch.device("cpu"), cache_file=cache, timer=timer,
                                         implementations=offered)  # fmt: skip
            assert picked.choices == dict.fromkeys(picked.times_ms, "compiled")
    finally:
        dist.destroy_process_group()
    assert {launch for launch, _ in timed} == {1, 2}, "the third launch measured again"
    assert picked.source == "cache"


def test_engine_for_records_the_kernels_in_ds_config(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from appliance.hardware import load_hardware
    from appliance.planner import load_model_shape, make_plan
    from appliance.train import from_spec

    spec = make_plan(load_hardware("cpu-laptop-2core"), load_model_shape("bloom-micro-test")).spec()
    config = from_spec.model_config(spec, 512)
    topology = ParallelTopology(tp=1, pp=1, dp=1, world_size=1)
    given: dict[str, Any] = {}

    def fake_choose(*args: Any, **kwargs: Any) -> Selection:
        given.update(kwargs)
        return SELECTION

    monkeypatch.setattr(from_spec, "choose_kernels", fake_choose)
    monkeypatch.setattr(from_spec, "build_engine", lambda *a, **k: SimpleNamespace(ds_config={}, all_to_all=None))
    monkeypatch.setattr(from_spec.dist, "get_rank", lambda: 0)
    run_dir = RunDir(tmp_path / "run").make()
    from_spec.engine_for(spec, config, topology, run_dir=run_dir)
    assert given["cache_file"] == run_dir.kernels == run_dir.root / "kernels.json"
    assert given["micro_batch_size"] == spec.train.micro_batch_size and given["seq_len"] == spec.train.seq_len
    assert given["documents"] is spec.train.reset_attention_mask
    written = json.loads(run_dir.ds_config.read_text())["kernels"]
    assert written["source"] == "measured" and written["choices"] == SELECTION.choices
    assert written["times_ms"] == SELECTION.times_ms and written["rejected"] == SELECTION.rejected
    assert written["device"] == "NVIDIA H100 80GB HBM3" and written["shapes"]["seq_len"] == 2048


def test_kernels_event_is_checked_folded_and_shown() -> None:
    record = kernel_choice.kernel_record(SELECTION, torch.device("cuda", 0))
    with pytest.raises(ValueError, match="lacks \\['times_ms'\\]"):
        make_event("kernels", source="measured", choices={})
    event = make_event("kernels", t=100.0, **record)
    state = RunState()
    state.apply(event)
    assert state.kernels is not None and state.kernels["choices"] == SELECTION.choices and state.bad_events == 0
    out = io.StringIO()
    HeadlessPrinter(out).handle(event)
    assert out.getvalue().rstrip().endswith("kernels measured: attention sdpa 3.25 ms, LayerNorm compiled 0.125 ms")
    out = io.StringIO()
    HeadlessPrinter(out).handle(
        make_event("kernels", t=101.0, **kernel_choice.kernel_record(None, torch.device("cpu")))
    )
    assert out.getvalue().rstrip().endswith("kernels default: reference (BLOOM_KERNELS=auto)")
