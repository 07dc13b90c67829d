"""Bad input: exit code 2, a message naming the problem, nothing written outside the run directory."""

import gzip
import json
from pathlib import Path

import pytest
from appliance_cli import run_appliance


def run_cli(args, cwd):
    return run_appliance(*args, cwd=cwd, timeout=300)


def files_under(path: Path) -> set[str]:
    return {str(p.relative_to(path)) for p in path.rglob("*")}


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["run", "--headless", "--corpus", "no/such/file.txt"], "no/such/file.txt"),
        (["run", "--headless", "--set", "lrr=1"], "lrr"),
        (["run", "--headless", "--model", "bloom-9000b"], "bloom-9000b"),
        (["run", "--headless", "--max-steps", "0"], "--max-steps"),
        (["plan", "--layout", "tp=3,pp=1"], "tp"),
        (["export", "--run-dir", "nowhere", "--out", "x"], "nowhere"),
        (["train", "--run-dir", "nowhere"], "nowhere"),
    ],
)
def test_bad_usage_exits_2_naming_the_problem_and_writes_nothing(tmp_path, args, message):
    result = run_cli(args, tmp_path)
    assert result.returncode == 2, result.stderr
    assert message in result.stderr
    assert files_under(tmp_path) == set()


def _corpus_error(tmp_path, name, content: bytes):
    corpus = tmp_path / "in" / name
    corpus.parent.mkdir()
    corpus.write_bytes(content)
    before = corpus.read_bytes()
    result = run_cli(["run", "--headless", "--corpus", str(corpus), "--run-dir", "runs/r"], tmp_path)
    assert corpus.read_bytes() == before  # inputs are never modified
    outside = {p for p in files_under(tmp_path) if not p.startswith(("runs/r", "in"))} - {"runs"}
    assert outside == set(), outside
    return result


def test_empty_corpus_exits_2(tmp_path):
    result = _corpus_error(tmp_path, "empty.txt", b"")
    assert result.returncode == 2, result.stderr
    assert "empty.txt" in result.stderr


def test_non_utf8_corpus_exits_2_naming_the_file(tmp_path):
    latin1 = "Le cœur a ses raisons que la raison ne connaît point. Àçéèêëîïôùûü.\n".encode("latin-1", "replace")
    result = _corpus_error(tmp_path, "latin1.txt", latin1 * 200)
    assert result.returncode == 2, result.stderr
    assert "latin1.txt" in result.stderr and "UTF-8" in result.stderr


def test_all_bad_jsonl_exits_2(tmp_path):
    data = gzip.compress(b"{not json\n" * 50)
    result = _corpus_error(tmp_path, "bad.jsonl.gz", data)
    assert result.returncode == 2, result.stderr
    assert "bad.jsonl.gz" in result.stderr


def test_good_jsonl_is_not_rejected_by_validation(tmp_path):
    """Control for the cases above: a plan for valid input gets past validation (checked with `plan`)."""
    result = run_cli(["plan", "--json"], tmp_path)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["feasible"] is True
