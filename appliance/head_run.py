"""The head process's run: plan, then each stage in order, each skipped when already complete.

hardware -> plan -> prep -> tokenizer -> data -> [preflight] -> train (+ final eval) -> export -> summary.
The preflight stage (train/preflight_check.py) runs on node 0 of `run --nnodes` unless --no-preflight, and with
--preflight (an sbatch job's first step, --prepare-only); the other nodes wait for it as for the data stages.
Every input is validated before anything is written, so bad input costs nothing and leaves nothing behind. Input
found bad only once a stage reads it (a corpus whose every record is refused), or any other failure before a data
stage completes, leaves nothing either: the run directory this command made goes with it (discard_if_unprepared).
A rerun of a run directory prints one line per skipped stage and the events of its own launch only (cli_run.py).
The run's last event (`run` done, prepared, preempted, or failed in a directory that stays) carries the closing
summary's facts: what each stage produced, the final figures, and the commands to run next (monitor/closing.py).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import replace
from pathlib import Path
from typing import Any

from appliance.atomic import write_atomic
from appliance.errors import EXIT_FAILED, EXIT_OK, EXIT_PREEMPTED, BadInput, Preempted
from appliance.monitor.closing import closing_facts
from appliance.monitor.events import EventWriter
from appliance.output_dirs import claim_run_dir, make_run_dir, read_json_object
from appliance.planner.runspec import RunSpec, load_spec
from appliance.run_request import RunRequest, apply_request, check_inputs, default_run_dir, existing_plan, make_run_plan
from appliance.rundir import RunDir, point_latest
from appliance.stages import Stages, fingerprint, settings_key
from appliance.train.nodes import NodeGroup
from appliance.train.runlock import own_run_dir

PLAN_EVENT_KEYS = ("hardware", "model", "layout", "estimate", "run", "sizing", "vocabulary")
# What prints a run's events while it runs: a context entered with the run directory before the run claims it.
Follow = Callable[[RunDir], AbstractContextManager[Any]]


def run(req: RunRequest, *, follow: Follow | None = None) -> int:
    """The whole run. `follow(run_dir)`: a context that prints the run's events while it runs (cli_run.py)."""
    if req.nodes is not None and not req.nodes.is_head:
        return run_on_other_node(req, req.nodes)
    check_inputs(req.corpus)
    check_resumed_settings(req)  # a refused --set leaves the run directory as it was, events included
    inputs = {"--corpus": req.corpus}
    if req.run_dir is not None:  # new, empty or a run's, and not holding the corpus (appliance/output_dirs.py)
        claim_run_dir(req.run_dir, inputs=inputs)
    spec = existing_plan(req) or make_run_plan(req)
    path = req.run_dir or default_run_dir(spec.model.name)
    made = folders_to_make(path)
    run_dir, _ = make_run_dir(path, inputs=inputs)
    try:
        # The follower first, so that it sees every event of this launch, the lock's takeover warning included.
        # One training per run directory: a rerun while a run (or its orphaned ranks) trains here is refused (exit
        # 2, naming the owner) before it writes anything. The lock goes on to the ranks (appliance/train/runlock.py).
        with follow(run_dir) if follow else contextlib.nullcontext(), own_run_dir(run_dir):
            return _run_owned(req, spec, run_dir, made)
    except Exception:
        discard_if_unprepared(run_dir, made)  # after the follower has printed the last events
        raise


def folders_to_make(path: Path) -> list[Path]:
    """`path` and those of its parents that do not exist yet, deepest first: the folders making `path` creates."""
    made = []
    for folder in (path, *path.parents):
        if folder.exists() or folder.is_symlink():
            break
        made.append(folder)
    return made


# The stages whose outputs make a run directory worth keeping after a failure: the plan alone is made again in a
# second, and a rerun without --run-dir starts a new directory anyway.
DATA_STAGES = ("prep", "tokenizer", "data")


def discard_if_unprepared(run_dir: RunDir, made: list[Path]) -> bool:
    """After a failed run: remove the run directory when this command made it (`made`: folders_to_make's list, taken
    before) and no data stage completed in it, then the parents it made for it (runs/) once empty. Everything in
    such a directory is this command's own: a plan, the events of the failure, a stage's partial outputs. Such a
    run was never runs/latest (point_latest follows the prep stage). True when removed."""
    if not removed_on_failure(run_dir, made):
        return False
    shutil.rmtree(run_dir.root, ignore_errors=True)
    for parent in made[1:]:
        with contextlib.suppress(OSError):  # not empty: something else appeared in it meanwhile, and it stays
            parent.rmdir()
    return not run_dir.root.exists()


