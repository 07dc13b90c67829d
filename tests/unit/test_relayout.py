"""`train --layout`: the plan moves to a layout that can carry the run on, and refuses one that cannot, naming why."""

from __future__ import annotations

import json

import pytest

from appliance.errors import BadInput
from appliance.hardware import load_hardware
from appliance.planner import load_model_shape, make_plan, parse_layout
from appliance.rundir import RunDir
from appliance.tokenizer.bpe import train_tokenizer
from appliance.train.relayout import change_layout


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory) -> RunDir:
    run = RunDir(tmp_path_factory.mktemp("relayout")).make()
    run.corpus.mkdir()
    words = " ".join(f"word{i} token{i % 7} piece{i % 13}" for i in range(400))
    rows = [json.dumps({"text": f"{words} {n}", "lang": "en", "source": "t"}) for n in range(20)]
    (run.corpus / "shard-00000.jsonl").write_text("\n".join(rows) + "\n")
    layout = parse_layout("tp=1,pp=2,dp=2,mbs=2,gbs=8,zero=1")
    plan = make_plan(load_hardware("cpu-laptop-2core"), load_model_shape("bloom-micro-test"), layout=layout).to_json()
    # 640 entries = 5 x 128: the embedding's rows at tp=1, but tp=2 would pad them to 768.
    train_tokenizer(run.corpus, run.tokenizer, vocab_size=640, tp_size=1, seed=1)
    run.plan.write_text(json.dumps(plan))
    return run


def test_a_smaller_layout_rewrites_the_plan_and_keeps_the_batch_and_schedules(run_dir: RunDir) -> None:
    before = json.loads(run_dir.plan.read_text())
    change = change_layout(run_dir, "tp=1,pp=1,dp=1")
    after = json.loads(run_dir.plan.read_text())
    assert (change["from"]["pp"], change["to"]["pp"]) == (2, 1)
    assert {k: after["layout"][k] for k in ("tp", "pp", "dp", "micro_batch_size", "global_batch_size")} == {
        "tp": 1,
        "pp": 1,
        "dp": 1,
        "micro_batch_size": 2,  # kept from the run unless given
        "global_batch_size": 8,
    }
    assert after["train"] == before["train"] and after["model"] == before["model"]
    change_layout(run_dir, "tp=1,pp=2,dp=2")  # and back


@pytest.mark.parametrize(
    ("layout", "why"),
    [
        ("tp=1,pp=1,dp=2,gbs=16", "global batch is 8"),
        ("tp=3,pp=1,dp=1", "tp"),  # 4 heads do not split over 3 ranks
        ("tp=1,pp=1,dp=3", "dp"),  # 8 samples do not split over 3 replicas of 2
    ],
)
def test_a_layout_that_cannot_carry_the_run_is_refused_with_the_reason(run_dir: RunDir, layout: str, why: str) -> None:
    before = run_dir.plan.read_text()
    with pytest.raises(BadInput, match=why):
        change_layout(run_dir, layout)
    assert run_dir.plan.read_text() == before  # nothing written


def test_a_tp_that_pads_the_vocabulary_differently_is_refused(run_dir: RunDir) -> None:
    with pytest.raises(BadInput, match="pads the vocabulary to 768 rows"):
        change_layout(run_dir, "tp=2,pp=1,dp=1")
