"""What `prep`, `tokenizer` and `tokenize` print: a short summary for a person (read, kept, dropped by which filter,
where the output is, the next command), the JSON they printed before with `--json`, and their progress on stderr, a
line rewritten in place on a terminal and plain lines elsewhere (monitor/progress_line.py)."""

from __future__ import annotations

import contextlib
import gzip
import io
import json
import os
import pty
import sys

import pytest

from appliance import cli
from appliance.data.sample_corpus import SAMPLE_CORPUS_DIR
from appliance.monitor.progress_line import ERASE_TO_END, ProgressLine

COMMAND = "./bloom_appliance.py"
DOCUMENTS = 30


def run_cli(*args: object) -> tuple[str, str]:
    """The command in this process: (stdout, stderr), both plain files (not terminals)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = cli.main([str(a) for a in args])
    assert code == 0, err.getvalue()
    return out.getvalue(), err.getvalue()


@pytest.fixture(scope="module")
def made(tmp_path_factory: pytest.TempPathFactory) -> dict[str, object]:
    """Each command once as a person runs it and once with --json, on the sample corpus's first English documents."""
    root = tmp_path_factory.mktemp("data-commands")
    with gzip.open(SAMPLE_CORPUS_DIR / "en.jsonl.gz", "rt", encoding="utf-8") as f:
        texts = [json.loads(line)["text"] for _, line in zip(range(DOCUMENTS), f, strict=False)]
    (root / "in.jsonl").write_text("".join(json.dumps({"text": t, "lang": "en"}) + "\n" for t in texts))
    runs: dict[str, object] = {"root": root}
    for mode, flags in (("human", ()), ("json", ("--json",))):
        corpus, tokenizer, data = root / f"corpus-{mode}", root / f"tok-{mode}", root / f"data-{mode}"
        runs[f"prep-{mode}"] = run_cli("prep", "--input", root / "in.jsonl", "--out", corpus, "--workers", 1, *flags)
        runs[f"tokenizer-{mode}"] = run_cli("tokenizer", "--corpus", corpus, "--out", tokenizer, *flags)
        args = ("tokenize", "--corpus", corpus, "--tokenizer", tokenizer, "--out", data, "--workers", 1, *flags)
        runs[f"tokenize-{mode}"] = run_cli(*args)
    return runs


def test_prep_prints_a_summary_and_with_json_the_totals_it_printed_before(made) -> None:
    root = made["root"]
    out, _ = made["prep-human"]
    corpus = root / "corpus-human"
    totals = json.loads((corpus / "prep_report.json").read_text())["totals"]
    lines = out.splitlines()
    read = f"{DOCUMENTS} documents ({totals['bytes_in'] / 1e3:.1f} kB)"
    assert lines[0] == f"prep: read 1 file, {read} from {root}/in.jsonl"
    assert lines[1].startswith(f"kept {totals['docs_out']} documents") and lines[1].endswith(f": {corpus}")
    dropped = DOCUMENTS - totals["docs_out"]
    assert any(line.startswith(f"dropped {dropped}: ") for line in lines), out  # by filter, the largest first
    assert f"the full report: {corpus}/prep_report.md" in lines
    assert lines[-1] == f"next: {COMMAND} tokenizer --corpus {corpus} --out TOKENIZER"
    assert len(lines) <= 8
    # --json: the object prep printed before the summary existed (prep_report.json's totals), and nothing else.
    out, _ = made["prep-json"]
    assert json.loads(out) == json.loads((root / "corpus-json" / "prep_report.json").read_text())["totals"]
    assert json.loads(out)["docs_out"] == totals["docs_out"]


