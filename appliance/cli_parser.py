"""The command line's parser: every command, its options and their defaults (`--help`'s text)."""

from __future__ import annotations

import argparse
import os
import platform
from pathlib import Path
from typing import TYPE_CHECKING

from appliance import __version__
from appliance.planner.runspec import MAX_DATA_WORKERS
from appliance.planner.train_settings import DTYPES

if TYPE_CHECKING:
    from appliance.train.nodes import NodeGroup


DEFAULT_LOG_FORMAT = "text"
# After the help of every --model and --hardware: where the names are.
NAMES = "; `presets` lists the names"


def layout_keys() -> list[str]:
    """The keys --layout takes (planner/layout.py), each setting by its shortest name: tp, pp, dp, mbs, gbs, ..."""
    from appliance.planner.layout import LAYOUT_KEYS

    shortest: dict[str, str] = {}
    for key, setting in LAYOUT_KEYS.items():
        if len(key) < len(shortest.get(setting, key + "_")):
            shortest[setting] = key
    return list(shortest.values())


# --layout of run, train and plan: the planner's syntax, the same keys everywhere.
LAYOUT_METAVAR = "KEY=VALUE,..."
LAYOUT_KEYS_HELP = f", e.g. tp=4,pp=12,dp=8,mbs=2; keys: {', '.join(layout_keys())}"
DEBUG_HELP = "on an error, print the full traceback before the one-line message (exit codes stay the same)"
NODES_HELP = "N nodes of --hardware's one-node profile (e.g. a100-80gb-x8-node; default: the profile's own count)"
LAYOUT_HELP = (
    "fix these layout fields, the planner chooses the others (all of them given: exactly that layout)"
    + LAYOUT_KEYS_HELP
)
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
    p.add_argument("--model", help="model preset name or TOML file (default: the largest that fits the budget)" + NAMES)
    p.add_argument("--hardware", help="plan for a hardware profile instead of the detected machine" + NAMES)
    p.add_argument("--nodes", type=int, metavar="N", help=NODES_HELP)
    p.add_argument("--headless", action="store_true", help="no dashboard: progress lines and events on stdout")
    p.add_argument(
        "--log-format", choices=["text", "json"], default=DEFAULT_LOG_FORMAT, help="headless progress lines or events"
    )
    p.add_argument("--max-steps", type=int, help="stop after N optimizer steps")
    p.add_argument("--budget", help=BUDGET_HELP)
    p.add_argument("--prepare-only", action="store_true", help="stop after plan, prep, tokenizer and data")
    p.add_argument("--layout", metavar=LAYOUT_METAVAR, help=LAYOUT_HELP)
    _add_set(p, "override a training setting (e.g. lr=3e-4); unknown keys are an error; " + SET_RESUMED_HELP)
    _add_nodes(p, preflight=True)


def _add_nodes(p: argparse.ArgumentParser, *, preflight: bool = False) -> None:
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
        help="K more machines (node ranks N..N+K-1, or the hostfile's last K lines) stand by outside the rendezvous,"
        " holding no torch, and the first in line takes a lost node's ranks: the run goes on at the plan's layout"
        " and spends no restart (default: %(default)s)",
    )
    g.add_argument(
        "--store-elsewhere",
        action="store_true",
        help="the rendezvous store at --master runs on a machine that does not train (`python -m"
        " appliance.train.nodes --host-store HOST:PORT` there): node 0's loss then does not end the run",
    )
    if preflight:  # `run` only: its node 0 runs the stages (head_run.py)
        g.add_argument(
            "--preflight",
            action=argparse.BooleanOptionalAction,
            default=None,
            help="node 0 builds and steps one rank of each role of the final plan (`preflight`) before any node"
            " trains, and a role that does not fit ends the run on every node with exit 2 (default: with --nnodes,"
            " unless --prepare-only; --preflight: also on one machine or with --prepare-only, as an sbatch job's"
            " first step; --no-preflight: never, given on every node)",
        )


def nodes_from_args(args: argparse.Namespace) -> NodeGroup | None:
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


