"""CPU runs label their throughput honestly in the step lines: FLOP/s per rank, not "TFLOPs/GPU", and no MFU (a CPU
rank's peak is an assumed figure, not a measured one); GPU runs keep TFLOPs per GPU and MFU."""

from __future__ import annotations

import io

from appliance.monitor.events import make_event
from appliance.monitor.headless import HeadlessPrinter

T0 = 1_000_000.0


def step_lines(device_kind: str) -> list[str]:
    """The text lines of a plan event for `device_kind` ranks and three steps (the step events carry the trainer's
    figures as it sends them on either kind: TFLOP/s per device and an MFU)."""
    out = io.StringIO()
    printer = HeadlessPrinter(out, every_steps=1)
    gpus = 8 if device_kind == "gpu" else 0
    printer.handle(
        make_event("plan", t=T0, plan={"device": {"kind": device_kind}, "hardware": {"gpus_per_node": gpus}})
    )
    for n in range(1, 4):
        step = make_event(
            "step", t=T0 + n, step=n, loss=2.5, lr=3e-4, grad_norm=1.0, tokens_per_s=4_800.0,
            tflops_per_gpu=0.0213, mfu=0.22, consumed_samples=16 * n, total_steps=200,
        )  # fmt: skip
        printer.handle(step)
    return [line.split("] ", 1)[1] for line in out.getvalue().splitlines() if "] step " in line]


def test_cpu_step_lines_name_ranks_and_no_mfu() -> None:
    cpu = step_lines("cpu")
    assert len(cpu) == 3
    for line in cpu:
        assert "GPU" not in line and "MFU" not in line
        assert "FLOP/s/rank 21.3G" in line


def test_gpu_step_lines_keep_tflops_per_gpu_and_mfu() -> None:
    """The control: the same events on GPUs print what the CPU lines must not."""
    for line in step_lines("gpu"):
        assert "TFLOPs/GPU 0.0213" in line and "MFU 22.0%" in line
