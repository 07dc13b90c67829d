import pytest

from appliance.monitor.events import EventWriter, read_events
from appliance.stages import Stages, settings_key


def test_complete_stage_is_skipped_and_changed_output_reruns(tmp_path):
    out = tmp_path / "out.txt"
    calls = []

    def work(progress):
        calls.append(1)
        progress(0.5)
        out.write_text("result")

    events = EventWriter(tmp_path / "metrics.jsonl")
    key = settings_key(a=1)
    assert Stages(tmp_path / "stages.json", events).run("s", key=key, outputs=[out], work=work)
    assert not Stages(tmp_path / "stages.json", events).run("s", key=key, outputs=[out], work=work)
    assert len(calls) == 1
    out.write_text("damaged")
    assert Stages(tmp_path / "stages.json", events).run("s", key=key, outputs=[out], work=work)
    assert Stages(tmp_path / "stages.json", events).run("s", key=settings_key(a=2), outputs=[out], work=work)
    states = [e["state"] for e in read_events(tmp_path / "metrics.jsonl") if e["kind"] == "stage"]
    assert states.count("skipped") == 1 and states.count("done") == 3


def test_failed_stage_is_not_recorded(tmp_path):
    events = EventWriter(tmp_path / "metrics.jsonl")

    def boom(progress):
        raise RuntimeError("disk on fire")

    stages = Stages(tmp_path / "stages.json", events)
    with pytest.raises(RuntimeError, match="disk on fire"):
        stages.run("s", key="k", outputs=[tmp_path / "x"], work=boom)
    assert "s" not in Stages(tmp_path / "stages.json", events).records
    failed = [e for e in read_events(tmp_path / "metrics.jsonl") if e.get("state") == "failed"]
    assert "disk on fire" in failed[0]["error"]
