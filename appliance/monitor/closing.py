"""The closing summary: what a run left behind, in a dozen lines, and the commands to run next.

`closing_facts` reads the run directory's files (summary.json, eval.json, stages.json, plan.json, and what the
stages wrote: corpus/prep_report.json, tokenizer/fertility.json, data/datasets.json, checkpoints/latest, the
folder's marker for the command that made it) into one JSON object; `closing_lines` words it. Both paths print the
same words from the same facts:
- the head puts the facts in its last `run` event (`closing`): `--log-format json` carries them as they are, and the
  headless text log prints the lines under `run done` (HeadlessPrinter's `closing`);
- the dashboard prints the lines when the user leaves it, with what is still running when the run goes on.
A figure the files lack (a run that stopped before training, a recorded run without summary.json) is left out,
not shown as zero.
"""

from __future__ import annotations

import json
import shlex
from pathlib import Path
from typing import Any

from appliance.monitor.eval_report import eval_report
from appliance.monitor.events import finite
from appliance.monitor.headless import fmt_bytes, fmt_duration, fmt_float, fmt_pct, fmt_si, shows_mfu
from appliance.monitor.state import RunState, reduce
from appliance.output_dirs import MARKER, read_json_object
from appliance.rundir import RunDir

COMMAND = "./bloom_appliance.py"
# In the run directory: the output of the headless run a dashboard started in the background (cli_run.py).
HEAD_LOG = "head.log"
# The stages of `run`, in order: a failed run failed in the first one stages.json does not record.
RUN_STAGES = ("plan", "prep", "tokenizer", "data", "train", "export")
# What `eval --tasks` is shown with: lm-evaluation-harness names a user would try first.
EXAMPLE_TASKS = "hellaswag,arc_easy"
LIVE = "running"  # the state of a run the dashboard leaves while it goes on


def closing_facts(run_dir: RunDir, *, state: str | None = None, live: dict[str, Any] | None = None) -> dict[str, Any]:
    """The facts of the closing summary, from the run directory's files. `state`: the run's outcome as its caller
    knows it (done, prepared, preempted, failed; else summary.json's); `live`: what is still running (live_facts),
    when the dashboard leaves a run that goes on."""
    summary = _json(run_dir.summary)
    plan = _json(run_dir.plan)
    records = _json(run_dir.manifest)
    root = str(run_dir.root)
    facts: dict[str, Any] = {
        "run_dir": root,
        "state": LIVE if live is not None else state or summary.get("state"),
        "done_stages": [name for name in RUN_STAGES if name in records],
        "wall_seconds": finite(summary.get("wall_seconds")),
        **_produced(run_dir, plan),
        **_results(run_dir, summary, plan),
    }
    if live is not None:
        facts["live"] = live
    if facts["state"] in ("failed", "preempted"):
        facts["stopped_in"] = next((n for n in RUN_STAGES if n not in records), None)
        facts["logs"] = [str(p) for p in (run_dir.logs, run_dir.root / HEAD_LOG, run_dir.metrics) if p.exists()]
    facts["next"] = _next_commands(run_dir, facts)
    return facts


def live_facts(state: RunState) -> dict[str, Any]:
    """What a run that goes on is doing, as the dashboard last read it: its running stages with their progress, and
    the training's step, loss and time left."""
    running = [name for name, info in state.stages.items() if info.state in ("started", "running")]
    return {
        "stages": {name: round(state.stage_progress(name), 4) for name in running},
        "step": state.step,
        "total_steps": state.total_steps,
        "loss": finite(state.loss),
        "eta_s": finite(state.training_eta_s) if state.step is not None else None,
    }


def closing_summary(run_dir: RunDir, **known: Any) -> list[str]:
    """The closing summary's lines, from the run directory's files (closing_facts' arguments)."""
    return closing_lines(closing_facts(run_dir, **known))


# ---- the facts ------------------------------------------------------------------------------------------------
def _json(path: Path) -> dict[str, Any]:
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return value if isinstance(value, dict) else {}


