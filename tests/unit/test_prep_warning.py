"""A run whose lenient prep went past an unreadable file says so in its events (the dashboard and the headless log
show warnings), naming the file and the reason, and still prepares everything else."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

from appliance.data.prep_report import skipped_input_warning
from appliance.data.sample_corpus import SAMPLE_CORPUS_DIR
from appliance.head_run import run
from appliance.run_request import RunRequest


def test_the_message_names_every_file_up_to_a_limit() -> None:
    skipped = [{"file": f"in/{i}.bin", "reason": "not_utf8_file"} for i in range(7)]
    message = skipped_input_warning({"skipped_files": skipped}, listed=2)
    assert message is not None
    assert message.startswith("prep skipped 7 input file(s)")
    assert "in/0.bin (not_utf8_file), in/1.bin (not_utf8_file) and 5 more" in message
    assert skipped_input_warning({"skipped_files": []}) is None


def test_a_run_warns_about_a_skipped_file_and_keeps_the_rest(tmp_path: Path) -> None:
    corpus = tmp_path / "in"
    corpus.mkdir()
    # The real English documents from the sample corpus: enough to pass the filters and train a tokenizer quickly.
    with gzip.open(SAMPLE_CORPUS_DIR / "en.jsonl.gz", "rt") as f:
        (corpus / "good.jsonl").write_text(f.read())
    (corpus / "garbage.txt").write_bytes(bytes(range(256)) * 64)
    run_dir = tmp_path / "run"
    code = run(
        RunRequest(
            corpus=[corpus], run_dir=run_dir, hardware="cpu-laptop-2core", model="bloom-micro-test", prepare_only=True
        )
    )
    assert code == 0
    events = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    warnings = [e["message"] for e in events if e["kind"] == "warning"]
    assert any("prep skipped 1 input file(s)" in w and "garbage.txt (not_utf8_file)" in w for w in warnings), warnings
    report = json.loads((run_dir / "corpus" / "prep_report.json").read_text())
    assert report["totals"]["files_skipped"] == 1 and report["totals"]["docs_out"] > 0
