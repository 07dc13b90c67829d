"""The plan follows the corpus: after the data stage the one-GPU plan is re-fixed from the sample corpus's token
count, and a rerun of the same run directory skips every stage and keeps that plan."""

import json

import pytest
from appliance_cli import run_appliance

pytestmark = pytest.mark.slow


def stage_states(run_dir) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        e = json.loads(line)
        if e["kind"] == "stage" and e["state"] in ("done", "skipped"):
            out.setdefault(e["name"], []).append(e["state"])
    return out


def test_one_gpu_plan_is_sized_to_the_sample_corpus_and_reruns_keep_it(tmp_path):
    args = ("run", "--headless", "--prepare-only", "--hardware", "h100-sxm5-x1", "--run-dir", "runs/sized")
    first = run_appliance(*args, cwd=tmp_path, timeout=900)
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    run_dir = tmp_path / "runs" / "sized"
    plan = json.loads((run_dir / "plan.json").read_text())
    datasets = json.loads((run_dir / "data" / "datasets.json").read_text())
    corpus = sum(d["tokens"] for d in datasets.values())
    run, train = plan["run"], plan["train"]
    assert run["corpus_tokens"] == corpus and run["limit"] == "data"
    assert train["train_tokens"] <= 4 * corpus and run["time_s"] <= 600  # a smoke run, not 100 days
    assert any(line.startswith("limit: data") for line in plan["sizing"])
    plans = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    plans = [e for e in plans if e["kind"] == "plan"]
    assert len(plans) == 2 and plans[-1]["run"]["corpus_tokens"] == corpus  # the budget plan, then the sized one

    before = (run_dir / "plan.json").read_bytes()
    again = run_appliance(*args, cwd=tmp_path, timeout=900)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    assert (run_dir / "plan.json").read_bytes() == before
    states = stage_states(run_dir)
    for name in ("plan", "prep", "tokenizer", "data"):
        assert states[name] == ["done", "skipped"], (name, states)
