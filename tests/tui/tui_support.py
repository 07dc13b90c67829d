"""Test support for the dashboard: a synthetic BLOOM-176B run on 384 GPUs (48 nodes x 8), written as a real
run directory.

Fixed timestamps and values, so the snapshots are stable: training starts at T0 + 1200 s, steps take 105 s
(2048 samples x 2048 tokens = 4.19M tokens per step, ~40k tokens/s), a checkpoint every 200 steps, rank 137 fails
after step 450 and the run resumes from step 400, 1000 steps in all. With fp16=True the same run trains in fp16:
its step events carry the dynamic loss scale, 2^12 at the start, halved after each of the overflow steps 450 and
780 (whose gradient norm is the overflow's inf).
"""

from __future__ import annotations

import io
import json
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from rich.console import Console
from textual.widget import Widget
from textual.widgets import Static

from appliance.monitor.events import make_event
from appliance.rundir import RunDir

T0 = 1_700_000_000.0
TRAIN_T0 = T0 + 1200.0
STEP_S = 105.0
NODES, GPUS_PER_NODE = 48, 8
TOTAL_STEPS = 1000
DOWN_S = 600.0  # from the failure to the restart
FAIL_AFTER, RESUME_FROM = 455, 400
PLAN = {
    "hardware": {"nodes": NODES, "gpus_per_node": GPUS_PER_NODE, "gpu": "A100-SXM4-80GB"},
    "model": {"name": "bloom-176b", "layers": 70, "hidden": 14336, "heads": 112},
    "layout": {"tp": 4, "pp": 12, "dp": 8, "micro_batch_size": 2, "global_batch_size": 2048, "zero_stage": 1},
    "estimate": {
        "memory_gb_per_gpu": 71.2,
        "step_time_s": 105.0,
        "tflops_per_gpu": 150.0,
        "mfu": 0.48,
        "tokens_per_s": 40000.0,
    },
    "feasible": True,
    "rejected": [],
    # plan.json's shape: the schedule in "train", the whole-run estimate in "run"
    "train": {"steps": TOTAL_STEPS, "save_interval": 200, "seq_len": 2048, "global_batch_size": 2048},
    "run": {"steps": TOTAL_STEPS, "energy_kwh": 16000.0, "co2_kg": 1094.4},  # 16000 kWh x PUE 1.2 x 57 g/kWh
}


def step_time(step: int, resumed: bool) -> float:
    """When step `step` finished: 105 s a step, plus the downtime and the redone steps after the restart."""
    lost = DOWN_S + (FAIL_AFTER - RESUME_FROM) * STEP_S if resumed else 0.0
    return TRAIN_T0 + step * STEP_S + lost


OVERFLOW_STEPS = (450, 780)
FINAL_LANGUAGE_LOSS = {"ar": 2.71, "code": 1.38, "en": 2.58, "es": 2.41, "fr": 2.36, "pt": 2.45, "zh": 2.92}
FINAL_TASKS = {  # the harness's shape (appliance/eval/harness.py): stderr = sqrt(p (1 - p) / (n - 1))
    "lambada": {"output_type": "loglikelihood", "num_fewshot": 0, "n": 5153, "acc": 0.612, "acc_stderr": 0.0068,
                "perplexity": 4.21},
    "hellaswag": {"output_type": "multiple_choice", "num_fewshot": 0, "n": 10042, "acc": 0.522,
                  "acc_stderr": 0.005, "acc_norm": 0.551, "acc_norm_stderr": 0.005},
}  # fmt: skip


def fp16_fields(step: int) -> dict[str, Any]:
    """The loss scale the step ran at and the overflow steps so far (a resume restores both, so the run's second
    pass over steps 400-450 reads the same)."""
    overflows = sum(s <= step for s in OVERFLOW_STEPS)
    scale = 2.0 ** (12 - sum(s < step for s in OVERFLOW_STEPS))
    overflow = step in OVERFLOW_STEPS
    return {"loss_scale": scale, "skipped_steps": overflows, "overflow": overflow, "skipped": overflow}


