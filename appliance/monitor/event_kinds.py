"""Every event kind, declared once: the keys it must carry and the handlers that read it.

Kinds and keys are public (docs/ARCHITECTURE.md, "Events"): extend, never rename. Each reader finds its handler
for a kind here, by name, in its own module, so this table imports nothing and every reader can import it:

- reducer: the function of monitor/reducers.py that folds the event into RunState (monitor/state.py)
- line: the HeadlessPrinter method (monitor/headless.py) that gives its text log line (None: the kind has none;
  `--log-format json` prints every event)
- scalars: the function of monitor/tensorboard.py that gives its TensorBoard scalars (the W&B sink reads the same)
- summary: the list of summary.json that collects every event of the kind (monitor/summary.py)

A new kind is one entry here and the handlers it names; tests/unit/test_event_kinds.py checks that every kind the
code emits is declared and that every handler named exists.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class EventKind:
    required: tuple[str, ...]  # extra keys are allowed (extend, never rename)
    reducer: str | None = None
    line: str | None = None
    scalars: str | None = None
    scalars_at_step: bool = False  # the kind carries no step: its scalars are plotted at the newest training step
    summary: str | None = None


EVENT_KINDS: dict[str, EventKind] = {
    "stage": EventKind(("name", "state", "progress"), reducer="on_stage", line="text_stage", summary="stages"),
    "step": EventKind(
        ("step", "loss", "lr", "grad_norm", "tokens_per_s", "tflops_per_gpu", "mfu", "consumed_samples"),
        reducer="on_step",
        line="text_step",
        scalars="step_scalars",
        summary="steps",
    ),
    # seconds: the write (files, fsync, hashes, commit); stall_s beside it, what the steps waited (train/async_save.py)
    "checkpoint": EventKind(
        ("step", "path", "seconds", "bytes"),
        reducer="on_checkpoint",
        line="text_checkpoint",
        scalars="checkpoint_scalars",
        summary="checkpoints",
    ),
    "eval": EventKind((), reducer="on_eval", line="text_eval", scalars="eval_scalars", summary="evals"),
    "gpu": EventKind(("devices",), reducer="on_gpu", scalars="gpu_scalars", scalars_at_step=True),
    "energy": EventKind(("kwh", "co2_kg"), reducer="on_energy", scalars="energy_scalars", scalars_at_step=True),
    "failure": EventKind(("rank", "reason"), reducer="on_failure", line="text_failure", summary="failures"),
    "recovery": EventKind(
        ("restart", "resumed_step", "lost_seconds"), reducer="on_recovery", line="text_recovery", summary="recoveries"
    ),
    "warning": EventKind(("message",), reducer="on_warning", line="text_warning"),
    "plan": EventKind((), reducer="on_plan", line="text_plan"),
    "run": EventKind(("state",), reducer="on_run", line="text_run"),
    # --set on a started run: changes is [{key, old, new}] (train/live_settings.py)
    "settings": EventKind(("step", "changes"), line="text_settings"),
    # op -> implementation each launch runs, with the measured ms per op and backend (parallel/step/kernel_choice.py)
    "kernels": EventKind(("source", "choices", "times_ms"), reducer="on_kernels", line="text_kernels"),
    # elastic launches, at each start's first step: the nodes that train and the spares standing by (train/elastic.py)
    "nodes": EventKind(("nodes", "spares"), reducer="on_nodes", line="text_nodes"),
    # a launch's time from the head's launch to the first step's end, {phase: seconds} (train/startup.py)
    "startup": EventKind(("phases", "total_s"), reducer="on_startup", line="text_startup", scalars="startup_scalars"),
    # node 0's preflight of the plan before the nodes train: preflight.json's record (model, hardware, layout, and
    # per role its verdict, total/capacity bytes, measured vs planned ms per micro-batch; train/preflight_check.py)
    "preflight": EventKind(("roles",), reducer="on_preflight", line="text_preflight"),
}