def _produced(run_dir: RunDir, plan: dict[str, Any]) -> dict[str, Any]:
    """What each stage wrote: the corpus kept, the tokenizer's size, the tokens of the data, the checkpoints, the
    export; None for a stage that wrote nothing (yet)."""
    totals = _json(run_dir.corpus / "prep_report.json").get("totals") or {}
    corpus = None
    if finite(totals.get("docs_out")) is not None:
        corpus = {
            "path": str(run_dir.corpus),
            "documents": totals.get("docs_out"),
            "bytes": totals.get("bytes_out"),
            "documents_read": totals.get("docs_in"),
        }
    tokenizer = None
    if run_dir.tokenizer_json.is_file():
        sizes = _json(run_dir.tokenizer / "fertility.json").get("tokenizer") or {}
        vocab = sizes.get("vocab_size_padded") or (plan.get("model") or {}).get("vocab_size")
        tokenizer = {"path": str(run_dir.tokenizer_json), "vocab_size": vocab}
    datasets = _json(run_dir.data / "datasets.json")
    data = None
    if datasets:
        entries = [e for e in datasets.values() if isinstance(e, dict)]
        data = {
            "path": str(run_dir.data),
            "tokens": sum(int(finite(e.get("tokens")) or 0) for e in entries),
            "languages": len(entries),
        }
    steps = sorted(d.name for d in run_dir.checkpoints.glob("step-*") if d.is_dir())
    checkpoints = None
    if steps:
        try:  # the step directory `latest` names (train/checkpoint.py), else the newest by name
            newest = (run_dir.checkpoints / "latest").read_text().strip()
        except (OSError, UnicodeDecodeError):
            newest = steps[-1]
        digits = newest.rpartition("-")[2]
        checkpoints = {
            "path": str(run_dir.checkpoints),
            "count": len(steps),
            "newest_step": int(digits) if digits.isdigit() else None,
        }
    export = str(run_dir.export) if (run_dir.export / "config.json").is_file() else None
    return {"corpus": corpus, "tokenizer": tokenizer, "data": data, "checkpoints": checkpoints, "export": export}


def _results(run_dir: RunDir, summary: dict[str, Any], plan: dict[str, Any]) -> dict[str, Any]:
    """The figures: steps, the final validation loss and bits per byte, the task scores, the speed and the energy,
    each beside the plan's estimate."""
    final = _json(run_dir.eval)
    report = eval_report(final)
    tasks = {}
    for task in report.tasks:
        metric, (value, stderr) = next(iter(task.scores.items()), ("acc", (None, None)))
        name = "exact match" if task.exact_match and metric == "acc" else metric
        tasks[task.name] = {"metric": name, "value": value, "stderr": stderr, "n": task.n}
    estimate, run = plan.get("estimate") or {}, plan.get("run") or {}
    throughput = summary.get("throughput") or {}
    state = RunState()
    reduce(state, {"t": None, "kind": "plan", **plan})
    gpus = shows_mfu(state)  # CPU ranks show no MFU: their peak is assumed, not measured (as the dashboard)
    return {
        "steps": summary.get("steps"),
        "total_steps": (plan.get("train") or {}).get("steps"),
        "valid_loss": report.loss if report.loss is not None else finite(summary.get("last_valid_loss")),
        "first_valid_loss": report.first_loss or finite(summary.get("first_valid_loss")),
        "valid_bits_per_byte": report.bits_per_byte or finite(summary.get("last_valid_bits_per_byte")),
        "tasks": tasks,
        "task_limit": report.task_limit,
        "throughput": {
            "tokens_per_s": finite(throughput.get("tokens_per_s")),
            "planned_tokens_per_s": finite(estimate.get("tokens_per_s")),
            "mfu": finite(throughput.get("mfu")) if gpus else None,
            "planned_mfu": finite(estimate.get("mfu")) if gpus else None,
            "cpu": not gpus,
        },
        "energy": {
            "kwh": finite(summary.get("energy_kwh")),
            "co2_kg": finite(summary.get("co2_kg")),
            "source": summary.get("energy_source"),
            "planned_kwh": finite(run.get("energy_kwh")),
            "planned_co2_kg": finite(run.get("co2_kg")),
        },
    }