def step_event(step: int, resumed: bool, fp16: bool = False, t: float | None = None) -> dict[str, Any]:
    warmup = min(1.0, step / 100)
    lr = 6e-5 * warmup * (0.55 + 0.45 * math.cos(math.pi * step / TOTAL_STEPS))
    overflow = fp16 and step in OVERFLOW_STEPS
    return make_event(
        "step",
        t=step_time(step, resumed) if t is None else t,
        step=step,
        loss=2.2 + 9.0 * math.exp(-step / 120) + 0.05 * math.sin(step / 7),
        lr=lr,
        grad_norm=math.inf if overflow else 12.3 if step == 450 else 0.9 + 0.5 * math.exp(-step / 50),
        tokens_per_s=2048 * 2048 / STEP_S,
        tflops_per_gpu=149.5,
        mfu=0.479,
        consumed_samples=step * 2048,
        total_steps=TOTAL_STEPS,
        **(fp16_fields(step) if fp16 else {}),
    )


def node_events(t: float, hours: float) -> Iterator[dict[str, Any]]:
    for n in range(NODES):
        node = f"node{n:02d}"
        devices = [
            {
                "index": i,
                "name": "NVIDIA A100-SXM4-80GB",
                "util": 99.0 - (n + i) % 5,
                "memory_used_gb": 71.0,
                "memory_total_gb": 80.0,
                "temperature_c": 84.0 if (n, i) == (17, 3) else 60.0 + (n + i) % 10,
                "power_w": 400.0,
            }
            for i in range(GPUS_PER_NODE)
        ]
        yield make_event("gpu", t=t, node=node, devices=devices)
        gpu_kwh = GPUS_PER_NODE * 0.4 * hours  # 8 x 400 W
        cpu_kwh = 0.3 * hours
        kwh = gpu_kwh + cpu_kwh
        yield make_event(
            "energy",
            t=t,
            node=node,
            kwh=kwh,
            co2_kg=kwh * 1.2 * 57 / 1000,
            gpu_kwh=gpu_kwh,
            cpu_kwh=cpu_kwh,
            source="nvml_energy_counter",
            gpu_source="nvml_energy_counter",
            cpu_source="rapl",
            pue=1.2,
            grid_g_per_kwh=57.0,
        )


def synthetic_events(last_step: int = TOTAL_STEPS, finished: bool = True, fp16: bool = False) -> list[dict[str, Any]]:
    ev: list[dict[str, Any]] = [make_event("run", t=T0, state="started", name="bloom-176b-synthetic")]
    for i, name in enumerate(("prep", "tokenizer", "indexing")):
        start = T0 + 400 * i
        ev += [
            make_event("stage", t=start, name=name, state="started", progress=0.0),
            make_event("stage", t=start + 200, name=name, state="running", progress=0.5),
            make_event("stage", t=start + 400, name=name, state="done", progress=1.0),
        ]
    ev.append(make_event("stage", t=TRAIN_T0, name="training", state="started", progress=0.0))
    resumed = False
    step = 10
    while step <= last_step:
        t = step_time(step, resumed)
        ev.append(step_event(step, resumed, fp16))
        if step % 50 == 0:
            ev += node_events(t, (t - TRAIN_T0) / 3600)
        if step % 200 == 0:
            path = f"checkpoints/step-{step:08d}"
            ev.append(make_event("checkpoint", t=t + 45, step=step, path=path, seconds=45.0, bytes=2.3e12))
        if step == 450 and not fp16:  # in fp16 the step overflowed instead: no norm to call a spike
            ev.append(make_event("warning", t=t, message="loss spike at step 450 (grad norm 12.3)"))
        if step == 450 and not resumed:
            fail_t = t + 5 * STEP_S
            ev.append(make_event("failure", t=fail_t, rank=137, reason="NCCL timeout in all-reduce on node17"))
            lost = DOWN_S + (FAIL_AFTER - RESUME_FROM) * STEP_S
            ev.append(make_event("recovery", t=fail_t + DOWN_S, restart=1, resumed_step=RESUME_FROM, lost_seconds=lost))
            resumed, step = True, RESUME_FROM
        step += 10
    if finished:
        t = step_time(last_step, resumed) + 60
        ev += [
            make_event("stage", t=t, name="training", state="done", progress=1.0),
            make_event("stage", t=t, name="eval", state="started", progress=0.0),
            make_event(
                "eval",
                t=t + 300,
                final=True,
                step=last_step,
                valid_loss=2.513,
                valid_ppl=12.34,
                per_source={k: {"loss": v, "ppl": math.exp(v)} for k, v in FINAL_LANGUAGE_LOSS.items()},
                tasks=FINAL_TASKS,
                sample={"prompt": "The capital of France is", "text": " Paris, a city on the Seine."},
            ),
            make_event("stage", t=t + 300, name="eval", state="done", progress=1.0),
            make_event("run", t=t + 320, state="done"),
        ]
    return ev


