"""Command line: parses, validates, dispatches. No logic of its own (docs/ARCHITECTURE.md, "Commands")."""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import threading
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from appliance import __version__
from appliance.planner.runspec import MAX_DATA_WORKERS
from appliance.planner.train_settings import DTYPES
from appliance.rundir import RunDir
from appliance.train.runlock import own_run_dir, refuse_if_live

if TYPE_CHECKING:
    from appliance.head_run import RunRequest
    from appliance.train.nodes import NodeGroup

from appliance.errors import EXIT_BAD_INPUT, EXIT_FAILED, EXIT_PREEMPTED, BadInput

DEFAULT_LOG_FORMAT = "text"
DEBUG_HELP = "on an error, print the full traceback before the one-line message (exit codes stay the same)"
# Flags of the program itself, accepted before the command (`--debug run ...`) and, for --debug, after it too.
GLOBAL_FLAGS = ("--debug",)
BUDGET_HELP = (
    "wall time, e.g. 45m, 6h or 2d: plan the largest model and token count that finish in it (default: a 10-minute"
    " smoke run for the sample corpus on GPUs; else 20 tokens per parameter, at most 4 epochs, within 120 days)"
)


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Appends "(default: X)" where there is a default to show and the help does not already say it."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        default = action.default
        if default is None or default is False or default == [] or default == argparse.SUPPRESS:
            return action.help
        if action.help and "default" in action.help:
            return action.help
        return super()._get_help_string(action)


class _VersionAction(argparse.Action):
    """--version: the project's version and the versions a bug report needs, read from package metadata (no import
    of torch or DeepSpeed, so it answers at once)."""

    def __init__(self, option_strings: list[str], dest: str = argparse.SUPPRESS, help: str | None = None) -> None:
        super().__init__(option_strings, dest=dest, default=argparse.SUPPRESS, nargs=0, help=help)

    def __call__(self, parser: argparse.ArgumentParser, *_: object) -> None:
        from importlib.metadata import PackageNotFoundError, version

        def installed(dist: str) -> str:
            try:
                return version(dist)
            except PackageNotFoundError:
                return "not installed"

        print(
            f"bloom-appliance {__version__} (torch {installed('torch')}, deepspeed {installed('deepspeed')},"
            f" python {platform.python_version()})"
        )
        parser.exit()


