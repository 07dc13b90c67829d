"""How much CPU the dashboard needs to follow a 384-GPU run: the goal is under 5% of one core.

The stream is what a BLOOM-176B run on 48 nodes x 8 GPUs writes: every node's sampler emits a `gpu` event (8
devices) and an `energy` event every 5 s, the nodes spread over the interval; a `step` event every ~105 s; a
checkpoint every 200 steps. That is 2 x 48 / 5 = 19.2 events/s, about 14 kB/s.

Two measurements, in one run:
  1. reader + reducer (EventTail + monitor.state.reduce, what the dashboard's reader thread runs): a writer thread
     writes simulated hours at `--speedup` x the real rate while the reader polls every 0.5 s / speedup, so each
     poll sees the batch it would see live. The reader thread's CPU time / simulated seconds is its share of one
     core at the real rate. Then a cold catch-up: a fresh reader reads the whole file at once (attaching late).
  2. the dashboard itself (Textual, headless, 160 x 50, polling every 0.5 s) on a live stream written at the real
     rate for `--app-seconds`, after the history of part 1: process CPU time minus the writer thread's, per
     wall second.
  3. the same in a real terminal: run_tui in a private tmux server (160 x 50), its process CPU time from /proc,
     per wall second (skipped without tmux).
The live reader keeps metrics.snapshot as the head's follower does (monitor/snapshot.py, every 300 simulated s),
so its share includes the saves.

Cold attach (`--attach-days 1,7`): metrics.jsonl holds that many simulated days of the 48-node run, a snapshot
the follower saved, then the 300 s of events written since (its save interval: the worst case). Measured in a
fresh process each: the reader (load the snapshot, read and fold the tail) and the dashboard (Textual headless,
from make_app to its first read drawn). `--baseline` also times the full read without a snapshot (minutes a day).

    .venv/bin/python bench/tui_tail.py [--hours 2] [--speedup 200] [--app-seconds 30]
    .venv/bin/python bench/tui_tail.py --attach-days 1,7 [--baseline]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from appliance.monitor.events import EventTail  # noqa: E402
from appliance.monitor.snapshot import SAVE_EVERY_S, SnapshotSaver, save_snapshot  # noqa: E402
from appliance.monitor.state import RunState, reduce  # noqa: E402

NODES, GPUS_PER_NODE = 48, 8
SAMPLE_S = 5.0  # GpuSampler's default interval
STEP_S = 105.0  # BLOOM-176B: 2048 x 2048 tokens a step on 384 A100s
POLL_S = 0.5  # make_app's default poll interval


def node_events(node: int, t: float, elapsed_h: float) -> list[dict[str, Any]]:
    devices = [
        {
            "index": i,
            "name": "NVIDIA A100-SXM4-80GB",
            "util": 97.0 + math.sin(t + i),
            "memory_used_gb": 71.3,
            "memory_total_gb": 80.0,
            "temperature_c": 63.0 + (node + i) % 9,
            "power_w": round(390.0 + 10 * math.sin(t / 7 + i), 1),
        }
        for i in range(GPUS_PER_NODE)
    ]
    gpu_kwh = GPUS_PER_NODE * 0.4 * elapsed_h
    kwh = gpu_kwh + 0.3 * elapsed_h
    energy = {
        "kwh": kwh,
        "co2_kg": kwh * 1.2 * 57 / 1000,
        "gpu_kwh": gpu_kwh,
        "cpu_kwh": kwh - gpu_kwh,
        "source": "nvml_energy_counter",
        "pue": 1.2,
        "grid_g_per_kwh": 57.0,
    }
    name = f"jz-node{node:02d}"
    return [
        {"t": t, "kind": "gpu", "node": name, "devices": devices},
        {"t": t, "kind": "energy", "node": name, **energy},
    ]


def step_event(step: int, t: float) -> dict[str, Any]:
    return {
        "t": t,
        "kind": "step",
        "step": step,
        "loss": 2.2 + 9 * math.exp(-step / 2000),
        "lr": 6e-5,
        "grad_norm": 0.9,
        "tokens_per_s": 2048 * 2048 / STEP_S,
        "tflops_per_gpu": 149.5,
        "mfu": 0.479,
        "consumed_samples": step * 2048,
        "total_steps": 95_000,
    }


def schedule(start_s: float, end_s: float, t0: float) -> Iterator[tuple[float, list[dict[str, Any]]]]:
    """(seconds since the run started, events) in time order, for the simulated window [start_s, end_s)."""
    ticks: list[tuple[float, int]] = []  # (offset, node or -1 for a step)
    first = math.floor(start_s / SAMPLE_S)
    for k in range(first, math.ceil(end_s / SAMPLE_S) + 1):
        for node in range(NODES):
            ticks.append((k * SAMPLE_S + node * SAMPLE_S / NODES, node))
    for k in range(math.ceil(start_s / STEP_S), math.ceil(end_s / STEP_S) + 1):
        ticks.append((k * STEP_S, -1))
    for offset, who in sorted(ticks):
        if not start_s <= offset < end_s:
            continue
        t = t0 + offset
        if who < 0:
            step = round(offset / STEP_S)
            events = [step_event(step, t)]
            if step % 200 == 0:
                events.append({"t": t, "kind": "checkpoint", "step": step, "path": "c", "seconds": 45, "bytes": 2.3e12})
            yield offset, events
        else:
            yield offset, node_events(who, t, offset / 3600)


class Writer(threading.Thread):
    """Appends the schedule to metrics.jsonl, `speedup` times faster than real time; measures its own CPU."""

    def __init__(self, path: Path, start_s: float, end_s: float, t0: float, speedup: float) -> None:
        super().__init__(daemon=True)
        self.path, self.start_s, self.end_s, self.t0, self.speedup = path, start_s, end_s, t0, speedup
        self.cpu_s = 0.0
        self.events = 0

    def run(self) -> None:
        cpu0 = time.thread_time()
        wall0 = time.monotonic()
        with open(self.path, "a", encoding="utf-8") as f:
            for offset, events in schedule(self.start_s, self.end_s, self.t0):
                delay = wall0 + (offset - self.start_s) / self.speedup - time.monotonic()
                if delay > 0:
                    f.flush()
                    time.sleep(delay)
                f.write("".join(json.dumps(e, separators=(",", ":")) + "\n" for e in events))
                self.events += len(events)
        self.cpu_s = time.thread_time() - cpu0


def bench_reader(path: Path, hours: float, speedup: float) -> dict[str, float]:
    sim_s = hours * 3600
    writer = Writer(path, 0.0, sim_s, t0=1.7e9, speedup=speedup)
    tail, state, cpu, polls, read = EventTail(path), RunState(), 0.0, 0, 0
    saver = SnapshotSaver(path, every_s=SAVE_EVERY_S / speedup)
    writer.start()
    while True:
        done = not writer.is_alive()
        start = time.thread_time()
        for event in tail.read_new():
            reduce(state, event)
            read += 1
        state.take_changed()
        saver.maybe_save(state, tail)
        cpu += time.thread_time() - start
        polls += 1
        if done:
            break
        time.sleep(POLL_S / speedup)
    catch_up_start = time.perf_counter()
    fresh = RunState()
    for event in EventTail(path).read_new():
        reduce(fresh, event)
    catch_up_s = time.perf_counter() - catch_up_start
    return {
        "simulated_s": sim_s,
        "events": read,
        "events_per_s": read / sim_s,
        "polls": polls,
        "reader_core_pct": 100 * cpu / sim_s,
        "catch_up_s": catch_up_s,
        "catch_up_events_per_s": read / catch_up_s,
        "gpus": fresh.gpu_count,
    }


def bench_app(path: Path, history_s: float, seconds: float) -> dict[str, float]:
    from appliance.tui.app import make_app

    async def main() -> dict[str, float]:
        app = make_app(path.parent, follow=True, poll_interval=POLL_S)
        async with app.run_test(size=(160, 50)) as pilot:
            while app.reads_done < 1:
                await pilot.pause(0.05)
            await pilot.pause(2.0)  # let the first full draw of the history settle
            # The live part continues the simulated run at the real rate, stamped with the real clock.
            writer = Writer(path, history_s, history_s + seconds, t0=time.time() - history_s, speedup=1.0)
            reads0, cpu0, wall0 = app.reads_done, time.process_time(), time.monotonic()
            writer.start()
            while writer.is_alive():
                await asyncio.sleep(0.25)  # not pilot.pause(): the bench must not add work of its own
            cpu, wall = time.process_time() - cpu0 - writer.cpu_s, time.monotonic() - wall0
            return {
                "wall_s": wall,
                "live_events": writer.events,
                "reads": app.reads_done - reads0,
                "app_core_pct": 100 * cpu / wall,
            }

    return asyncio.run(main())


def bench_terminal(path: Path, history_s: float, seconds: float) -> dict[str, float] | None:
    """run_tui in a real terminal (a private tmux server, 160 x 50): the app process's CPU from /proc."""
    if shutil.which("tmux") is None or not Path("/proc/self/stat").exists():
        return None
    tmux = ["tmux", "-S", str(path.parent / "tmux.sock")]  # a private server, gone with the temp dir
    code = f"from pathlib import Path; from appliance.tui.app import run_tui; run_tui(Path({str(path.parent)!r}))"
    run = f"unset COLUMNS LINES && exec {shlex.quote(sys.executable)} -c {shlex.quote(code)}"
    shell = f"cd {shlex.quote(str(REPO))} && {run}"
    writer = Writer(path, history_s, history_s + seconds + 10, t0=time.time() - history_s, speedup=1.0)
    writer.start()
    subprocess.run([*tmux, "new-session", "-d", "-s", "tui", "-x", "160", "-y", "50", shell], check=True)
    try:
        pid = subprocess.run(
            [*tmux, "list-panes", "-t", "tui", "-F", "#{pane_pid}"], capture_output=True, text=True, check=True
        ).stdout.strip()
        ticks = os.sysconf("SC_CLK_TCK")

        def cpu_s() -> float:  # utime + stime, fields 14 and 15 of /proc/PID/stat
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            return (int(fields[11]) + int(fields[12])) / ticks

        deadline = time.monotonic() + 120
        while (
            "GPUs: 384"
            not in subprocess.run([*tmux, "capture-pane", "-p", "-t", "tui"], capture_output=True, text=True).stdout
        ):  # start-up and catching up on the history are not the steady state being measured
            if time.monotonic() > deadline:
                raise RuntimeError("the dashboard did not show the run within 120 s")
            time.sleep(0.5)
        time.sleep(3.0)
        cpu0, wall0 = cpu_s(), time.monotonic()
        time.sleep(seconds)
        return {"wall_s": time.monotonic() - wall0, "terminal_core_pct": 100 * (cpu_s() - cpu0) / seconds}
    finally:
        subprocess.run([*tmux, "kill-server"], capture_output=True, check=False)
        writer.join()