def write_run(root: Path, events: list[dict[str, Any]], plan: bool = True) -> RunDir:
    run = RunDir(root).make()
    if plan:
        run.plan.write_text(json.dumps(PLAN))
    with open(run.metrics, "w") as f:
        f.writelines(json.dumps(e) + "\n" for e in events)
    return run


def widget_text(widget: Widget, width: int = 200) -> str:
    """What a panel shows, as plain text: its content rendered by Rich (Statics), or its own render()."""
    content = widget.content if isinstance(widget, Static) else widget.render()
    if isinstance(content, str):
        return content
    console = Console(width=width, file=io.StringIO(), color_system=None, record=True)
    console.print(content)
    return console.export_text()


# The run with failures and recoveries: the 384-GPU run, live at step 900, after three failures of three kinds.
# Each: (the last step before it, the step the restart resumed from, seconds down, where, why). The lost time is
# the downtime plus the steps redone: e.g. 600 s + (455 - 400) x 105 s = 6,375 s for the first.
TROUBLES = (
    (455, 400, 600.0, 137, "NCCL timeout in all-reduce on node17"),
    (640, 600, 1500.0, 250, "node31 lost: its agent stopped answering (GPU 5: uncorrectable ECC error)"),
    (812, 800, 900.0, 45, "hang: no heartbeat from rank 45 for 600 s (pipeline stage 5)"),
)


def troubled_events(last_step: int = 900) -> list[dict[str, Any]]:
    ev: list[dict[str, Any]] = [make_event("run", t=T0, state="started", name="bloom-176b-troubled")]
    ev.append(make_event("stage", t=TRAIN_T0, name="training", state="started", progress=0.0))
    t, step, restart = TRAIN_T0, 10, 0
    pending = list(TROUBLES)
    while step <= last_step:
        t += 10 * STEP_S
        ev.append(step_event(step, resumed=restart > 0, t=t))
        if step % 50 == 0:
            ev += node_events(t, (t - TRAIN_T0) / 3600)
        if step % 200 == 0:
            path = f"checkpoints/step-{step:08d}"
            ev.append(make_event("checkpoint", t=t + 45, step=step, path=path, seconds=45.0, bytes=2.3e12))
            # the periodic evaluation's shape (trainer._record_eval): losses only, per language as plain floats
            valid = step_event(step, resumed=False)["loss"] + 0.04
            per_source = {k: round(v - 2.513 + valid, 4) for k, v in FINAL_LANGUAGE_LOSS.items()}
            ev.append(
                make_event(
                    "eval", t=t + 60, step=step, valid_loss=valid, valid_ppl=math.exp(valid), per_source=per_source
                )
            )
        if pending and step + 10 > pending[0][0]:
            failed_after, resume_from, down_s, rank, reason = pending.pop(0)
            fail_t = t + (failed_after - step) * STEP_S
            restart += 1
            lost = down_s + (failed_after - resume_from) * STEP_S
            ev.append(make_event("failure", t=fail_t, rank=rank, reason=reason))
            t = fail_t + down_s
            ev.append(make_event("recovery", t=t, restart=restart, resumed_step=resume_from, lost_seconds=lost))
            step = resume_from
        step += 10
    return ev


def on_screen(widget: Widget) -> str:
    """What a widget draws at the size the layout gave it (its render(), not the full content widget_text shows)."""
    console = Console(width=widget.content_size.width, file=io.StringIO(), color_system=None, record=True)
    console.print(widget.render())
    return "\n".join(
        line[: widget.content_size.width] for line in console.export_text().splitlines()[: widget.content_size.height]
    )