def _add_run(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("run", help="run every stage (default: on the embedded sample corpus)")
    p.add_argument("--corpus", type=Path, nargs="+", help="files or directories (.txt, .jsonl[.gz|.zst], .parquet)")
    p.add_argument("--run-dir", type=Path, help="run directory (default: runs/<time>-<model>)")
    p.add_argument("--model", help="model preset name or TOML file (default: the largest that fits the budget)")
    p.add_argument("--hardware", help="plan for a hardware profile instead of the detected machine")
    p.add_argument("--headless", action="store_true", help="no dashboard: progress lines and events on stdout")
    p.add_argument(
        "--log-format", choices=["text", "json"], default=DEFAULT_LOG_FORMAT, help="headless progress lines or events"
    )
    p.add_argument("--max-steps", type=int, help="stop after N optimizer steps")
    p.add_argument("--budget", help=BUDGET_HELP)
    p.add_argument("--prepare-only", action="store_true", help="stop after plan, prep, tokenizer and data")
    p.add_argument("--layout", help="train at this layout instead of the planner's choice, e.g. tp=1,pp=2,dp=2,ep=2")
    _add_set(p, "override a training setting (e.g. lr=3e-4); unknown keys are an error; " + SET_RESUMED_HELP)
    _add_nodes(p)


def _add_nodes(p: argparse.ArgumentParser) -> None:
    """Several machines without SLURM (appliance/train/nodes.py): the same command on every node."""
    g = p.add_argument_group("several nodes without SLURM (the run directory on a shared file system)")
    g.add_argument(
        "--nnodes",
        metavar="N|MIN:MAX",
        help="machines in the run; each starts tp*pp*dp/N ranks (MIN:MAX: tp*pp*dp/MAX each, and the run goes on"
        " with as few as MIN, re-planned with a smaller dp, when a node is lost; --hostfile: MAX is its line count)",
    )
    g.add_argument("--node-rank", type=int, metavar="R", help="this machine's place, 0..N-1 (0 hosts the rendezvous)")
    g.add_argument(
        "--master",
        metavar="HOST:PORT",
        help="the rendezvous, on node 0; it listens on HOST only (0.0.0.0 only if written so)",
    )
    g.add_argument(
        "--hostfile",
        type=Path,
        metavar="FILE",
        help="one host a line: N is the line count, the first host the master (port 29500 unless --master),"
        " this machine's line its rank unless --node-rank",
    )
    g.add_argument(
        "--spares",
        type=int,
        default=0,
        metavar="K",
        help="K more machines (node ranks N..N+K-1, or the hostfile's last K lines) stand by, idle, and take a lost"
        " node's ranks: the run goes on at the plan's layout (default: %(default)s)",
    )
    g.add_argument(
        "--store-elsewhere",
        action="store_true",
        help="the rendezvous store at --master runs on a machine that does not train (`python -m"
        " appliance.train.nodes --host-store HOST:PORT` there): node 0's loss then does not end the run",
    )


def _nodes(args: argparse.Namespace) -> NodeGroup | None:
    from appliance.train.nodes import node_group, parse_nnodes

    min_nodes, nnodes = parse_nnodes(args.nnodes)
    return node_group(
        nnodes=nnodes,
        node_rank=args.node_rank,
        master=args.master,
        hostfile=args.hostfile,
        min_nodes=min_nodes,
        spares=args.spares,
        store_elsewhere=args.store_elsewhere,
    )


# --set on a run that has started: only the keys planner/train_settings.py lets change mid-run.
SET_RESUMED_HELP = (
    "on a run that has started, only the keys that may change mid-run (lr, min_lr, decay_samples, intervals,"
    " eval limits, timeouts; see README), recorded as a `settings` event; others exit 2 with the reason"
)


def _add_set(p: argparse.ArgumentParser, help: str) -> None:
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE", help=help)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="bloom_appliance.py",
        description="Config-free BLOOM training: detect, plan, prepare, tokenize, train, evaluate, export.",
        formatter_class=_HelpFormatter,
    )
    parser.add_argument(
        "--version", action=_VersionAction, help="print the versions of bloom-appliance, torch, DeepSpeed and Python"
    )
    parser.add_argument("--debug", action="store_true", help=DEBUG_HELP)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", help="what to do (default: run)")
    _add_run(sub)

    p = sub.add_parser("detect", help="show the detected hardware")
    p.add_argument("--json", action="store_true", help="one JSON object (the hardware profile's keys)")

    p = sub.add_parser("plan", help="plan the parallel layout with the cost model")
    p.add_argument("--hardware", help="hardware profile name or TOML file (default: detect)")
    p.add_argument("--model", help="model preset name or TOML file (default: the model ladder picks)")
    p.add_argument("--global-batch-size", type=int, help="samples per optimizer step (default: the model's recipe)")
    p.add_argument("--seq-len", type=int, help="tokens per sample (default: the model's)")
    p.add_argument("--layout", help="evaluate this layout, e.g. tp=4,pp=12,dp=8,mbs=2[,zero=1][,recompute=full]")
    p.add_argument(
        "--precision",
        choices=DTYPES,
        help="plan in this precision (default: bf16 on GPUs that have it, fp16 on V100-class, fp32 on CPU)",
    )
    p.add_argument("--budget", help=BUDGET_HELP)
    p.add_argument("--corpus-tokens", type=int, help="size the plan for a corpus of N tokens (run counts its own)")
    p.add_argument(
        "--spares",
        type=int,
        default=0,
        metavar="K",
        help="hot spare nodes the run would have (run|train --spares K), for the expected cost of failures"
        " (default: %(default)s)",
    )
    p.add_argument("--json", action="store_true", help="one JSON object: layout, estimate, rejected alternatives")

    p = sub.add_parser("prep", help="clean, filter, deduplicate and redact a corpus")
    p.add_argument("--input", type=Path, nargs="+", required=True, help="files or directories to prepare")
    p.add_argument("--out", type=Path, required=True, help="the prepared corpus directory (shards and report)")
    p.add_argument("--workers", type=int, default=os.cpu_count() or 1, help="worker processes (default: CPU count)")
    p.add_argument("--strict", action="store_true", help="stop at the first bad record (file, line, byte offset)")
    p.add_argument("--work-dir", type=Path, help="resumable per-unit work (default: .<out>.prep-work beside --out)")
    p.add_argument("--step", choices=["read", "templates", "filter", "finish"], help="run one step (SLURM jobs do)")
    p.add_argument("--slice", help="I/N: with --step read or filter, this array task's share of the work units")
    p.add_argument("--sbatch", action="store_true", help="write SLURM scripts (job arrays) instead of running")
    p.add_argument("--array-size", type=int, help="with --sbatch: tasks per array (default: units, at most 64)")
    p.add_argument("--cpus-per-task", type=int, default=8, help="with --sbatch: worker processes per task")
    p.add_argument("--time", default="04:00:00", help="with --sbatch: time limit per job, [D-]HH:MM:SS")
    p.add_argument("--partition", help="with --sbatch")
    p.add_argument("--account", help="with --sbatch")
    p.add_argument("--script-dir", type=Path, help="with --sbatch: where to write (default: <out>.prep-slurm)")

    p = sub.add_parser("tokenize", help="Megatron .bin/.idx datasets from a prepared corpus, outside `run`")
    p.add_argument("--corpus", type=Path, required=True, help="a directory `prep` wrote (shard-*.jsonl)")
    p.add_argument("--tokenizer", type=Path, required=True, help="a tokenizer.json, or a directory holding one")
    p.add_argument("--out", type=Path, required=True, help="where <lang>_text_document.bin/.idx and datasets.json go")
    p.add_argument(
        "--workers",
        type=int,
        default=min(os.cpu_count() or 1, MAX_DATA_WORKERS),
        help="tokenizer processes (default: as `run`'s data stage, min(CPU count, 8))",
    )
    p.add_argument(
        "--force", action="store_true", help="write into a non-empty --out that is not an earlier tokenize output"
    )

    p = sub.add_parser("tokenizer", help="train BLOOM's byte-level BPE tokenizer on a prepared corpus")
    p.add_argument("--corpus", type=Path, required=True, help="a directory `prep` wrote")
    p.add_argument("--out", type=Path, required=True, help="where tokenizer.json and fertility.json go")
    p.add_argument("--vocab-size", type=int, default=250_680, help="BLOOM's, before padding for tensor parallelism")
    p.add_argument("--tp", type=int, default=1, help="pad the vocabulary to a multiple of 128 x TP")

    p = sub.add_parser("train", help="train (or resume) the run in a run directory")
    p.add_argument("--run-dir", type=Path, required=True, help="a run directory with a plan.json")
    p.add_argument("--resume", action="store_true", help="resume from the newest valid checkpoint (the default)")
    p.add_argument(
        "--stop-at-step",
        type=int,
        metavar="N",
        help="save a checkpoint at step N and stop there (exit code 3, as after a preemption); rerun to continue",
    )
    p.add_argument(
        "--layout",
        metavar="tp=T,pp=P,dp=D[,mbs=M,zero=Z,recompute=R]",
        help="continue at another parallel layout (e.g. on fewer nodes): the newest checkpoint loads directly",
    )
    _add_set(p, "change a setting before this launch (e.g. eval_interval=100); " + SET_RESUMED_HELP)
    _add_nodes(p)

    p = sub.add_parser("eval", help="evaluate the newest checkpoint of a run")
    p.add_argument("--run-dir", type=Path, required=True, help="a run directory with a checkpoint; writes eval.json")
    g = p.add_argument_group("lm-evaluation-harness tasks, through the run's own layout (needs lm-eval installed)")
    g.add_argument(
        "--tasks",
        metavar="A,B",
        help="lm-eval task names (its registry, the shipped tasks, --include-path folders) instead of the shipped"
        " tasks; per-document answers go to <run-dir>/lm-eval/",
    )
    g.add_argument("--limit", type=int, metavar="N", help="with --tasks: the first N documents of each task")
    g.add_argument("--num-fewshot", type=int, metavar="K", help="with --tasks: K examples before each document")
    g.add_argument(
        "--include-path",
        type=Path,
        action="append",
        default=[],
        metavar="DIR",
        help="with --tasks: a folder of lm-eval task YAML files (repeatable)",
    )

    p = sub.add_parser("export", help="write a Hugging Face transformers Bloom directory (safetensors)")
    p.add_argument("--run-dir", type=Path, required=True, help="a run directory with a checkpoint")
    p.add_argument("--out", type=Path, required=True, help="the directory transformers will load")

    p = sub.add_parser("tui", help="attach the dashboard to a run directory (live or finished)")
    p.add_argument("--run-dir", type=Path, required=True, help="any run directory, e.g. runs/latest")

    p = sub.add_parser("import", help="start a run from a transformers Bloom checkpoint (safetensors)")
    p.add_argument(
        "--hf-dir", type=Path, required=True, help="a directory transformers saved (config, weights, tokenizer)"
    )
    p.add_argument("--run-dir", type=Path, required=True, help="a new run directory; then `run --run-dir` trains on")
    p.add_argument("--hardware", help="plan for a hardware profile instead of the detected machine")
    p.add_argument("--seq-len", type=int, default=2048, help="tokens per sample for the continued training")

    p = sub.add_parser("bench", help="tokens/s and MFU of the trainer against transformers eager and compiled; kernels")
    p.add_argument("--model", help="model preset name or TOML file (default: what the plan picks for this machine)")
    p.add_argument("--out", type=Path, help="JSON result file (default: runs/bench/<date>-<device>.json)")
    p.add_argument("--quick", action="store_true", help="a smoke run: a few steps of bloom-micro-test on CPU; on a GPU"
                   " bloom-560m at micro-batch 2, 5 timed steps (default model and sizes)")  # fmt: skip
    p.add_argument("--micro-batch", type=int, metavar="N",
                   help="samples per micro-batch, instead of the plan's; a step is then one micro-batch")  # fmt: skip
    p.add_argument("--steps", type=int, metavar="K",
                   help="timed steps per contender (default: 20; --quick: 3, GPU 5), after 3 warm-up steps"
                        " (--quick: 1, GPU 2), not timed, where torch.compile and autotuning happen")  # fmt: skip
    p.add_argument("--micro-batches", type=int, metavar="M",
                   help="micro-batches per step, gradient accumulation (default: the plan's for one data-parallel"
                        " rank; 1 with --micro-batch)")  # fmt: skip
    p.add_argument("--profile", action="store_true",
                   help="trace 3 more steps of each contender with torch.profiler: top kernels, GPU idle share,"
                        " launches and host syncs per step; the traces beside the JSON,"
                        " <out>-<contender>.trace.json")  # fmt: skip
    p.add_argument("--contenders", metavar="NAMES",
                   help="run only these, comma-separated, of trainer, hf-eager, hf-compile (default: all three);"
                        " the others are recorded as skipped")  # fmt: skip
    p.add_argument("--no-kernel-table", action="store_true",
                   help="skip the per-op kernel table (its compiled peers take minutes on a GPU)")  # fmt: skip

    p = sub.add_parser("sbatch", help="write a SLURM batch script that trains the plan on an allocation")
    p.add_argument("--run-dir", type=Path, required=True, help="the run directory the job will use")
    p.add_argument("--hardware", help="hardware profile name or TOML file (default: detect)")
    p.add_argument("--model", help="model preset name or TOML file (default: the model ladder picks)")
    p.add_argument("--corpus", type=Path, nargs="+", help="input corpus (default: the embedded sample corpus)")
    p.add_argument("--nodes", type=int, help="default: the plan's GPUs / GPUs per node")
    p.add_argument("--gpus-per-node", type=int, help="default: the hardware's")
    p.add_argument("--time", default="20:00:00", help="job time limit, [D-]HH:MM:SS; the job requeues itself")
    p.add_argument("--partition", help="SLURM partition (default: the cluster's)")
    p.add_argument("--account", help="SLURM account to charge (default: yours)")
    p.add_argument("--out", type=Path, help="default: <run-dir>/train.sbatch")

    for command in sub.choices.values():
        command.formatter_class = _HelpFormatter
        # SUPPRESS: when absent after the command, the value given before it (or False) stays.
        command.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help=DEBUG_HELP)
    return parser


