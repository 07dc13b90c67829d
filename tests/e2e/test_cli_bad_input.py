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


PARAGRAPHS = (  # plain English that passes every ROOTS filter
    "The old lighthouse keeper climbed the narrow stairs every evening to light the lamp. He had done this for "
    "forty years, through storms and calm nights alike, and he knew every creak of the wooden steps. When the "
    "ships passed safely along the rocky coast, he felt that his quiet work had meaning.",
    "In the spring the farmers of the valley plant their seeds as soon as the frost has gone. They watch the sky "
    "for rain and talk about the weather at the market on Saturday mornings. By the end of summer the fields are "
    "golden, and the whole village helps to bring the harvest in before the autumn storms.",
    "Our library opens at nine in the morning and closes at six in the evening, except on public holidays. "
    "Visitors may borrow up to five books at a time for three weeks. If you need more time, you can renew them "
    "at the front desk or on the website, as long as nobody else has asked for the same book.",
    "A good loaf of bread needs only flour, water, salt and yeast, but it also needs patience. The dough should "
    "rise slowly in a warm kitchen until it has doubled in size. Then it is shaped by hand, left to rest again, "
    "and baked in a hot oven until the crust is brown and sounds hollow when you tap it.",
)


def test_prep_goes_past_a_nul_file_and_a_binary_file_and_strict_names_the_byte(tmp_path):
    """Lenient `prep` keeps the NUL file's text less its NULs and every good record, skips the binary file, and
    reports both; `prep --strict` stops at the first NUL, naming the file, line and byte offset."""
    root = tmp_path / "in"
    root.mkdir()
    nul_at = PARAGRAPHS[0].index(" He had")
    (root / "a_nul.txt").write_bytes(PARAGRAPHS[0][:nul_at].encode() + b"\x00" * 64 + PARAGRAPHS[0][nul_at:].encode())
    (root / "b_binary.txt").write_bytes(bytes(range(256)) * 64)
    good = "".join(json.dumps({"text": p, "lang": "en"}) + "\n" for p in PARAGRAPHS[1:]) + "{not json\n"
    (root / "c_good.jsonl").write_text(good)

    result = run_cli(["prep", "--input", "in", "--out", "corpus", "--json"], tmp_path)
    assert result.returncode == 0, result.stderr
    totals = json.loads(result.stdout)
    assert (totals["docs_out"], totals["files_skipped"], totals["chars_removed"]) == (4, 1, 64)
    docs = [json.loads(line) for line in (tmp_path / "corpus" / "shard-00000.jsonl").read_text().splitlines()]
    assert [d["text"] for d in docs] == list(PARAGRAPHS)
    report = json.loads((tmp_path / "corpus" / "prep_report.json").read_text())
    assert [(f["file"], f["reason"]) for f in report["skipped_files"]] == [("in/b_binary.txt", "not_utf8_file")]
    assert {r: v["count"] for r, v in report["skipped"].items()} == {"bad_json": 1, "not_utf8_file": 1}
    assert report["removed_characters"]["nul"] == {
        "chars": 64,
        "docs": 1,
        "examples": [{"file": "in/a_nul.txt", "line": 1, "offset": 0, "chars": 64}],
    }
    markdown = (tmp_path / "corpus" / "prep_report.md").read_text()
    assert "| in/b_binary.txt | not_utf8_file |" in markdown and "| nul | 64 | 1 |" in markdown

    result = run_cli(["prep", "--input", "in", "--out", "strict", "--strict"], tmp_path)
    assert result.returncode == 2
    assert f"in/a_nul.txt: line 1, byte offset {nul_at}: nul bytes" in result.stderr
    assert not (tmp_path / "strict").exists() and not (tmp_path / ".strict.prep-work").exists()