def _corpus_flags(run_dir: RunDir) -> str:
    """` --corpus PATH...` as the command that made the run directory gave it (its marker records the command
    line): a rerun with another corpus would prepare that one instead of resuming. "" for the sample corpus."""
    record = read_json_object(run_dir.root / MARKER) or {}
    try:
        words = shlex.split(str(record.get("command") or ""))
    except ValueError:
        return " --corpus PATH..."
    if "run" not in words:  # made by `sbatch` or `import`: their corpus is not on this command line
        return " --corpus PATH..." if words else ""
    paths: list[str] = []
    for i, word in enumerate(words):
        if word.startswith("--corpus="):
            paths.append(word.partition("=")[2])
        elif word == "--corpus":
            paths += _until_flag(words[i + 1 :])
    return " --corpus " + shlex.join(paths) if paths else ""


def _until_flag(words: list[str]) -> list[str]:
    out = []
    for word in words:
        if word.startswith("-"):
            break
        out.append(word)
    return out


def _next_commands(run_dir: RunDir, facts: dict[str, Any]) -> list[list[str]]:
    """[what, command] pairs: how to look at the run again, evaluate it, export it, train it or resume it."""
    d = shlex.quote(str(run_dir.root))
    state, checkpoints = facts["state"], facts["checkpoints"]
    watch = ["look at it", f"{COMMAND} tui --run-dir {d}"]
    rerun = f"{COMMAND} run --run-dir {d}{_corpus_flags(run_dir)}"
    if state == LIVE:
        return [
            watch,
            ["stop it cleanly", f"touch {shlex.quote(str(run_dir.request_stop))}   (saves a checkpoint, then exits)"],
        ]
    if state == "prepared":
        return [
            ["train it", f"{COMMAND} train --run-dir {d}"],
            ["or train and export", f"{rerun}   (the prepared stages are skipped)"],
            watch,
        ]
    if state in ("failed", "preempted"):
        since = f"; training resumes from step {checkpoints['newest_step']}" if checkpoints else ""
        return [["resume", f"{rerun}   (finished stages are skipped{since})"], watch]
    commands = [watch]
    if checkpoints:
        commands.append(["evaluate on more tasks", f"{COMMAND} eval --run-dir {d} --tasks {EXAMPLE_TASKS}"])
        commands.append(["export it elsewhere", f"{COMMAND} export --run-dir {d} --out DIR"])
    if facts["export"]:
        hf_dir = shlex.quote(facts["export"])
        commands.append(["train on from it", f"{COMMAND} import --hf-dir {hf_dir} --run-dir NEW"])
    return commands


# ---- the words ------------------------------------------------------------------------------------------------
def closing_lines(facts: dict[str, Any]) -> list[str]:
    """The closing summary of `facts` (closing_facts), a heading, what the run produced and measured, and the
    commands to run next, one per line."""
    lines = [_heading(facts)]
    rows = [*_live_rows(facts), *_stopped_rows(facts), *_produced_rows(facts), *_result_rows(facts)]
    width = max((len(label) for label, _ in rows), default=0)
    lines += [f"  {label.ljust(width)}  {text}" for label, text in rows]
    commands = facts.get("next") or []
    if commands:
        lines.append("next:")
        width = max(len(what) for what, _ in commands)
        lines += [f"  {what.ljust(width)}  {command}" for what, command in commands]
    return lines


def _heading(facts: dict[str, Any]) -> str:
    state, run_dir = facts.get("state"), facts.get("run_dir")
    took = f" in {fmt_duration(facts['wall_seconds'])}" if facts.get("wall_seconds") is not None else ""
    if state == LIVE:
        return f"The run goes on in {run_dir}"
    if state in ("failed", "preempted"):
        where = f" in stage {facts['stopped_in']}" if facts.get("stopped_in") else ""
        verb = "failed" if state == "failed" else "stopped after a checkpoint (preempted or asked to)"
        return f"Run {verb}{where}{took}: {run_dir}"
    return f"Run {state or 'ended'}{took}: {run_dir}"