def removed_on_failure(run_dir: RunDir, made: list[Path]) -> bool:
    """Whether a failure removes the run directory (discard_if_unprepared): this command made it, and no data stage
    completed in it."""
    records = read_json_object(run_dir.manifest) or {}
    return bool(made) and made[0] == run_dir.root and not any(name in records for name in DATA_STAGES)


def _run_owned(req: RunRequest, spec: RunSpec, run_dir: RunDir, made: list[Path]) -> int:
    events = EventWriter(run_dir.metrics)
    started = time.time()
    events.emit("run", state="started", run_dir=str(run_dir.root), pid=os.getpid())
    stages = Stages(run_dir.manifest, events)
    try:
        outcome = _run_stages(req, spec, run_dir, stages, events)
    except BadInput:
        events.emit("run", state="failed", reason="bad input")
        raise
    except Exception as e:
        write_summary(run_dir, stages, started, state="failed")
        # The closing summary (where the logs are, how to resume), unless the run directory goes with the failure.
        kept = not removed_on_failure(run_dir, made)
        closing = {"closing": closing_facts(run_dir, state="failed")} if kept else {}
        events.emit("run", state="failed", reason=str(e)[:500], **closing)
        raise
    write_summary(run_dir, stages, started, state=outcome)
    # The last event carries the closing summary's facts: what the run produced and the commands to run next.
    facts = closing_facts(run_dir, state=outcome)
    events.emit("run", state=outcome, seconds=time.time() - started, closing=facts)
    return {"done": EXIT_OK, "prepared": EXIT_OK, "preempted": EXIT_PREEMPTED}.get(outcome, EXIT_FAILED)


def _warn_skipped_input(events: EventWriter, report: dict[str, Any]) -> dict[str, Any]:
    from appliance.data.prep_report import skipped_input_warning

    message = skipped_input_warning(report)
    if message is not None:
        events.emit("warning", message=message)
    return report


