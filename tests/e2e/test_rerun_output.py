"""What `run` prints and leaves: a rerun of a prepared run directory says what it skipped, one line per stage with
when it was done, and then only its own lines (not the earlier launch's log again); a run whose corpus is refused
leaves no run directory behind, and runs/latest where it was."""

from __future__ import annotations

import gzip
import json
import os
import re
import time
from pathlib import Path

import pytest
from appliance_cli import run_appliance

# The micro model on the CPU profile, one data worker: the smallest prepared run (a few seconds).
SMALL = ("--hardware", "cpu-laptop-2core", "--model", "bloom-micro-test")
DATA_STAGES = ("prep", "tokenizer", "data")
DATE = re.compile(r"\d{4}-\d\d-\d\d \d\d:\d\d")
LINE = re.compile(r"^\[[\d-]+ [\d:]+\] (.*)$")


def documents(path: Path, count: int = 30) -> Path:
    """A .jsonl of the sample corpus's first English documents."""
    from appliance.data.sample_corpus import SAMPLE_CORPUS_DIR

    with gzip.open(SAMPLE_CORPUS_DIR / "en.jsonl.gz", "rt", encoding="utf-8") as f:
        lines = [json.loads(line)["text"] for _, line in zip(range(count), f, strict=False)]
    path.write_text("".join(json.dumps({"text": text, "lang": "en"}) + "\n" for text in lines))
    return path


def printed(stdout: str) -> list[str]:
    """The headless lines without their clock."""
    return [m[1] for line in stdout.splitlines() if (m := LINE.match(line))]


@pytest.fixture(scope="module")
def prepared(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[str]]:
    """A run directory `run --prepare-only` made, in its working directory, and the lines that run printed."""
    cwd = tmp_path_factory.mktemp("rerun")
    documents(cwd / "in.jsonl")
    args = ("run", "--headless", "--prepare-only", "--corpus", "in.jsonl", "--run-dir", "runs/r", *SMALL)
    first = run_appliance(*args, "--set", "workers=1", cwd=cwd, timeout=300)
    assert first.returncode == 0, first.stderr
    return cwd, printed(first.stdout)


def rerun(cwd: Path, *flags: str) -> list[str]:
    args = ("run", "--headless", "--prepare-only", "--corpus", "in.jsonl", "--run-dir", "runs/r", *SMALL, *flags)
    result = run_appliance(*args, cwd=cwd, timeout=300)
    assert result.returncode == 0, result.stderr
    return printed(result.stdout)


def test_a_rerun_prints_one_line_per_skipped_stage_with_when_it_was_done_and_no_old_line(prepared):
    cwd, first = prepared
    assert "stage prep started" in first and "run prepared" in first  # control: the first launch's own lines
    skipped = [f"{name}: done <date>, skipped" for name in ("plan", *DATA_STAGES)]
    for _ in range(2):  # a second rerun finds the first rerun's "skipped" events in the history: still one line each
        lines = rerun(cwd)
        assert [DATE.sub("<date>", line) for line in lines] == ["run started", *skipped, "run prepared"]
    records = json.loads((cwd / "runs" / "r" / "stages.json").read_text())
    done = [time.strftime("%Y-%m-%d %H:%M", time.localtime(records[name]["done_t"])) for name in ("plan", *DATA_STAGES)]
    assert [m[0] for line in lines[1:-1] if (m := DATE.search(line))] == done


def test_a_rerun_in_json_prints_only_its_own_events(prepared):
    cwd, _ = prepared
    before = len((cwd / "runs" / "r" / "metrics.jsonl").read_text().splitlines())
    result = run_appliance(
        "run", "--headless", "--prepare-only", "--corpus", "in.jsonl", "--run-dir", "runs/r", *SMALL,
        "--log-format", "json", cwd=cwd, timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    events = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    assert json.loads((cwd / "runs" / "r" / "metrics.jsonl").read_text().splitlines()[before]) == events[0]
    assert [e.get("state") for e in events if e["kind"] == "stage"] == ["skipped"] * 4


def test_a_prepared_run_closes_with_how_to_train_it(prepared):
    """`--prepare-only` ends with the run folder, what it prepared, and the commands that train it (with the corpus
    the run was prepared from: another one would be prepared instead of trained on)."""
    cwd, _ = prepared
    args = ("run", "--headless", "--prepare-only", "--corpus", "in.jsonl", "--run-dir", "runs/r", *SMALL)
    result = run_appliance(*args, cwd=cwd, timeout=300)
    assert result.returncode == 0, result.stderr
    block = result.stdout.split("] run prepared\n")[1].splitlines()
    assert block[0].startswith("Run prepared") and block[0].endswith(": runs/r")
    rows = {line.split()[0]: line for line in block[1:] if line.startswith("  ")}
    assert "of 30 documents kept" in rows["corpus"] and "tokens in 1 language" in rows["data"], block
    assert "./bloom_appliance.py train --run-dir runs/r" in result.stdout
    assert "./bloom_appliance.py run --run-dir runs/r --corpus in.jsonl" in result.stdout


def refused_corpus(cwd: Path) -> Path:
    """A corpus of which `prep` keeps no record: found bad only once the prep stage reads it."""
    path = cwd / "bad.jsonl.gz"
    path.write_bytes(gzip.compress(b"{not json\n" * 50))
    return path


def test_a_run_whose_corpus_is_refused_leaves_no_run_directory_and_latest_where_it_was(tmp_path):
    refused_corpus(tmp_path)
    result = run_appliance("run", "--headless", "--corpus", "bad.jsonl.gz", *SMALL, cwd=tmp_path, timeout=300)
    assert result.returncode == 2 and "bad.jsonl.gz" in result.stderr, result.stderr
    assert "stage prep failed" in "\n".join(printed(result.stdout))  # the events were printed before they went
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.jsonl.gz"]  # no runs/<time>-<model>, no runs/

    earlier = tmp_path / "runs" / "earlier"
    earlier.mkdir(parents=True)
    os.symlink("earlier", tmp_path / "runs" / "latest")
    args = ("run", "--headless", "--corpus", "bad.jsonl.gz", *SMALL, "--run-dir", "runs/new")
    result = run_appliance(*args, cwd=tmp_path, timeout=300)
    assert result.returncode == 2, result.stderr
    assert sorted(p.name for p in (tmp_path / "runs").iterdir()) == ["earlier", "latest"]
    assert os.readlink(tmp_path / "runs" / "latest") == "earlier"


def test_a_failed_run_keeps_a_run_directory_it_did_not_make_or_that_holds_a_prepared_corpus(prepared, tmp_path):
    """Control: the clean-up takes only a run directory this command made and nothing was prepared in."""
    from appliance.head_run import discard_if_unprepared, folders_to_make
    from appliance.rundir import RunDir

    cwd, _ = prepared
    run_dir = RunDir(cwd / "runs" / "r")
    assert not discard_if_unprepared(run_dir, [run_dir.root])  # made by this command, but its corpus is prepared
    assert not discard_if_unprepared(run_dir, [])  # not made by this command
    fresh = tmp_path / "runs" / "fresh"
    made = folders_to_make(fresh)
    assert made == [fresh, tmp_path / "runs"]
    RunDir(fresh).make()
    (fresh / "plan.json").write_text("{}")
    assert discard_if_unprepared(RunDir(fresh), made) and not (tmp_path / "runs").exists()
    assert run_dir.plan.exists()