def _live_rows(facts: dict[str, Any]) -> list[tuple[str, str]]:
    live = facts.get("live")
    if not live:
        return []
    parts = [f"{name} {fmt_pct(p)}" for name, p in (live.get("stages") or {}).items()]
    if live.get("step") is not None:
        total = f"/{live['total_steps']}" if live.get("total_steps") else ""
        parts.append(f"step {live['step']}{total}, loss {fmt_float(live.get('loss'))}")
    if live.get("eta_s") is not None:
        parts.append(f"about {fmt_duration(live['eta_s'])} left")
    done = ", ".join(facts.get("done_stages") or []) or "none yet"
    return [("running", ", ".join(parts) or "starting"), ("done", done)]


def _stopped_rows(facts: dict[str, Any]) -> list[tuple[str, str]]:
    logs = facts.get("logs")
    return [("logs", ", ".join(logs))] if logs else []


def _produced_rows(facts: dict[str, Any]) -> list[tuple[str, str]]:
    rows = []
    if corpus := facts.get("corpus"):
        read = f" of {corpus['documents_read']:,}" if corpus.get("documents_read") is not None else ""
        kept = f"{corpus['documents']:,}{read} documents kept, {fmt_bytes(corpus.get('bytes'))}"
        rows.append(("corpus", f"{kept} ({corpus['path']})"))
    if tokenizer := facts.get("tokenizer"):
        size = f"{tokenizer['vocab_size']:,} entries " if tokenizer.get("vocab_size") else ""
        rows.append(("tokenizer", f"{size}({tokenizer['path']})"))
    if data := facts.get("data"):
        languages = f"{data['languages']} language{'s' if data['languages'] != 1 else ''}"
        rows.append(("data", f"{fmt_si(data['tokens'])} tokens in {languages} ({data['path']})"))
    if facts.get("steps"):
        total = f" of {facts['total_steps']}" if facts.get("total_steps") else ""
        rows.append(("training", f"{facts['steps']}{total} steps"))
    if checkpoints := facts.get("checkpoints"):
        newest = f", newest step {checkpoints['newest_step']}" if checkpoints.get("newest_step") is not None else ""
        rows.append(("checkpoints", f"{checkpoints['count']} kept{newest} ({checkpoints['path']})"))
    if facts.get("export"):
        rows.append(("model", f"{facts['export']} (transformers loads it: BloomForCausalLM.from_pretrained)"))
    return rows


def _result_rows(facts: dict[str, Any]) -> list[tuple[str, str]]:
    rows = []
    if facts.get("valid_loss") is not None:
        before = f" (before training {fmt_float(facts['first_valid_loss'])})" if facts.get("first_valid_loss") else ""
        bpb = facts.get("valid_bits_per_byte")
        bits = f", {fmt_float(bpb)} bits per byte" if bpb is not None else ""
        rows.append(("validation", f"loss {fmt_float(facts['valid_loss'])}{before}{bits}"))
    if tasks := facts.get("tasks"):
        scores = [f"{name} {t['metric']} {fmt_float(t['value'], '.3f')}" for name, t in tasks.items()]
        limit = facts.get("task_limit")
        limit = f" (first {limit} document{'s' if limit != 1 else ''} each)" if limit else ""
        rows.append(("tasks", ", ".join(scores) + limit))
    speed = facts.get("throughput") or {}
    if speed.get("tokens_per_s") is not None:
        text = f"{fmt_si(speed['tokens_per_s'])} tokens/s"
        if speed.get("planned_tokens_per_s") is not None:
            text += f" (plan {fmt_si(speed['planned_tokens_per_s'])})"
        if speed.get("cpu"):
            text += "; CPU ranks: no MFU"
        elif speed.get("mfu") is not None:
            planned = f" (plan {fmt_pct(speed['planned_mfu'])})" if speed.get("planned_mfu") is not None else ""
            text += f", MFU {fmt_pct(speed['mfu'])}{planned}"
        rows.append(("speed", text))
    energy = facts.get("energy") or {}
    if energy.get("kwh") is not None:
        text = f"{fmt_float(energy['kwh'], '.3g')} kWh, {fmt_float(energy.get('co2_kg'), '.3g')} kg CO2eq"
        if energy.get("planned_kwh") is not None:
            text += f" (plan {fmt_float(energy['planned_kwh'], '.3g')} kWh)"
        if energy.get("source"):
            text += f"; source {energy['source']}"
        rows.append(("energy", text))
    return rows