def _run_stages(req: RunRequest, spec: RunSpec, run_dir: RunDir, stages: Stages, events: EventWriter) -> str:
    from appliance.data.prep import prepare_corpus
    from appliance.data.tokenize_corpus import build_indexed_datasets
    from appliance.tokenizer.bpe import train_tokenizer
    from appliance.train.launch import check_plan_runs_here, run_plan
    from appliance.train.preflight_check import run_preflight

    # The plan is fixed once written: a rerun of the same run directory keeps its plan and resumes. Its --set may
    # change only the keys that may change mid-run (train/live_settings.py), each recorded as a `settings` event.
    if run_dir.plan.exists():
        spec = load_spec(run_dir.plan)
        if "plan" not in stages.records:  # written by `import` or `sbatch`: this first run's settings apply
            spec = apply_request(spec, req)
        elif req.overrides:
            spec = _change_resumed_settings(req, run_dir, stages, events)
    plan = spec.to_json()

    def write_plan(progress: Any) -> None:
        write_atomic(run_dir.plan, spec.dumps())
        events.emit("plan", **{k: plan[k] for k in PLAN_EVENT_KEYS})

    # Before the plan is fixed and before any stage: a rerun with the `--set` the refusal names then applies. A
    # --prepare-only run trains elsewhere (a SLURM job's nodes, whose ranks check their own).
    if not req.prepare_only:
        world = spec.layout.world_size
        ranks_here = world if req.nodes is None else req.nodes.ranks_per_node(world, str(run_dir.plan))
        check_plan_runs_here(spec, str(run_dir.plan), ranks_here=ranks_here)
    stages.run("plan", key=settings_key(plan=plan), outputs=[run_dir.plan], work=write_plan)
    layout, train, workers = spec.layout, spec.train, spec.data_workers(os.cpu_count())

    stages.run(
        "prep",
        key=settings_key(inputs=fingerprint(req.corpus), names=sorted(str(p) for p in req.corpus)),
        outputs=[run_dir.corpus],
        work=lambda progress: _warn_skipped_input(
            events, prepare_corpus(req.corpus, run_dir.corpus, workers=workers, on_progress=progress)
        ),
    )
    point_latest(run_dir.root.parent, run_dir.root)

    def fix_plan(new: RunSpec) -> None:
        """A re-fixed plan: written, announced, and its stage re-recorded so that a rerun skips it."""
        write_atomic(run_dir.plan, new.dumps())
        new_plan = new.to_json()
        events.emit("plan", **{k: new_plan[k] for k in PLAN_EVENT_KEYS})
        stages.refix("plan", key=settings_key(plan=new_plan), outputs=[run_dir.plan])

    # The vocabulary follows the prepared corpus (planner/vocabulary.py): decided before the tokenizer learns it.
    vocab_sized = size_vocabulary_to_corpus(spec, req, run_dir, stages)
    if vocab_sized is not None:
        spec, plan = vocab_sized, vocab_sized.to_json()
        fix_plan(spec)
    if spec.init is not None:
        # An imported model keeps its own tokenizer (already in place): its weights only make sense with those ids.
        stages.run(
            "tokenizer",
            key=settings_key(imported=spec.init.tokenizer_sha256),
            outputs=[run_dir.tokenizer],
            work=lambda progress: None,
        )
    else:
        stages.run(
            "tokenizer",
            key=_tokenizer_key(run_dir, spec),
            outputs=[run_dir.tokenizer],
            work=lambda progress: train_tokenizer(
                run_dir.corpus,
                run_dir.tokenizer,
                vocab_size=spec.model.vocab_size,
                vocab_reasons=spec.report.vocabulary,
                tp_size=layout.tp,
                seed=train.seed,
                on_progress=progress,
            ),
        )
    data_files = [run_dir.data / "datasets.json"]
    stages.run(
        "data",
        key=settings_key(corpus=fingerprint([run_dir.corpus]), tokenizer=fingerprint([run_dir.tokenizer_json])),
        outputs=data_files,
        work=lambda progress: build_indexed_datasets(
            run_dir.corpus, run_dir.tokenizer_json, run_dir.data, workers=workers, on_progress=progress
        ),
    )

    sized = size_to_corpus(spec, req, run_dir, stages)
    if sized is not None:
        spec, plan = sized, sized.to_json()
        # The plan and the tokenizer stage keys follow the plan: re-record them so a rerun skips both. A tokenizer
        # padded for another TP still serves: the model pads its rows to 128 x tp (train/from_spec.py).
        fix_plan(spec)
        if spec.init is None:
            stages.refix("tokenizer", key=_tokenizer_key(run_dir, spec), outputs=[run_dir.tokenizer])

    if req.preflights and "train" not in stages.records:  # a run that has trained has nothing left to check
        stages.run(
            "preflight",
            key=preflight_key(run_dir),
            outputs=[run_dir.preflight],
            work=lambda progress: run_preflight(run_dir, events),
        )
    if req.prepare_only:
        return "prepared"

    def train_work(progress: Any) -> None:
        check_training_outcome(run_dir, run_plan(run_dir, nodes=req.nodes))

    try:
        stages.run("train", key=settings_key(plan=plan), outputs=[run_dir.eval], work=train_work)
    except Preempted:
        return "preempted"

    def export_work(progress: Any) -> None:
        from appliance.eval.export import export_run

        export_run(run_dir, run_dir.export)

    stages.run("export", key=settings_key(eval=fingerprint([run_dir.eval])), outputs=[run_dir.export], work=export_work)
    return "done"


def check_training_outcome(run_dir: RunDir, code: int) -> None:
    """Preempted, or RuntimeError naming the cause, unless the agent's training ended with its evaluation."""
    from appliance.train.launch import last_rank_errors

    if run_dir.preempted_marker.exists():
        raise Preempted(f"stopped on request after a checkpoint: {run_dir.checkpoints}")
    if run_dir.failed_marker.exists():
        raise RuntimeError(f"training stopped, not retried: {run_dir.failed_marker.read_text().strip()}")
    if code != 0 or not run_dir.eval.exists():
        raise RuntimeError(f"training failed (agent exit code {code})\n{last_rank_errors(run_dir)}")


