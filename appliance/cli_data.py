"""`prep`, `tokenizer` and `tokenize`: the data stages outside `run`."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from appliance.errors import BadInput
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
    report = prepare_corpus(
        args.input,
        args.out,
        workers=args.workers,
        strict=args.strict,
        work_dir=args.work_dir,
        follow_symlinks=args.follow_symlinks,
        force=args.force,
    )
    print(json.dumps(report.get("totals", report), indent=1, ensure_ascii=False))
    return 0


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
    from appliance.tokenizer.bpe import train_tokenizer

    if not args.corpus.is_dir():
        raise BadInput(f"--corpus {args.corpus}: not a prepared corpus directory")
    vocab_size, reasons = args.vocab_size, None
    if vocab_size is None:
        vocab_size, reasons = corpus_vocab_size(args.corpus)
        print(reasons[0])
    print(
        train_tokenizer(
            args.corpus, args.out, vocab_size=vocab_size, vocab_reasons=reasons, tp_size=args.tp, force=args.force
        )
    )
    return 0


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

    result = tokenize_corpus_dir(
        args.corpus,
        args.tokenizer,
        args.out,
        workers=args.workers,
        force=args.force,
        say=lambda line: print(line, file=sys.stderr, flush=True),
    )
    print(json.dumps(result, indent=1, ensure_ascii=False))
    return 0
