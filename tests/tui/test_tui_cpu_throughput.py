"""The throughput panel of a CPU run (the recorded 2-core run): FLOP/s per rank, not TFLOPs per GPU, and no MFU
against the planner's assumed CPU peak; the recorded 8-GPU run, the control, keeps TFLOPs/GPU and its MFU."""

from __future__ import annotations

import asyncio
import re

from tui_support import widget_text

from appliance.rundir import RunDir
from appliance.tui.app import make_app


def throughput(run_dir: RunDir) -> str:
    async def main() -> str:
        app = make_app(run_dir.root, follow=False, poll_interval=0.05)
        async with app.run_test(size=(160, 50)) as pilot:
            while app.reads_done < 1:
                await pilot.pause(0.02)
            await pilot.pause()
            return widget_text(app.query_one("#throughput"))

    return asyncio.run(main())


def test_cpu_run_shows_flops_per_rank_and_no_mfu(cpu_run: RunDir, gpu_run: RunDir) -> None:
    cpu = throughput(cpu_run)
    assert "FLOP/s/rank" in cpu and "GPU" not in cpu
    mfu = next(line for line in cpu.splitlines() if "MFU" in line)
    assert "no measured CPU peak" in mfu and not re.search(r"\d%", mfu)
    gpu = throughput(gpu_run)
    assert "TFLOPs/GPU" in gpu and re.search(r"MFU\s+\d+\.\d%", gpu)