def _need_run_dir(path: Path) -> Path:
    if not (path / "plan.json").is_file():
        raise BadInput(f"--run-dir {path}: not a run directory (no plan.json)")
    return path


# ---- commands ------------------------------------------------------------------------------------------------
def cmd_run(args: argparse.Namespace) -> int:
    from appliance.data.sample_corpus import SAMPLE_CORPUS_DIR
    from appliance.head_run import RunRequest, default_run_dir, make_run_plan, run
    from appliance.overrides import parse_overrides
    from appliance.planner.sizing import parse_duration

    req = RunRequest(
        corpus=args.corpus or [SAMPLE_CORPUS_DIR],
        run_dir=args.run_dir,
        model=args.model,
        hardware=args.hardware,
        max_steps=args.max_steps,
        overrides=parse_overrides(args.overrides),
        prepare_only=args.prepare_only,
        budget_s=parse_duration(args.budget) if args.budget else None,
        nodes=_nodes(args),
        layout=args.layout,
    )
    headless = args.headless or not sys.stdout.isatty() or (req.nodes is not None and not req.nodes.is_head)
    if not headless:
        # Validate in the foreground (exit 2 here on bad input), then run headless in the background and attach
        # the dashboard: quitting the dashboard leaves the run going, as on a head node.
        from appliance.head_run import check_inputs, check_resumed_settings, existing_plan

        check_inputs(req.corpus)
        check_resumed_settings(req)
        spec = existing_plan(req) or make_run_plan(req)
        run_dir = req.run_dir or default_run_dir(spec.model.name)
        refuse_if_live(RunDir(run_dir))  # here, not in the background child, whose refusal nobody would see
        return _run_with_dashboard(run_dir)
    return _run_headless(req, args.log_format, run)