# How often a node other than 0 looks whether node 0's data stages are done, and for how long (a large corpus's
# prep and tokenization take hours).
STAGES_POLL_S = 2.0
STAGES_WAIT_S = 24 * 3600.0


def run_on_other_node(req: RunRequest, nodes: NodeGroup, *, wait_s: float = STAGES_WAIT_S) -> int:
    """`run` on a node other than 0: no stage runs here. Node 0 plans and prepares the data in the same run
    directory, on a file system both mount; this node waits until stages.json records the data stage (and node 0's
    preflight of the plan, unless --no-preflight), then starts its share of the ranks. A run directory this node does
    not see fills never: the wait ends with BadInput; so does a preflight that found a role that does not fit."""
    from appliance.train.launch import run_plan

    if req.run_dir is None:
        raise BadInput(f"--run-dir: needed on --node-rank {nodes.node_rank} (node 0's, on a shared file system)")
    run_dir = RunDir(req.run_dir)
    deadline = time.monotonic() + wait_s
    while not _ready_to_train(run_dir, preflight=req.preflights):
        if time.monotonic() > deadline:
            if _ready_to_train(run_dir, preflight=False):
                raise BadInput(
                    f"--run-dir {run_dir.root}: node 0's preflight did not end in {wait_s:.0f} s; give --no-preflight"
                    " on every node or on none"
                )
            raise BadInput(
                f"--run-dir {run_dir.root}: node 0's data stages did not appear in {wait_s:.0f} s; it must be node"
                " 0's run directory, on a file system every node mounts"
            )
        time.sleep(STAGES_POLL_S)
    if req.prepare_only:
        return EXIT_OK
    try:
        check_training_outcome(run_dir, run_plan(run_dir, nodes=nodes))
    except Preempted:
        return EXIT_PREEMPTED
    return EXIT_OK


def _ready_to_train(run_dir: RunDir, *, preflight: bool) -> bool:
    """Node 0's data stages are recorded and, when `preflight`, its preflight of the plan.json there now; BadInput
    with node 0's verdict when that preflight found a role that does not fit (node 0 ends its run with it)."""
    from appliance.train.preflight_check import current_refusal

    try:
        records = json.loads(run_dir.manifest.read_text())
    except (OSError, ValueError):
        return False
    if "data" not in records or not run_dir.plan.exists():
        return False
    if not preflight or "train" in records or records.get("preflight", {}).get("key") == preflight_key(run_dir):
        return True
    refused = current_refusal(run_dir)
    if refused is not None:
        raise BadInput(refused)
    return False


def preflight_key(run_dir: RunDir) -> str:
    """The preflight stage's key: plan.json as written (node 0 records it; the other nodes compare it)."""
    return settings_key(plan=fingerprint([run_dir.plan]))


def check_resumed_settings(req: RunRequest) -> None:
    """The foreground's check of a resumed run's --set (exit 2 where the user sees it); the run applies it."""
    if req.run_dir is None or not req.overrides or not RunDir(req.run_dir).manifest.exists():
        return
    from appliance.train.live_settings import plan_change

    records = json.loads(RunDir(req.run_dir).manifest.read_text())
    _refuse_finished(records, RunDir(req.run_dir))
    if "plan" in records:
        plan_change(RunDir(req.run_dir), req.overrides)


def _refuse_finished(records: dict[str, Any], run_dir: RunDir) -> None:
    if "train" in records:
        raise BadInput(
            f"--set: the run in {run_dir.root} has finished training ({run_dir.manifest.name} records the train"
            " stage); settings change a run that is still to train"
        )


def _change_resumed_settings(req: RunRequest, run_dir: RunDir, stages: Stages, events: EventWriter) -> RunSpec:
    """--set on a resumed run: the mid-run keys written into plan.json, and the plan stage re-recorded for the new
    plan (so it is skipped, not redone)."""
    from appliance.train.live_settings import change_settings

    _refuse_finished(stages.records, run_dir)
    change = change_settings(run_dir, req.overrides, events, command="run")
    stages.refix("plan", key=settings_key(plan=change.spec.to_json()), outputs=[run_dir.plan])
    return change.spec


def _tokenizer_key(run_dir: RunDir, spec: RunSpec) -> str:
    return settings_key(corpus=fingerprint([run_dir.corpus]), vocab=spec.model.vocab_size, tp=spec.layout.tp)