# ---- cold attach ---------------------------------------------------------------------------------------------
def write_history(path: Path, days: float, t0: float) -> RunState:
    """`days` of the schedule into metrics.jsonl, fast, an hour at a time: each node cycles through 16
    pre-rendered device lists (rendering 11 M events one by one would take longer than the measurement), folded
    on the way into the state the follower would hold. Returns that state."""
    variants = [
        [json.dumps(node_events(n, v * 0.37, 0.0)[0]["devices"], separators=(",", ":")) for v in range(16)]
        for n in range(NODES)
    ]
    parsed = [[json.loads(text) for text in node] for node in variants]
    state = RunState()
    end_s = days * 86400
    with open(path, "w", encoding="utf-8") as f:
        for hour_s in range(0, math.ceil(end_s), 3600):
            ticks = [
                (k * SAMPLE_S + n * SAMPLE_S / NODES, n)
                for k in range(hour_s // 5, (hour_s + 3600) // 5)
                for n in range(NODES)
            ]
            ticks += [(k * STEP_S, -1) for k in range(math.ceil(hour_s / STEP_S), math.ceil((hour_s + 3600) / STEP_S))]
            lines = []
            for offset, who in sorted(ticks):
                if not hour_s <= offset < min(end_s, hour_s + 3600):
                    continue
                t = t0 + offset
                if who < 0:
                    step = round(offset / STEP_S)
                    events = [step_event(step, t)]
                    if step % 200 == 0:
                        events.append(
                            {"t": t, "kind": "checkpoint", "step": step, "path": "c", "seconds": 45, "bytes": 2.3e12}
                        )
                    for event in events:
                        lines.append(json.dumps(event, separators=(",", ":")) + "\n")
                        reduce(state, event)
                    continue
                v, name, hours = round(offset / SAMPLE_S) % 16, f"jz-node{who:02d}", offset / 3600
                lines.append(f'{{"t":{t!r},"kind":"gpu","node":"{name}","devices":{variants[who][v]}}}\n')
                reduce(state, {"t": t, "kind": "gpu", "node": name, "devices": parsed[who][v]})
                kwh = (GPUS_PER_NODE * 0.4 + 0.3) * hours
                energy = {
                    "t": t,
                    "kind": "energy",
                    "node": name,
                    "kwh": kwh,
                    "co2_kg": kwh * 0.0684,
                    "source": "nvml_energy_counter",
                }
                lines.append(json.dumps(energy, separators=(",", ":")) + "\n")
                reduce(state, energy)
            f.write("".join(lines))
            state.take_changed()
    return state


ATTACH_PROBE = """
import json, sys, time
start, cpu = time.perf_counter(), time.process_time()
from pathlib import Path
from appliance.monitor.snapshot import attach
from appliance.monitor.state import reduce
state, tail, loaded = attach(Path(sys.argv[1]))
for event in tail.read_new():
    reduce(state, event)
wall_s, cpu_s = time.perf_counter() - start, time.process_time() - cpu
print(json.dumps({"s": wall_s, "cpu_s": cpu_s, "bytes_read": tail.bytes_read, "snapshot": loaded.reason or "used",
                  "gpus": state.gpu_count, "step": state.step}))
"""

APP_PROBE = """
import asyncio, json, sys, time
start, cpu = time.perf_counter(), time.process_time()
from pathlib import Path
from appliance.tui.app import make_app
async def main():
    app = make_app(Path(sys.argv[1]), follow=False)
    async with app.run_test(size=(160, 50)) as pilot:
        while app.reads_done < 1:
            await pilot.pause(0.01)
        return time.perf_counter() - start, time.process_time() - cpu, app.state.gpu_count, app.attach_note or "used"
s, cpu_s, gpus, note = asyncio.run(main())
print(json.dumps({"s": s, "cpu_s": cpu_s, "gpus": gpus, "snapshot": note}))
"""


def probe(code: str, run_dir: Path, repeat: int = 1) -> dict[str, Any]:
    """The probe's figures in a fresh process, `repeat` times: the fastest (wall and CPU seconds each), since on
    a shared machine the slower runs measure the neighbours."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    runs = []
    for _ in range(repeat):
        out = subprocess.run(
            [sys.executable, "-c", code, str(run_dir)], capture_output=True, text=True, env=env, check=True
        )
        runs.append(dict(json.loads(out.stdout.strip().splitlines()[-1])))
    return {**runs[0], "s": min(r["s"] for r in runs), "cpu_s": min(r["cpu_s"] for r in runs)}


def bench_attach(days: float, baseline: bool) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "metrics.jsonl"
        t0 = time.time() - days * 86400 - SAVE_EVERY_S
        write_start = time.perf_counter()
        state = write_history(path, days, t0)
        history_bytes = path.stat().st_size
        save_start = time.perf_counter()
        save_snapshot(path, state, history_bytes)
        save_s = time.perf_counter() - save_start
        writer = Writer(path, days * 86400, days * 86400 + SAVE_EVERY_S, t0=t0, speedup=1e9)
        writer.run()  # the events written since the snapshot, in this thread
        result: dict[str, Any] = {
            "days": days,
            "file_gb": path.stat().st_size / 1e9,
            "write_s": save_start - write_start,
            "snapshot_kb": (path.parent / "metrics.snapshot").stat().st_size / 1e3,
            "save_s": save_s,
            "tail_events": writer.events,
            "reader": probe(ATTACH_PROBE, path, repeat=5),
            "dashboard": probe(APP_PROBE, path.parent, repeat=3),
        }
        if baseline:
            (path.parent / "metrics.snapshot").unlink()
            result["full_read"] = probe(ATTACH_PROBE, path)
        return result


def main_attach(days_list: list[float], baseline: bool) -> None:
    for days in days_list:
        r = bench_attach(days, baseline)
        reader, app = r["reader"], r["dashboard"]
        print(
            f"{days:g} simulated days at {NODES} nodes: metrics.jsonl {r['file_gb']:.2f} GB (written in "
            f"{r['write_s']:.0f} s), snapshot {r['snapshot_kb']:.0f} kB saved in {1000 * r['save_s']:.0f} ms, "
            f"{r['tail_events']} events since"
        )
        print(
            f"  cold attach, reader: {reader['s']:.2f} s wall, {reader['cpu_s']:.2f} s CPU, best of 5 "
            f"({reader['bytes_read'] / 1e6:.1f} MB read, snapshot "
            f"{reader['snapshot']}, {reader['gpus']} GPUs, step {reader['step']})"
        )
        print(
            f"  cold attach, dashboard (Textual headless 160x50, to its first read drawn): {app['s']:.2f} s wall, "
            f"{app['cpu_s']:.2f} s CPU, best of 3"
        )
        if "full_read" in r:
            full = r["full_read"]
            print(
                f"  without the snapshot (reader): {full['s']:.1f} s wall, {full['cpu_s']:.1f} s CPU "
                f"({full['bytes_read'] / 1e9:.2f} GB read)"
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hours", type=float, default=2.0, help="simulated run length for the reader (default 2)")
    parser.add_argument("--speedup", type=float, default=200.0, help="how much faster than real time to write")
    parser.add_argument("--app-seconds", type=float, default=30.0, help="live seconds for the dashboard (0: skip)")
    parser.add_argument(
        "--attach-days", help="measure cold attach at these simulated days, e.g. 1,7 (and nothing else)"
    )
    parser.add_argument("--baseline", action="store_true", help="with --attach-days: also the full read")
    args = parser.parse_args()
    if args.attach_days:
        main_attach([float(d) for d in args.attach_days.split(",")], args.baseline)
        return
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "metrics.jsonl"
        reader = bench_reader(path, args.hours, args.speedup)
        print(
            f"reader+reducer: {reader['events']} events over {args.hours:g} simulated h "
            f"({reader['events_per_s']:.1f} events/s, {reader['gpus']} GPUs), {reader['polls']} polls: "
            f"{reader['reader_core_pct']:.2f}% of one core at the real rate"
        )
        print(
            f"catch-up (attaching to the finished {args.hours:g} h): {reader['catch_up_s']:.2f} s, "
            f"{reader['catch_up_events_per_s']:,.0f} events/s"
        )
        if args.app_seconds > 0:
            app = bench_app(path, args.hours * 3600, args.app_seconds)
            print(
                f"dashboard (Textual headless 160x50, poll 0.5 s, {app['live_events']} live events in "
                f"{app['wall_s']:.1f} s, {app['reads']} reads): {app['app_core_pct']:.2f}% of one core"
            )
        figures = [reader["reader_core_pct"]]
        if args.app_seconds > 0:
            figures.append(app["app_core_pct"])
            terminal = bench_terminal(path, args.hours * 3600 + args.app_seconds, args.app_seconds)
            if terminal is None:
                print("real terminal: skipped (needs tmux and /proc)")
            else:
                figures.append(terminal["terminal_core_pct"])
                print(
                    f"dashboard in a real terminal (tmux 160x50, {terminal['wall_s']:.1f} s live): "
                    f"{terminal['terminal_core_pct']:.2f}% of one core"
                )
        worst = max(figures)
        print(f"budget 5% of one core: {'met' if worst < 5 else 'NOT met'} (worst {worst:.2f}%)")


if __name__ == "__main__":
    main()
