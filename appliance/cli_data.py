"""`prep`, `tokenizer` and `tokenize`: the data stages outside `run`.

Each prints a short summary on stdout (what it read, kept and dropped, where the output is, the next command), or
with `--json` one JSON object (the one these commands printed before the summary existed: scripts that parse it
keep working with the flag). Progress goes to stderr (monitor/progress_line.py): one line rewritten in place on a
terminal, a plain line every 10 s elsewhere.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path
from typing import Any

from appliance.errors import BadInput
from appliance.monitor.closing import COMMAND
from appliance.monitor.headless import fmt_bytes, fmt_si
from appliance.monitor.progress_line import ProgressLine
from appliance.output_dirs import claim_dir


def cmd_prep(args: argparse.Namespace) -> int:
    from appliance.data.prep import prepare_corpus, run_step
    from appliance.data.prep_work import parse_slice
    from appliance.run_request import check_inputs

    check_inputs(args.input)
    if args.sbatch:
        return _write_prep_scripts(args)
    if args.slice and not args.step:
        raise BadInput("--slice needs --step read or --step filter")
    if args.step:
        part = parse_slice(args.slice) if args.slice else None
        done = run_step(
            args.step,
            args.input,
            args.out,
            work_dir=args.work_dir,
            part=part,
            workers=args.workers,
            strict=args.strict,
            follow_symlinks=args.follow_symlinks,
            force=args.force,
        )
        print(json.dumps(done, indent=1, ensure_ascii=False))
        return 0
    with ProgressLine("prep") as progress:
        report = prepare_corpus(
            args.input,
            args.out,
            workers=args.workers,
            strict=args.strict,
            work_dir=args.work_dir,
            follow_symlinks=args.follow_symlinks,
            force=args.force,
            on_progress=progress,
        )
    if args.json:
        print(json.dumps(report.get("totals", report), indent=1, ensure_ascii=False))
    else:
        print("\n".join(prep_summary(report, args.out)))
    return 0


def prep_summary(report: dict[str, Any], out: Path) -> list[str]:
    """What prep read, kept and dropped (by which filter, the largest first), where it is, and the next command."""
    t = report["totals"]
    lines = [
        f"prep: read {_count(report['files_read'], 'file')}, {_count(t['docs_in'], 'document')}"
        f" ({fmt_bytes(t['bytes_in'])}) from {', '.join(report['inputs'])}",
        f"kept {_count(t['docs_out'], 'document')} ({fmt_bytes(t['bytes_out'])}) in {_count(len(t['shards']), 'shard')}"
        f" of {_count(len(report['languages']), 'language')}: {out}",
    ]
    dropped = sorted(
        ((s["name"], s["docs_in"] - s["docs_out"]) for s in report["stages"] if s["docs_in"] > s["docs_out"]),
        key=lambda item: -item[1],
    )
    if dropped:
        total = sum(count for _, count in dropped)
        lines.append(f"dropped {total:,}: " + ", ".join(f"{name} {count:,}" for name, count in dropped))
    skipped = {reason: v["count"] for reason, v in report.get("skipped", {}).items()}
    problems = [f"skipped {_counts(skipped)}"] if skipped else []
    problems += [f"{t['files_skipped']:,} files gave no document"] if t["files_skipped"] else []
    problems += [f"{t['chars_removed']:,} control characters removed"] if t["chars_removed"] else []
    if problems:
        lines.append("; ".join(problems))
    lines.append(f"the full report: {out / 'prep_report.md'}")
    lines.append(f"next: {COMMAND} tokenizer --corpus {shlex.quote(str(out))} --out TOKENIZER")
    return lines


def _count(n: int, noun: str) -> str:
    """1 file, 12 files."""
    return f"{n:,} {noun}{'' if n == 1 else 's'}"


def _counts(counts: dict[str, int]) -> str:
    return ", ".join(f"{name} {count:,}" for name, count in sorted(counts.items(), key=lambda item: -item[1]))


def _write_prep_scripts(args: argparse.Namespace) -> int:
    from appliance.data.prep import claim_output, count_units
    from appliance.data.prep_slurm import (
        BATCH_NAME,
        SUBMIT_NAME,
        PrepJob,
        default_array_size,
        default_script_dir,
        write_scripts,
    )

    if args.step or args.slice:
        raise BadInput("--sbatch writes the scripts for every step; leave out --step and --slice")
    if args.force:
        raise BadInput("--force: not with --sbatch (the jobs run without it); give a new or empty --out")
    claim_output(args.input, args.out)  # refused now rather than in the finish job, hours later
    script_dir = args.script_dir or default_script_dir(args.out)
    # The scripts' folder also receives the jobs' logs/ (submit.sh makes it): the rerun recognises it as its own.
    scripts = claim_dir(
        script_dir,
        "prep --sbatch",
        flag="--script-dir",
        inputs={"--input": args.input, "--out": [args.out]},
        writes=(BATCH_NAME, SUBMIT_NAME),
    )
    job = PrepJob(
        inputs=args.input,
        out_dir=args.out,
        script_dir=script_dir,
        array_size=args.array_size
        or default_array_size(count_units(args.input, strict=args.strict, follow_symlinks=args.follow_symlinks)),
        cwd=Path.cwd(),
        work_dir=args.work_dir,
        strict=args.strict,
        follow_symlinks=args.follow_symlinks,
        cpus_per_task=args.cpus_per_task,
        time_limit=args.time,
        partition=args.partition,
        account=args.account,
    )
    scripts.begin([BATCH_NAME, SUBMIT_NAME])
    submit = write_scripts(job)
    scripts.mark([BATCH_NAME, SUBMIT_NAME])
    print(f"wrote {submit} and {submit.parent / 'prep.sbatch'}: read and filter as arrays of {job.array_size} tasks")
    print(f"submit with: bash {submit}   (run it again to resume after a failure)")
    return 0


def cmd_tokenizer(args: argparse.Namespace) -> int:
    from appliance.tokenizer.bpe import FERTILITY_JSON, train_tokenizer

    if not args.corpus.is_dir():
        raise BadInput(f"--corpus {args.corpus}: not a prepared corpus directory")
    vocab_size, reasons = args.vocab_size, None
    if vocab_size is None:
        vocab_size, reasons = corpus_vocab_size(args.corpus)
        if not args.json:
            print(reasons[0], flush=True)  # why this size, before the wait
    with ProgressLine("tokenizer") as progress:
        tokenizer_json = train_tokenizer(
            args.corpus,
            args.out,
            vocab_size=vocab_size,
            vocab_reasons=reasons,
            tp_size=args.tp,
            force=args.force,
            on_progress=progress,
        )
    report = json.loads((args.out / FERTILITY_JSON).read_text(encoding="utf-8"))
    if args.json:
        fertility = {"fertility_ok": report.get("ok"), "fertility_flagged": report.get("flagged")}
        print(json.dumps({"tokenizer_json": str(tokenizer_json), **report["tokenizer"], **fertility}, indent=1))
    else:
        print("\n".join(tokenizer_summary(report, args.corpus, args.out)))
    return 0


def tokenizer_summary(report: dict[str, Any], corpus: Path, out: Path) -> list[str]:
    """The tokenizer's size, what it learned from, its fertility check, where it is and the next command."""
    sizes = report["tokenizer"]
    sampled, read = sum(sizes["sample_bytes_per_lang"].values()), sum(sizes["corpus_bytes_per_lang"].values())
    languages = report.get("languages") or {}
    padded = sizes["vocab_size_padded"]
    padding = f", padded to {padded:,} for TP {sizes['tp_size']}" if padded != sizes["vocab_size_trained"] else ""
    lines = [
        f"tokenizer: {sizes['vocab_size_trained']:,} entries{padding}, learned from {fmt_bytes(sampled)} sampled out"
        f" of {fmt_bytes(read)} in {_count(len(languages), 'language')}",
    ]
    worst = max(languages.items(), key=lambda item: item[1].get("points_worse", 0.0), default=None)
    if report.get("flagged"):
        lines.append(
            f"fertility: {', '.join(report['flagged'])} more than {report['threshold_points']:g} points worse than a"
            f" tokenizer of that language alone (fertility.json)"
        )
    elif worst is not None:
        name, figures = worst
        points = figures["points_worse"]
        than = f"{abs(points):.1f} points {'worse' if points > 0 else 'better'}"
        lines.append(
            f"fertility: every language within {report['threshold_points']:g} points of a tokenizer of its own"
            f" (the worst, {name}: {figures['fertility']:.2f} tokens per word, {than})"
        )
    lines.append(f"wrote {out / 'tokenizer.json'}, tokenizer_config.json and fertility.json")
    quoted = shlex.quote(str(corpus)), shlex.quote(str(out))
    lines.append(f"next: {COMMAND} tokenize --corpus {quoted[0]} --tokenizer {quoted[1]} --out DATA")
    return lines


