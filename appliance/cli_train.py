"""`train`, `eval`, `export`, `import` and `sbatch`: commands on a run directory."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from appliance.cli_parser import nodes_from_args
from appliance.errors import EXIT_FAILED, EXIT_PREEMPTED, BadInput
from appliance.output_dirs import OutputDir, claim_file, claim_run_dir, make_run_dir
from appliance.rundir import RunDir
from appliance.train.runlock import own_run_dir, refuse_if_live

if TYPE_CHECKING:
    from appliance.train.nodes import NodeGroup


def _need_run_dir(path: Path) -> Path:
    if not RunDir(path).plan.is_file():
        raise BadInput(
            f"--run-dir {path}: not a run directory (no plan.json); make one first: {PREPARE.format(run_dir=path)}"
        )
    return path


# What a command on a run directory says to run first, when what it reads is not there yet.
PREPARE = "./bloom_appliance.py run --run-dir {run_dir} --prepare-only --corpus PATH..."
TRAIN = "./bloom_appliance.py train --run-dir {run_dir}"


def _need_inputs(path: Path, *, data: bool = True, checkpoint: bool = False) -> None:
    """BadInput, before any process starts, unless the run directory holds what the command reads: a plan, the
    tokenizer, the indexed data (`data`) and a committed checkpoint (`checkpoint`), naming the first missing one and
    the command that makes it. No torch or numpy here: the check answers in the time Python takes to start, and a
    spare's standby, which runs it too, stays small."""
    from appliance.train.checkpoint import find_latest

    run_dir = RunDir(_need_run_dir(path))
    needed = [("tokenizer", run_dir.tokenizer_json)] + ([("indexed data", run_dir.datasets_json)] if data else [])
    for what, file in needed:
        if not file.is_file():
            raise BadInput(
                f"--run-dir {path}: no {what} ({file} is missing); run first: {PREPARE.format(run_dir=path)}"
            )
    # Sizes against the manifest, not hashes: a few stat calls; the ranks verify the hashes when they load it.
    if checkpoint and find_latest(run_dir.checkpoints, verify_hashes=False) is None:
        raise BadInput(
            f"--run-dir {path}: no complete checkpoint in {run_dir.checkpoints};"
            f" train first: {TRAIN.format(run_dir=path)}"
        )


def _run_dir_to_write(path: Path) -> Path:
    """A run directory `train` or `eval` writes into: it has a plan, and it is a run's (appliance/output_dirs.py)."""
    claim_run_dir(_need_run_dir(path))
    return path


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
    nodes = nodes_from_args(args)
    if nodes is not None and not nodes.is_head:
        # Only node 0 changes the plan: the other nodes' ranks read it after the rendezvous, which node 0 opens
        # once its changes are written.
        for flag, value in (("--layout", args.layout), ("--set", args.overrides)):
            if value:
                raise BadInput(f"{flag}: give it on node 0 only (this is --node-rank {nodes.node_rank})")
        _need_inputs(args.run_dir, checkpoint=args.resume)
        return _launch(args.run_dir, _stop_args(args), nodes)
    _run_dir_to_write(args.run_dir)
    _need_inputs(args.run_dir, checkpoint=args.resume)
    with own_run_dir(RunDir(args.run_dir)):  # from before --layout rewrites the plan
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
    worker_args = _lm_eval_args(args)  # the flags first: a wrong flag is named whatever the folder holds
    _run_dir_to_write(args.run_dir)
    _need_inputs(args.run_dir, checkpoint=True)
    code = _launch(args.run_dir, ("--eval-only", *worker_args))
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
    _need_inputs(args.run_dir, data=False, checkpoint=True)
    from appliance.eval.export import export_run

    print(export_run(RunDir(_need_run_dir(args.run_dir)), args.out, force=args.force))
    return 0


def cmd_import(args: argparse.Namespace) -> int:
    from appliance.eval.import_run import import_run

    refuse_if_live(RunDir(args.run_dir))
    spec = import_run(args.hf_dir, args.run_dir, hardware=args.hardware, seq_len=args.seq_len)
    lay = spec.layout
    print(f"imported {spec.model.name} into {args.run_dir} (tp{lay.tp} pp{lay.pp} dp{lay.dp});")
    print(f"continue training with: ./bloom_appliance.py run --run-dir {args.run_dir} --corpus PATH...")
    return 0


def cmd_sbatch(args: argparse.Namespace) -> int:
    from appliance.atomic import write_atomic
    from appliance.data.sample_corpus import SAMPLE_CORPUS_DIR
    from appliance.planner.runspec import load_spec
    from appliance.planner.sizing import parse_duration
    from appliance.run_request import RunRequest, check_inputs, make_sbatch_plan, sbatch_summary
    from appliance.train.slurm import job_for, sbatch_script

    corpus = args.corpus or [SAMPLE_CORPUS_DIR]
    check_inputs(corpus)
    inputs = {"--corpus": corpus}
    scripts = _scripts_written(claim_run_dir(args.run_dir, inputs=inputs))
    out = args.out or RunDir(args.run_dir).sbatch_script
    claim_file(
        out, flag="--out", what="a script `sbatch` wrote for this run directory", ours=lambda p: _key(p) in scripts
    )
    plan_path = RunDir(args.run_dir).plan
    req = RunRequest(
        corpus=corpus,
        hardware=args.hardware,
        hardware_nodes=args.nodes,
        model=args.model,
        budget_s=parse_duration(args.budget) if args.budget else None,
    )
    plan_path_existed = plan_path.exists()  # a plan written before (an earlier sbatch or run) is the one that runs
    spec = load_spec(plan_path) if plan_path_existed else make_sbatch_plan(req, smoke=args.smoke)
    job = job_for(
        spec,
        args.run_dir,
        nodes=args.nodes,
        gpus_per_node=args.gpus_per_node,
        time_limit=args.time,
        partition=args.partition,
        account=args.account,
    )
    script = sbatch_script(job, corpus=[p.resolve() for p in corpus])  # refuses a hostile path before any mkdir
    _, run_dir_out = make_run_dir(args.run_dir, inputs=inputs)
    # The job's --output is logs/slurm-%j.out: SLURM opens it before the script runs, and cannot without the folder.
    RunDir(args.run_dir).logs.mkdir(exist_ok=True)
    write_atomic(plan_path, spec.dumps())
    write_atomic(out, script.encode())
    out.chmod(0o750)  # 0750, not the 0640 of write_atomic: a script to run
    run_dir_out.mark(run_dir_out.owned, scripts=sorted(scripts | {_key(out)}))
    print(f"wrote {out}:")
    print("\n".join(f"  {line}" for line in sbatch_summary(spec, req, job, planned=not plan_path_existed)))
    print(f"submit with: sbatch {out}")
    return 0


def _key(path: Path) -> str:
    return str(path.resolve())


def _scripts_written(run_dir: OutputDir) -> set[str]:
    """The scripts `sbatch` wrote for this run directory, which a rerun may replace: those its marker lists; in a run
    directory made before the marker, the default one."""
    if run_dir.record:
        return {s for s in run_dir.record.get("scripts", []) if isinstance(s, str)}
    return {_key(RunDir(run_dir.root).sbatch_script)}
