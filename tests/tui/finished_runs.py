"""A finished CPU run's directory, whole: the recorded run fixtures/cpu-2core (its events, plan.json and eval.json, as
the appliance wrote them) with the files the stages around its training leave beside them, small but of the shapes
the stages write: stages.json, the corpus's report, the tokenizer, the datasets' summary, the checkpoints, the
export and the folder's marker. summary.json is the real summarize() of its events. No training runs here.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from appliance.monitor.events import read_events
from appliance.monitor.summary import summarize
from appliance.output_dirs import MARKER
from appliance.rundir import RunDir

FIXTURES = Path(__file__).parent / "fixtures"
# The recording predates bits per byte: eval.json gains the figure the final evaluation writes now (train/
# validation.py), at the recorded loss's order (6.19 nats per token at ~3 bytes per token of this corpus).
FINAL_BITS_PER_BYTE = 2.9125
# The command line that made the run directory, as its marker records it: the resume command repeats its corpus.
COMMAND_LINE = "bloom_appliance.py run --headless --corpus en.jsonl fr.jsonl --model bloom-tiny-cpu --max-steps 12"
CORPUS_TOTALS = {"docs_in": 40, "docs_out": 32, "bytes_in": 212_000, "bytes_out": 181_500}
DATASET_TOKENS = {"en": 31_000, "fr": 29_500}
CHECKPOINT_STEPS = (3, 6, 9, 12)  # the recorded run's checkpoint events
VOCAB = 512


def finished_cpu_run(root: Path) -> RunDir:
    """The finished CPU run, copied to `root`."""
    shutil.copytree(FIXTURES / "cpu-2core", root)
    run = RunDir(root)
    final = json.loads(run.eval.read_text())
    run.eval.write_text(json.dumps({**final, "valid_bits_per_byte": FINAL_BITS_PER_BYTE}, indent=1))
    done = {e["name"]: e for e in read_events(run.metrics) if e["kind"] == "stage" and e["state"] == "done"}
    records = {n: {"key": "k", "outputs": "o", "seconds": e["seconds"], "done_t": e["t"]} for n, e in done.items()}
    run.manifest.write_text(json.dumps(records))
    run.corpus.mkdir()
    (run.corpus / "prep_report.json").write_text(json.dumps({"totals": {**CORPUS_TOTALS, "shards": ["s"]}}))
    run.tokenizer.mkdir()
    run.tokenizer_json.write_text("{}")
    (run.tokenizer / "fertility.json").write_text(json.dumps({"tokenizer": {"vocab_size_padded": VOCAB}}))
    run.data.mkdir()
    datasets = {lang: {"prefix": f"{lang}_text_document", "tokens": n} for lang, n in DATASET_TOKENS.items()}
    (run.data / "datasets.json").write_text(json.dumps(datasets))
    for step in CHECKPOINT_STEPS:
        (run.checkpoints / f"step-{step:08d}").mkdir(parents=True)
    (run.checkpoints / "latest").write_text(f"step-{CHECKPOINT_STEPS[-1]:08d}\n")
    run.export.mkdir()
    (run.export / "config.json").write_text("{}")
    (root / MARKER).write_text(json.dumps({"kind": "run", "command": COMMAND_LINE}))
    seconds = {name: record["seconds"] for name, record in records.items()}
    summary = summarize(run, state="done", wall_seconds=sum(seconds.values()), stage_seconds=seconds)
    run.summary.write_text(json.dumps(summary))
    return run
