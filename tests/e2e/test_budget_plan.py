"""The plan follows the corpus: after the prep stage the one-GPU plan takes a vocabulary sized to the prepared
corpus, after the data stage it is re-fixed from the corpus's token count, and a rerun of the same run directory
skips every stage and keeps that plan."""

import json
import math

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
    # The budget plan (BLOOM's 250,880 entries), the plan with the vocabulary sized to the prepared corpus's bytes,
    # then the one sized to its tokens, at that vocabulary.
    assert len(plans) == 3 and plans[-1]["run"]["corpus_tokens"] == corpus
    assert plans[0]["model"]["vocab_size"] == 250_880 and plans[0]["run"]["corpus_bytes"] is None
    corpus_bytes = json.loads((run_dir / "corpus" / "prep_report.json").read_text())["totals"]["bytes_out"]
    vocab = plan["model"]["vocab_size"]
    assert plans[1]["model"]["vocab_size"] == vocab == plans[2]["model"]["vocab_size"]
    assert plan["run"]["corpus_bytes"] == corpus_bytes and vocab % 128 == 0
    # Every entry seen at least 20 times under Zipf's law: (bytes / 4.6) / (V (ln V + 0.5772)) >= 20 at V - 128.
    assert (corpus_bytes / 4.6) / ((vocab - 128) * (math.log(vocab - 128) + 0.5772)) >= 20 and vocab < 20_000
    fertility = json.loads((run_dir / "tokenizer" / "fertility.json").read_text())
    assert fertility["tokenizer"]["vocab_size_requested"] == vocab
    assert fertility["tokenizer"]["vocab_size_reasons"] == plan["vocabulary"]

    before = (run_dir / "plan.json").read_bytes()
    again = run_appliance(*args, cwd=tmp_path, timeout=900)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    assert (run_dir / "plan.json").read_bytes() == before
    states = stage_states(run_dir)
    for name in ("plan", "prep", "tokenizer", "data"):
        assert states[name] == ["done", "skipped"], (name, states)