# --out of the commands that write a folder (appliance/output_dirs.py): new, empty or their own earlier output.
FORCE_HELP = (
    "write into a non-empty --out that is not an earlier {what}, beside its files: they are kept, and a name"
    " the command writes that is taken is still refused"
)
# The data commands print a short summary for a person; scripts that parse their output ask for it as JSON.
JSON_HELP = "one JSON object on stdout ({what}) instead of the summary; progress stays on stderr"


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
    p.add_argument("--hardware", help="hardware profile name or TOML file (default: detect)" + NAMES)
    p.add_argument("--nodes", type=int, metavar="N", help=NODES_HELP)
    p.add_argument("--model", help="model preset name or TOML file (default: the model ladder picks)" + NAMES)
    p.add_argument("--global-batch-size", type=int, help="samples per optimizer step (default: the model's recipe)")
    p.add_argument("--seq-len", type=int, help="tokens per sample (default: the model's)")
    p.add_argument("--layout", metavar=LAYOUT_METAVAR, help=LAYOUT_HELP)
    p.add_argument(
        "--allow-infeasible",
        action="store_true",
        help="print a plan that cannot run (it does not fit memory) instead of exiting 2 with the reason",
    )
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
    p.add_argument(
        "--verbose",
        action="store_true",
        help="the reasoning too: every note, memory and time term, 1D vs 2D TP, the rejected layouts, step-downs",
    )
    p.add_argument(
        "--preflight",
        action="store_true",
        help="also build and step one rank of each role here (as `preflight` does): the estimate with its measured"
        " memory and time beside the model's, and exit 2 when a role does not fit",
    )

    p = sub.add_parser("prep", help="clean, filter, deduplicate and redact a corpus")
    p.add_argument("--input", type=Path, nargs="+", required=True, help="files or directories to prepare")
    p.add_argument("--out", type=Path, required=True, help="the prepared corpus directory (shards and report)")
    p.add_argument("--workers", type=int, default=os.cpu_count() or 1, help="worker processes (default: CPU count)")
    p.add_argument("--strict", action="store_true", help="stop at the first bad record (file, line, byte offset)")
    p.add_argument("--work-dir", type=Path, help="resumable per-unit work (default: .<out>.prep-work beside --out)")
    p.add_argument(
        "--follow-symlinks",
        action="store_true",
        help="read symlinks that point outside the inputs (default: skip and count them)",
    )
    p.add_argument("--step", choices=["read", "templates", "filter", "finish"], help="run one step (SLURM jobs do)")
    p.add_argument("--slice", help="I/N: with --step read or filter, this array task's share of the work units")
    p.add_argument("--sbatch", action="store_true", help="write SLURM scripts (job arrays) instead of running")
    p.add_argument("--array-size", type=int, help="with --sbatch: tasks per array (default: units, at most 64)")
    p.add_argument("--cpus-per-task", type=int, default=8, help="with --sbatch: worker processes per task")
    p.add_argument("--time", default="04:00:00", help="with --sbatch: time limit per job, [D-]HH:MM:SS")
    p.add_argument("--partition", help="with --sbatch")
    p.add_argument("--account", help="with --sbatch")
    p.add_argument("--script-dir", type=Path, help="with --sbatch: where to write (default: <out>.prep-slurm)")
    p.add_argument("--force", action="store_true", help=FORCE_HELP.format(what="prep output"))
    p.add_argument("--json", action="store_true", help=JSON_HELP.format(what="prep_report.json's totals"))

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
        "--force",
        action="store_true",
        help=FORCE_HELP.format(what="tokenize output") + "; or over an earlier one of other inputs",
    )
    p.add_argument("--json", action="store_true", help=JSON_HELP.format(what="state and datasets.json"))

    p = sub.add_parser("tokenizer", help="train BLOOM's byte-level BPE tokenizer on a prepared corpus")
    p.add_argument("--corpus", type=Path, required=True, help="a directory `prep` wrote")
    p.add_argument("--out", type=Path, required=True, help="where tokenizer.json and fertility.json go")
    p.add_argument(
        "--vocab-size",
        type=int,
        help="entries before padding for tensor parallelism (default: sized to the corpus as `run` sizes it, at most"
        " BLOOM's 250,680)",
    )
    p.add_argument("--tp", type=int, default=1, help="pad the vocabulary to a multiple of 128 x TP")
    p.add_argument("--force", action="store_true", help=FORCE_HELP.format(what="tokenizer output"))
    p.add_argument(
        "--json", action="store_true", help=JSON_HELP.format(what="tokenizer.json's path, sizes and fertility verdict")
    )

    p = sub.add_parser("train", help="train (or resume) the run in a run directory")
    p.add_argument("--run-dir", type=Path, required=True, help="a run directory with a plan.json")
    p.add_argument(
        "--resume",
        action="store_true",
        help="only resume: exit 2 if the run has no committed checkpoint yet (without it, a launch resumes from the"
        " newest valid checkpoint, or starts at step 0 when there is none)",
    )
    p.add_argument(
        "--stop-at-step",
        type=int,
        metavar="N",
        help="save a checkpoint at step N and stop there (exit code 3, as after a preemption); rerun to continue",
    )
    p.add_argument(
        "--layout",
        metavar=LAYOUT_METAVAR,
        help="continue at another parallel layout (e.g. on fewer nodes): the newest checkpoint loads directly"
        + LAYOUT_KEYS_HELP,
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
    p.add_argument("--force", action="store_true", help=FORCE_HELP.format(what="export"))

    p = sub.add_parser("tui", help="attach the dashboard to a run directory (live or finished)")
    p.add_argument("--run-dir", type=Path, required=True, help="any run directory, e.g. runs/latest")
    p.add_argument(
        "--wait",
        action="store_true",
        help="a run directory that holds no run yet (or does not exist yet): wait for its run to start (default:"
        " exit 2 naming it)",
    )

    p = sub.add_parser("presets", help="the model and hardware presets --model and --hardware take by name")
    p.add_argument("--json", action="store_true", help="one JSON object: models and hardware, every figure")

    p = sub.add_parser("import", help="start a run from a transformers Bloom checkpoint (safetensors)")
    p.add_argument(
        "--hf-dir", type=Path, required=True, help="a directory transformers saved (config, weights, tokenizer)"
    )
    p.add_argument("--run-dir", type=Path, required=True, help="a new run directory; then `run --run-dir` trains on")
    p.add_argument("--hardware", help="plan for a hardware profile instead of the detected machine" + NAMES)
    p.add_argument("--seq-len", type=int, default=2048, help="tokens per sample for the continued training")

    p = sub.add_parser("preflight", help="build and step every role of the plan in one process; measured vs planned")
    p.add_argument("--hardware", help="hardware profile name or TOML file (default: detect)" + NAMES)
    p.add_argument("--model", help="model preset name or TOML file (default: the model ladder picks)" + NAMES)
    p.add_argument("--layout", metavar=LAYOUT_METAVAR, help=LAYOUT_HELP)
    p.add_argument("--json", action="store_true", help="one JSON object: every role's figures and verdict")
    p.add_argument(
        "--run-dir",
        type=Path,
        help="also write preflight.json there (made if missing); without --hardware, --model and --layout, preflight"
        " the plan.json it holds",
    )
    p.add_argument(
        "--step-downs",
        type=int,
        default=0,
        metavar="N",
        help="also the layouts of the first N step-downs a GPU run takes after losing nodes beyond its spares (`plan"
        " --verbose` lists them), each role built and stepped the same way (default: %(default)s)",
    )

    p = sub.add_parser("bench", help="tokens/s and MFU of the trainer against transformers eager and compiled; kernels")
    p.add_argument(
        "--model", help="model preset name or TOML file (default: what the plan picks for this machine)" + NAMES
    )
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
    p.add_argument("--hardware", help="hardware profile name or TOML file (default: detect)" + NAMES)
    p.add_argument("--model", help="model preset name or TOML file (default: the model ladder picks)" + NAMES)
    p.add_argument("--corpus", type=Path, nargs="+", help="input corpus (default: the embedded sample corpus)")
    p.add_argument("--nodes", type=int, metavar="N", help=NODES_HELP + "; the job asks SLURM for N nodes")
    p.add_argument("--budget", help=BUDGET_HELP)
    p.add_argument(
        "--smoke",
        action="store_true",
        help="send the sample corpus's 10-minute smoke run to an allocation of several nodes (refused without it)",
    )
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