def _run_headless(req: RunRequest, log_format: str, run: Callable[..., int]) -> int:
    from appliance.monitor.headless import HeadlessPrinter, follow_run

    printer = HeadlessPrinter(stream=sys.stdout, log_format=log_format)
    done = threading.Event()
    followers: list[threading.Thread] = []

    def start_following(run_dir: RunDir) -> None:
        t = threading.Thread(
            target=follow_run,
            args=(run_dir.root, printer),
            kwargs={"stop": done.is_set},
            daemon=True,
        )
        t.start()
        followers.append(t)

    try:
        return run(req, on_event_writer=start_following)
    finally:
        done.set()
        for t in followers:
            t.join(timeout=5)


def _run_with_dashboard(run_dir: Path) -> int:
    from appliance.tui.app import run_tui

    run_dir.mkdir(parents=True, exist_ok=True)
    argv = [a for a in sys.argv[1:] if a != "run"]
    child_args = ["run", "--headless", "--run-dir", str(run_dir), *_strip_run_dir(argv)]
    log = open(run_dir / "head.log", "ab")  # noqa: SIM115 - handed to the detached child
    child = subprocess.Popen(
        [sys.executable, str(Path(__file__).resolve().parents[1] / "bloom_appliance.py"), *child_args],
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    code = run_tui(run_dir)
    if child.poll() is None:
        print(
            f"The run goes on in the background (pid {child.pid}); log: {run_dir / 'head.log'}.\n"
            f"Attach again with: ./bloom_appliance.py tui --run-dir {run_dir}"
        )
        return code
    return child.returncode


def _strip_run_dir(argv: list[str]) -> list[str]:
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a == "--run-dir":
            skip = True
        elif not a.startswith("--run-dir="):
            out.append(a)
    return out


def cmd_detect(args: argparse.Namespace) -> int:
    from appliance.hardware import detect, format_hardware

    hw = detect()
    print(json.dumps(hw.to_dict(), indent=1) if args.json else format_hardware(hw))
    return 0


def cmd_plan(args: argparse.Namespace) -> int:
    from appliance.hardware import detect, load_hardware
    from appliance.planner import Budget, format_plan, load_model_shape, make_plan, parse_duration, parse_layout

    if args.corpus_tokens is not None and args.corpus_tokens < 1:
        raise BadInput(f"--corpus-tokens {args.corpus_tokens}: must be a positive token count")
    hw = load_hardware(args.hardware) if args.hardware else detect()
    shape = load_model_shape(args.model) if args.model else None
    layout = parse_layout(args.layout) if args.layout else None
    budget = Budget(seconds=parse_duration(args.budget) if args.budget else None, corpus_tokens=args.corpus_tokens)
    plan = make_plan(
        hw,
        shape,
        global_batch_size=args.global_batch_size,
        seq_len=args.seq_len,
        layout=layout,
        budget=budget,
        precision=args.precision,
    )
    if args.spares < 0:
        raise BadInput(f"--spares {args.spares}: must be 0 or more")
    if args.json:
        from appliance.planner.failures import plan_failure_cost

        failures = plan_failure_cost(plan, args.spares)
        print(json.dumps({**plan.to_json(), "failures": failures and failures.to_json()}, indent=1))
    else:
        print(format_plan(plan, spares=args.spares))
    return 0


def cmd_prep(args: argparse.Namespace) -> int:
    from appliance.data.prep import prepare_corpus, run_step
    from appliance.data.prep_work import parse_slice
    from appliance.head_run import check_inputs

    check_inputs(args.input)
    if args.sbatch:
        return _write_prep_scripts(args)
    if args.slice and not args.step:
        raise BadInput("--slice needs --step read or --step filter")
    if args.step:
        part = parse_slice(args.slice) if args.slice else None
        done = run_step(
            args.step, args.input, args.out, work_dir=args.work_dir, part=part, workers=args.workers, strict=args.strict
        )
        print(json.dumps(done, indent=1, ensure_ascii=False))
        return 0
    report = prepare_corpus(args.input, args.out, workers=args.workers, strict=args.strict, work_dir=args.work_dir)
    print(json.dumps(report.get("totals", report), indent=1, ensure_ascii=False))
    return 0


def _write_prep_scripts(args: argparse.Namespace) -> int:
    from appliance.data.prep import count_units
    from appliance.data.prep_slurm import PrepJob, default_array_size, default_script_dir, write_scripts

    if args.step or args.slice:
        raise BadInput("--sbatch writes the scripts for every step; leave out --step and --slice")
    job = PrepJob(
        inputs=args.input,
        out_dir=args.out,
        script_dir=args.script_dir or default_script_dir(args.out),
        array_size=args.array_size or default_array_size(count_units(args.input, strict=args.strict)),
        cwd=Path.cwd(),
        work_dir=args.work_dir,
        strict=args.strict,
        cpus_per_task=args.cpus_per_task,
        time_limit=args.time,
        partition=args.partition,
        account=args.account,
    )
    submit = write_scripts(job)
    print(f"wrote {submit} and {submit.parent / 'prep.sbatch'}: read and filter as arrays of {job.array_size} tasks")
    print(f"submit with: bash {submit}   (run it again to resume after a failure)")
    return 0


def cmd_tokenizer(args: argparse.Namespace) -> int:
    from appliance.tokenizer.bpe import train_tokenizer

    if not args.corpus.is_dir():
        raise BadInput(f"--corpus {args.corpus}: not a prepared corpus directory")
    print(train_tokenizer(args.corpus, args.out, vocab_size=args.vocab_size, tp_size=args.tp))
    return 0


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


def _launch(run_dir_path: Path, worker_args: tuple[str, ...] = (), nodes: NodeGroup | None = None) -> int:
    from appliance.train.launch import last_rank_errors, run_plan

    run_dir = RunDir(_need_run_dir(run_dir_path))
    if nodes is not None and not nodes.is_head:  # node 0 owns the directory; these ranks join its lock
        code = run_plan(run_dir, worker_args=worker_args, nodes=nodes)
    else:
        with own_run_dir(run_dir):  # exit 2, naming the owner, while a live run trains in this directory
            code = run_plan(run_dir, worker_args=worker_args, nodes=nodes)
    if code != 0:
        print(last_rank_errors(run_dir), file=sys.stderr)
        return EXIT_FAILED
    if run_dir.failed_marker.exists():
        print(f"training stopped, not retried: {run_dir.failed_marker.read_text().strip()}", file=sys.stderr)
        return EXIT_FAILED
    if run_dir.preempted_marker.exists():
        return EXIT_PREEMPTED
    return 0


def cmd_train(args: argparse.Namespace) -> int:
    if args.stop_at_step is not None and args.stop_at_step < 1:
        raise BadInput(f"--stop-at-step {args.stop_at_step}: must be a step number of at least 1")
    nodes = _nodes(args)
    if nodes is not None and not nodes.is_head:
        # Only node 0 changes the plan: the other nodes' ranks read it after the rendezvous, which node 0 opens
        # once its changes are written.
        for flag, value in (("--layout", args.layout), ("--set", args.overrides)):
            if value:
                raise BadInput(f"{flag}: give it on node 0 only (this is --node-rank {nodes.node_rank})")
        return _launch(args.run_dir, _stop_args(args), nodes)
    with own_run_dir(RunDir(_need_run_dir(args.run_dir))):  # from before --layout rewrites the plan
        return _train(args, nodes)


def _stop_args(args: argparse.Namespace) -> tuple[str, ...]:
    return () if args.stop_at_step is None else ("--stop-at-step", str(args.stop_at_step))


def _train(args: argparse.Namespace, nodes: NodeGroup | None = None) -> int:
    if args.overrides and args.layout:  # refuse a bad --set before --layout rewrites the plan
        from appliance.overrides import parse_overrides
        from appliance.train.live_settings import plan_change

        plan_change(RunDir(args.run_dir), parse_overrides(args.overrides))
    if args.layout:
        from appliance.train.relayout import change_layout

        change = change_layout(RunDir(_need_run_dir(args.run_dir)), args.layout)
        before, after = (",".join(f"{k}={d[k]}" for k in ("tp", "pp", "dp")) for d in (change["from"], change["to"]))
        print(f"layout {before} -> {after}: the newest checkpoint loads at the new layout")
    if args.overrides:
        _change_settings(RunDir(args.run_dir), args.overrides)
    return _launch(args.run_dir, _stop_args(args), nodes)


def _change_settings(run_dir: RunDir, items: list[str]) -> None:
    from appliance.monitor.events import EventWriter
    from appliance.overrides import parse_overrides
    from appliance.train.live_settings import change_settings, describe

    overrides = parse_overrides(items)
    with EventWriter(run_dir.metrics) as events:
        print(describe(change_settings(run_dir, overrides, events, command="train")))


def cmd_eval(args: argparse.Namespace) -> int:
    code = _launch(args.run_dir, ("--eval-only", *_lm_eval_args(args)))
    if code == 0:
        print((args.run_dir / "eval.json").read_text())
    return code


def _lm_eval_args(args: argparse.Namespace) -> list[str]:
    """The worker's arguments for `eval --tasks`, checked here (exit 2) before any rank starts."""
    if not args.tasks:
        flags = (("--limit", args.limit), ("--num-fewshot", args.num_fewshot))
        given = [flag for flag, value in flags if value is not None]
        if given or args.include_path:
            raise BadInput(f"{', '.join(given or ['--include-path'])}: only with --tasks (lm-eval task names)")
        return []
    from appliance.eval.lm_eval_tasks import parse_task_names, require_lm_eval, task_manager

    _need_run_dir(args.run_dir)
    if args.limit is not None and args.limit < 1:
        raise BadInput(f"--limit {args.limit}: must be at least 1 document per task")
    if args.num_fewshot is not None and args.num_fewshot < 0:
        raise BadInput(f"--num-fewshot {args.num_fewshot}: must be 0 or more examples")
    require_lm_eval()
    names = parse_task_names(args.tasks)
    task_manager(names, args.include_path)
    out = ["--tasks", ",".join(names)]
    out += ["--limit", str(args.limit)] if args.limit is not None else []
    out += ["--num-fewshot", str(args.num_fewshot)] if args.num_fewshot is not None else []
    for path in args.include_path:
        out += ["--include-path", str(path.resolve())]
    return out


def cmd_export(args: argparse.Namespace) -> int:
    from appliance.eval.export import export_run

    print(export_run(RunDir(_need_run_dir(args.run_dir)), args.out))
    return 0


def cmd_tui(args: argparse.Namespace) -> int:
    from appliance.tui.app import run_tui

    if not args.run_dir.is_dir():
        raise BadInput(f"--run-dir {args.run_dir}: no such directory")
    return run_tui(args.run_dir)


def cmd_import(args: argparse.Namespace) -> int:
    from appliance.eval.import_run import import_run

    refuse_if_live(RunDir(args.run_dir))
    spec = import_run(args.hf_dir, args.run_dir, hardware=args.hardware, seq_len=args.seq_len)
    lay = spec.layout
    print(f"imported {spec.model.name} into {args.run_dir} (tp{lay.tp} pp{lay.pp} dp{lay.dp});")
    print(f"continue training with: ./bloom_appliance.py run --run-dir {args.run_dir} --corpus PATH...")
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    from appliance.benchmark.command import CONTENDER_KEYS, run_bench
    from appliance.benchmark.workload import BenchSize

    size = BenchSize(micro_batch=args.micro_batch, steps=args.steps, micro_batches=args.micro_batches)
    chosen = CONTENDER_KEYS
    if args.contenders is not None:
        chosen = tuple(name.strip() for name in args.contenders.split(",") if name.strip())
        unknown = [name for name in chosen if name not in CONTENDER_KEYS]
        if unknown or not chosen:
            raise BadInput(f"--contenders {args.contenders!r}: name one or more of {', '.join(CONTENDER_KEYS)}")
    run_bench(args.model, args.out, quick=args.quick, size=size, profile=args.profile, contenders=chosen,
              kernel_table=not args.no_kernel_table)  # fmt: skip
    return 0


def cmd_sbatch(args: argparse.Namespace) -> int:
    from appliance.atomic import write_atomic
    from appliance.data.sample_corpus import SAMPLE_CORPUS_DIR
    from appliance.head_run import RunRequest, check_inputs, make_run_plan
    from appliance.planner.runspec import load_spec
    from appliance.train.slurm import job_for, sbatch_script

    corpus = args.corpus or [SAMPLE_CORPUS_DIR]
    check_inputs(corpus)
    plan_path = args.run_dir / "plan.json"
    if plan_path.exists():
        spec = load_spec(plan_path)
    else:
        spec = make_run_plan(RunRequest(corpus=corpus, hardware=args.hardware, model=args.model))
    job = job_for(
        spec,
        args.run_dir,
        nodes=args.nodes,
        gpus_per_node=args.gpus_per_node,
        time_limit=args.time,
        partition=args.partition,
        account=args.account,
    )
    args.run_dir.mkdir(parents=True, exist_ok=True)
    write_atomic(plan_path, spec.dumps())
    script = sbatch_script(job, corpus=[p.resolve() for p in corpus])
    out = args.out or args.run_dir / "train.sbatch"
    out.write_text(script)
    out.chmod(0o750)
    lay = spec.layout
    print(f"wrote {out}: {job.nodes} nodes x {job.gpus_per_node} GPUs, tp{lay.tp} pp{lay.pp} dp{lay.dp}")
    print(f"submit with: sbatch {out}")
    return 0


COMMANDS: dict[str, Callable[[argparse.Namespace], int]] = {
    "run": cmd_run,
    "detect": cmd_detect,
    "plan": cmd_plan,
    "prep": cmd_prep,
    "tokenizer": cmd_tokenizer,
    "tokenize": cmd_tokenize,
    "train": cmd_train,
    "eval": cmd_eval,
    "export": cmd_export,
    "tui": cmd_tui,
    "sbatch": cmd_sbatch,
    "import": cmd_import,
    "bench": cmd_bench,
}


def with_default_command(argv: list[str]) -> list[str]:
    """No command, or only options (`./bloom_appliance.py --debug --max-steps 40`): the command is `run`, placed
    after the global flags."""
    n = 0
    while n < len(argv) and argv[n] in GLOBAL_FLAGS:
        n += 1
    rest = argv[n:]
    if not rest or (rest[0].startswith("-") and rest[0] not in ("-h", "--help", "--version")):
        return [*argv[:n], "run", *rest]
    return argv


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(with_default_command(sys.argv[1:] if argv is None else argv))
    try:
        return COMMANDS[args.command](args)
    except BadInput as e:
        _report(f"error: {e}", debug=args.debug)
        return EXIT_BAD_INPUT
    except Exception as e:  # an unrecoverable failure: the message, metrics.jsonl and logs/ say why
        _report(f"failed: {e}", debug=args.debug)
        return EXIT_FAILED


def _report(message: str, *, debug: bool) -> None:
    """One line on stderr; with --debug the traceback first, so that the line stays last."""
    if debug:
        traceback.print_exc()
    print(message, file=sys.stderr)