def test_tokenizer_prints_a_summary_and_with_json_the_path_it_printed_before_and_the_sizes(made) -> None:
    root = made["root"]
    out, _ = made["tokenizer-human"]
    lines = out.splitlines()
    assert lines[0].startswith("vocabulary: ")  # why this size, printed before the wait
    assert lines[1].startswith("tokenizer: ") and "learned from" in lines[1] and "in 1 language" in lines[1]
    assert lines[2].startswith("fertility: ")
    corpus, tokenizer = root / "corpus-human", root / "tok-human"
    assert lines[-1] == f"next: {COMMAND} tokenize --corpus {corpus} --tokenizer {tokenizer} --out DATA"
    out, _ = made["tokenizer-json"]
    printed = json.loads(out)
    sizes = json.loads((root / "tok-json" / "fertility.json").read_text())["tokenizer"]
    assert printed["tokenizer_json"] == str(root / "tok-json" / "tokenizer.json")  # what tokenizer printed before
    assert {k: printed[k] for k in sizes} == sizes and printed["fertility_ok"] in (True, False)


def test_tokenize_prints_a_summary_and_with_json_the_object_it_printed_before(made) -> None:
    root = made["root"]
    out, _ = made["tokenize-human"]
    datasets = json.loads((root / "data-human" / "datasets.json").read_text())
    documents = datasets["en"]["documents"]
    lines = out.splitlines()
    assert lines[0].startswith(f"tokenize: built 1 dataset in {root / 'data-human'}: {documents} documents, ")
    assert lines[1].startswith("tokens per language: en ") and lines[-1].startswith("next: Megatron-LM reads them")
    out, _ = made["tokenize-json"]
    datasets = json.loads((root / "data-json" / "datasets.json").read_text())
    assert json.loads(out) == {"state": "built", "datasets": datasets}


@pytest.mark.parametrize("command", ["prep", "tokenizer", "tokenize"])
def test_off_a_terminal_progress_is_plain_lines_on_stderr(made, command: str) -> None:
    _, err = made[f"{command}-human"]
    lines = [line for line in err.splitlines() if line.startswith(f"{command} ")]
    assert lines and lines[-1].startswith(f"{command} 100.0%"), err
    assert "\r" not in err and ERASE_TO_END not in err


def test_on_a_terminal_progress_is_one_line_rewritten_in_place(made, monkeypatch: pytest.MonkeyPatch) -> None:
    """prep with its stderr on a pseudo-terminal, as a person's shell gives it."""
    master, slave = pty.openpty()
    terminal = os.fdopen(slave, "w", encoding="utf-8")
    monkeypatch.setattr(sys, "stderr", terminal)
    root = made["root"]
    with contextlib.redirect_stdout(io.StringIO()):
        assert cli.main(["prep", "--input", str(root / "in.jsonl"), "--out", str(root / "tty"), "--workers", "1"]) == 0
    terminal.flush()
    shown = b""
    os.set_blocking(master, False)
    with contextlib.suppress(BlockingIOError):
        while chunk := os.read(master, 65536):
            shown += chunk
    terminal.close()
    os.close(master)
    text = shown.decode().replace("\r\n", "\n")  # the terminal's line discipline writes a newline as \r\n
    assert text.endswith("\n") and text.count("\n") == 1, text  # one line on screen, finished once prep is
    draws = text[:-1].split("\r")[1:]
    assert len(draws) >= 2 and all(d.startswith("prep ") and d.endswith(ERASE_TO_END) for d in draws), text
    assert draws[-1].startswith("prep 100.0%")


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_plain_progress_lines_come_every_interval_with_the_time_left() -> None:
    """The first report, then one per interval, and the last: a day-long prep logs a line per 10 s, not per file."""
    clock, stream = Clock(), io.StringIO()
    progress = ProgressLine("prep", stream, every_s=10.0, clock=clock)
    for second in range(0, 30):
        clock.now = float(second)
        progress(second / 40, f"file {second}")
    clock.now = 40.0
    progress(1.0, "done")
    lines = stream.getvalue().splitlines()
    assert [line.split("%  ")[1].split("  (")[0] for line in lines] == ["file 0", "file 10", "file 20", "done"]
    # At 25 % after 10 s, the rest takes 30 s more.
    assert lines[1] == "prep  25.0%  file 10  (10s, about 30s left)" and lines[-1] == "prep 100.0%  done  (40s)"