def corpus_vocab_size(corpus_dir: Path) -> tuple[int, list[str]]:
    """The vocabulary `run` would size for this prepared corpus (planner/vocabulary.py: its prep_report.json's bytes,
    at most BLOOM's 250,680 entries), and the reason, for fertility.json."""
    from appliance.data.prep import REPORT_JSON
    from appliance.planner.vocabulary import vocab_for_corpus
    from appliance.tokenizer.vocab import BLOOM_VOCAB

    report_path = corpus_dir / REPORT_JSON
    try:
        corpus_bytes = int(json.loads(report_path.read_text())["totals"]["bytes_out"])
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise BadInput(f"{report_path}: cannot read the prepared corpus's size ({e}); pass --vocab-size N") from None
    choice = vocab_for_corpus(BLOOM_VOCAB, corpus_bytes=corpus_bytes)
    return choice.size, [f"vocabulary: {choice.reason}"]


def cmd_tokenize(args: argparse.Namespace) -> int:
    from appliance.data.tokenize_command import tokenize_corpus_dir

    with ProgressLine("tokenize") as progress:
        result = tokenize_corpus_dir(
            args.corpus,
            args.tokenizer,
            args.out,
            workers=args.workers,
            force=args.force,
            say=lambda line: print(line, file=sys.stderr, flush=True),
            on_progress=progress,
        )
    if args.json:
        print(json.dumps(result, indent=1, ensure_ascii=False))
    else:
        print("\n".join(tokenize_summary(result, args.out)))
    return 0


def tokenize_summary(result: dict[str, Any], out: Path) -> list[str]:
    """The datasets' documents and tokens, per language in one line, where they are and what reads them."""
    datasets = result["datasets"]
    entries = list(datasets.values())
    documents, tokens = sum(e["documents"] for e in entries), sum(e["tokens"] for e in entries)
    done = "built" if result["state"] == "built" else "up to date (nothing to do):"
    ids = f" ({entries[0]['dtype']} ids, vocabulary {entries[0]['vocab_size']:,})" if entries else ""
    return [
        f"tokenize: {done} {_count(len(datasets), 'dataset')} in {out}: {_count(documents, 'document')},"
        f" {fmt_si(tokens)} tokens{ids}",
        "tokens per language: " + ", ".join(f"{lang} {fmt_si(e['tokens'])}" for lang, e in datasets.items()),
        f"next: Megatron-LM reads them (--data-path {shlex.quote(str(out))}/<lang>_text_document; datasets.json lists"
        " each one's tokens), as `run` reads its data/",
    ]
