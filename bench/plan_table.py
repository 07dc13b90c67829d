"""The sizing table of docs/PLANNER.md: what `plan` picks for the sample corpus and corpora of 1 GB, 100 GB and
1.6 TB on a CPU box, 1 x H100, 8 x H100 and the 384-GPU Jean Zay profile, with the limit that bound each.

Each cell is `./bloom_appliance.py plan --hardware HW --corpus-tokens N [--budget 10m] --json`, called in-process
through the same make_plan. Corpus bytes become tokens at 4.6 bytes per token, ROOTS' own ratio (1.61 TB of text,
about 350B tokens with BLOOM's tokenizer). The sample corpus is the data stage's own count: 2,532,916 tokens with
the CPU model's 8,192-entry tokenizer, 2,434,926 with the 9,728 entries `run` sizes for its 8,617,538 prepared bytes
on GPUs (`run --prepare-only`, data/datasets.json and corpus/prep_report.json), and on GPUs its default 10-minute
smoke budget applies, as `run` applies it.

    .venv/bin/python bench/plan_table.py
"""

from __future__ import annotations

import sys
from pathlib import Path

# bench/ holds a tokenize.py that would shadow the standard library's: keep bench/ off the import path and put
# the repository root on it.
_HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _HERE]
sys.path.insert(0, str(_HERE.parent))

from appliance.hardware import load_hardware  # noqa: E402
from appliance.planner import Budget, make_plan  # noqa: E402
from appliance.planner.sizing import SMOKE_BUDGET_S, duration_text, tokens_text  # noqa: E402
from appliance.planner.vocabulary import BYTES_PER_TOKEN  # noqa: E402

HARDWARE = ("cpu-laptop-2core", "h100-sxm5-x1", "h100-sxm5-x8-node", "jean-zay-a100-48n")
CORPORA = (("sample (3 MB)", None), ("1 GB", 1e9), ("100 GB", 100e9), ("1.6 TB", 1.6e12))
SAMPLE_TOKENS = {False: 2_532_916, True: 2_434_926}  # by hardware.has_gpus: the tokenizer differs
SAMPLE_BYTES = 8_617_538  # what prep keeps of the sample corpus: the vocabulary is sized on it


def cell(hw_name: str, corpus_bytes: float | None) -> list[str]:
    hw = load_hardware(hw_name)
    if corpus_bytes is None:
        budget = Budget(
            seconds=SMOKE_BUDGET_S if hw.has_gpus else None,
            corpus_tokens=SAMPLE_TOKENS[hw.has_gpus],
            corpus_bytes=SAMPLE_BYTES,
            languages=12,
        )
    else:
        budget = Budget(corpus_tokens=int(corpus_bytes / BYTES_PER_TOKEN))
    plan = make_plan(hw, budget=budget)
    tokens = plan.train.train_samples * plan.train.seq_len
    assert budget.corpus_tokens is not None
    return [
        plan.model.name,
        f"{plan.train.steps_at_full_batch:,} x {plan.train.global_batch_size}",
        tokens_text(tokens),
        f"{tokens / budget.corpus_tokens:.2g}",
        duration_text(plan.run.time_s),
        str(plan.run.limit),
    ]


def main() -> None:
    print("| hardware | corpus | model | steps x batch | tokens | epochs | time | limit |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for hw_name in HARDWARE:
        for label, corpus_bytes in CORPORA:
            print("| " + " | ".join([hw_name, label, *cell(hw_name, corpus_bytes)]) + " |")


if __name__ == "__main__":
    main()
