"""The reducer's side of the report: evaluation events of every shape the appliance writes read as tables, whether
a run has GPUs, and how the nodes' energy figures were obtained. No UI: these are the figures the panels draw."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest

from appliance.monitor.eval_report import eval_report
from appliance.monitor.events import make_event
from appliance.monitor.state import RunState, reduce
from appliance.tui.widgets.energy import kind_of

FIXTURES = Path(__file__).parent / "fixtures"
T0 = 1_800_000_000.0


def fold(events: list[dict[str, Any]]) -> RunState:
    state = RunState()
    for event in events:
        reduce(state, event)
    return state


def test_periodic_eval_gives_each_language_its_perplexity() -> None:
    # trainer._record_eval: per_source is {language: loss}; the perplexity is exp(loss)
    report = eval_report({"step": 200, "valid_loss": 2.5, "valid_ppl": 12.18, "per_source": {"en": 2.3, "fr": 2.0}})
    assert (report.step, report.loss, report.ppl, report.final) == (200, 2.5, 12.18, False)
    assert [(x.name, x.loss) for x in report.languages] == [("en", 2.3), ("fr", 2.0)]
    assert report.languages[0].ppl == pytest.approx(math.exp(2.3))
    assert report.tasks == []


def test_eval_json_reads_as_a_language_table_and_a_task_table() -> None:
    report = eval_report(json.loads((FIXTURES / "cpu-2core" / "eval.json").read_text()))
    assert report.first_loss == pytest.approx(6.2443, abs=1e-4) and report.task_limit == 1
    assert {x.name: round(x.ppl or 0, 1) for x in report.languages} == {"en": 484.3, "fr": 490.0}
    tasks = {t.name: t for t in report.tasks}
    # a generation task scores exact match in "acc" and has no acc_norm: None metrics are left out
    assert tasks["lambada_sample"].exact_match and list(tasks["lambada_sample"].scores) == ["acc"]
    assert list(tasks["cloze_sample"].scores) == ["acc", "acc_norm", "acc_bytes"]
    assert tasks["cloze_sample"].scores["acc"] == (1.0, None)  # one document: no standard error
    assert report.task_metrics == ["acc", "acc_norm", "acc_bytes"]

    gpu = eval_report(json.loads((FIXTURES / "gpu-8xa100" / "eval.json").read_text()))
    hellaswag = {t.name: t for t in gpu.tasks}["hellaswag"]
    value, stderr = hellaswag.scores["acc_norm"]
    assert value == 0.331 and stderr == pytest.approx(math.sqrt(0.331 * 0.669 / 10041))
    assert (hellaswag.n, hellaswag.num_fewshot) == (10042, 0)
    assert gpu.task_metrics == ["acc", "acc_norm", "acc_bytes", "perplexity"]


def test_bits_per_byte_reads_from_the_periodic_event_and_from_eval_json() -> None:
    periodic = eval_report(
        {
            "step": 200,
            "valid_loss": 2.5,
            "per_source": {"en": 2.3, "fr": 2.0},
            "valid_bits_per_byte": 1.25,
            "per_source_bits_per_byte": {"en": 1.125},  # fr: no bytes counted, no figure
        }
    )
    assert periodic.bits_per_byte == 1.25
    assert [(x.name, x.bits_per_byte) for x in periodic.languages] == [("en", 1.125), ("fr", None)]
    final = eval_report(
        {
            "final": True,
            "valid_loss": 2.5,
            "valid_bits_per_byte": 1.25,
            "per_source": {"en": {"loss": 2.3, "ppl": 9.97, "bits_per_byte": 1.125}, "fr": {"loss": 2.0}},
        }
    )
    assert final.bits_per_byte == 1.25
    assert [(x.name, x.bits_per_byte) for x in final.languages] == [("en", 1.125), ("fr", None)]
    # an evaluation from before bits per byte, or with a tokenizer that gives no bytes
    assert eval_report({"valid_loss": 2.5, "per_source": {"en": 2.3}}).languages[0].bits_per_byte is None


def test_older_events_with_top_level_perplexity_still_read() -> None:
    report = eval_report({"perplexity": 12.5, "loss": 2.5, "tasks": {"lambada": {"acc": 0.6}}})
    assert (report.loss, report.ppl) == (2.5, 12.5)
    assert report.tasks[0].scores == {"acc": (0.6, None)}


def test_the_newest_evaluation_replaces_the_report_and_a_sample_alone_keeps_it() -> None:
    state = fold(
        [
            make_event("eval", t=T0, step=100, valid_loss=3.0, per_source={"en": 3.0}),
            make_event("eval", t=T0 + 1, step=200, valid_loss=2.5, per_source={"en": 2.5}),
            make_event("eval", t=T0 + 2, sample={"prompt": "a", "text": "b"}),
        ]
    )
    assert state.eval_report is not None and state.eval_report.step == 200
    assert state.eval_report.languages[0].loss == 2.5 and state.sample_text == "b"


def test_has_gpus_from_devices_plan_or_empty_device_lists() -> None:
    assert RunState().has_gpus is None  # nothing says either way: the GPU panel stays
    cpu_plan = json.loads((FIXTURES / "cpu-2core" / "plan.json").read_text())
    assert fold([{"t": None, "kind": "plan", **cpu_plan}]).has_gpus is False  # device.kind "cpu"
    assert fold([{"t": None, "kind": "plan", "hardware": {"gpus_per_node": 0}}]).has_gpus is False
    assert fold([make_event("gpu", t=T0, node="vm", devices=[])]).has_gpus is False
    device = {"index": 0, "name": "A100", "util": 99.0}
    # a gpu event that lists a device outweighs a plan that said CPU
    state = fold([{"t": None, "kind": "plan", **cpu_plan}, make_event("gpu", t=T0, node="n0", devices=[device])])
    assert state.has_gpus is True


def test_energy_sources_per_node_and_the_word_for_them() -> None:
    fields = {"kwh": 1.0, "co2_kg": 0.07, "gpu_source": "nvml_energy_counter"}
    state = fold(
        [
            make_event("energy", t=T0, node="a", cpu_source="rapl", **fields),
            make_event("energy", t=T0, node="b", cpu_source="estimate", **fields),
        ]
    )
    assert state.energy_sources("cpu_source") == ["estimate", "rapl"]
    assert state.energy_sources("gpu_source") == ["nvml_energy_counter"]
    # a total with one estimated node is not a measurement
    assert kind_of(["nvml_energy_counter", "rapl"]) == "measured"
    assert kind_of(["nvml_energy_counter", "estimate", "rapl"]) == "part estimated"
    assert kind_of(["nvml_power_integrated"]) == "sampled"
    assert kind_of(["estimate"]) == "estimated"
    assert kind_of(["something_new"]) == "unknown"