def size_to_corpus(spec: RunSpec, req: RunRequest, run_dir: RunDir, stages: Stages) -> RunSpec | None:
    """After the data stage, the plan re-fixed from the corpus's token count (planner/sizing.py): the model (when the
    ladder chose it; at the tokenizer's vocabulary), the layout, the tokens and the schedule,
    with the time the data stages took taken off the budget. None when the plan is fixed already: sized before, or
    a run has trained under it (a resume never re-plans under its checkpoints)."""
    from appliance.data.blend import read_datasets_json
    from appliance.planner import Budget

    if spec.run.corpus_tokens is not None or "train" in stages.records or _has_checkpoints(run_dir):
        return None
    entries = read_datasets_json(run_dir.data)
    spent = sum(stages.seconds().get(name, 0.0) for name in ("prep", "tokenizer", "data"))
    budget = Budget(
        seconds=None if spec.run.budget_s is None else max(0.0, spec.run.budget_s - spent),
        corpus_tokens=sum(int(e["tokens"]) for e in entries.values()),
        corpus_bytes=spec.run.corpus_bytes,
        train_tokens=req.overrides.get("train_tokens"),
        languages=len(entries),
    )
    # The tokenizer is trained: its vocabulary, and the reasons it was chosen for, stay.
    sized = _replan(spec, req, budget, vocab_size=spec.model.vocab_size)
    return None if sized is None else replace(sized, report=replace(sized.report, vocabulary=spec.report.vocabulary))


def size_vocabulary_to_corpus(spec: RunSpec, req: RunRequest, run_dir: RunDir, stages: Stages) -> RunSpec | None:
    """After the prep stage, the plan re-fixed with the vocabulary sized to the prepared corpus's bytes
    (planner/vocabulary.py; prep_report.json's totals.bytes_out), before the tokenizer learns it: the embedding's
    size changes the parameters, so the model (when the ladder chose it), the layout and the tokens follow. None when
    the vocabulary is decided already: sized before, fixed by `--set vocab_size`, an imported model's tokenizer, or a
    plan a run has trained under."""
    from appliance.data.prep import REPORT_JSON
    from appliance.planner import Budget

    if spec.run.corpus_bytes is not None or spec.run.corpus_tokens is not None or spec.init is not None:
        return None
    if "vocab_size" in req.overrides or "train" in stages.records or _has_checkpoints(run_dir):
        return None
    report = json.loads((run_dir.corpus / REPORT_JSON).read_text())
    budget = Budget(
        seconds=spec.run.budget_s,  # the data stages' time comes off once, when the corpus has sized the plan
        corpus_bytes=int(report["totals"]["bytes_out"]),
        train_tokens=req.overrides.get("train_tokens"),
    )
    return _replan(spec, req, budget)


def _replan(spec: RunSpec, req: RunRequest, budget: Any, vocab_size: int | None = None) -> RunSpec | None:
    """The plan made again for what the data stages found (`budget`): the ladder's choice again when it chose the
    model, else the same model; None when the new plan cannot run (the plan that passed the checks stays)."""
    from appliance.planner import make_plan

    ladder_chose = bool(spec.report.model_choice) and spec.init is None and spec.hardware.has_gpus
    seq_len = spec.model.seq_len
    if ladder_chose:
        plan = make_plan(spec.hardware, None, seq_len=seq_len, budget=budget, vocab_size=vocab_size)
    else:
        given = spec.layout if req.layout else None  # a --layout stays the layout
        plan = make_plan(spec.hardware, spec.model, seq_len=seq_len, budget=budget, layout=given, vocab_size=vocab_size)
    if not plan.feasible:
        return None
    return apply_request(replace(plan.spec(), init=spec.init), req)


def _has_checkpoints(run_dir: RunDir) -> bool:
    return run_dir.checkpoints.is_dir() and any(run_dir.checkpoints.iterdir())


def write_summary(run_dir: RunDir, stages: Stages, started: float, *, state: str) -> dict[str, Any]:
    from appliance.monitor.summary import summarize

    summary = summarize(run_dir, state=state, wall_seconds=time.time() - started, stage_seconds=stages.seconds())
    write_atomic(run_dir.summary, json.dumps(summary, indent=1, ensure_ascii=False).encode())
    return summary
