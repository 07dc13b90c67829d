"""The GPU measurements the project still owes, in one command on one H100 or H200, within one deadline.

    python bench/gpu_campaign.py --out DIR [--wheels DIR] [--deadline SECONDS] [--kernels-cache FILE]
                                 [--only NAMES] [--dry-run]

In order: the GPU kernel tests (`pytest -m gpu tests/kernels`), `./bloom_appliance.py preflight` of bloom-7b1's plan
for an 8 x H100 node, flash attention's host time per call (`python -m bench.flash_host_cost --cuda`), then
`./bloom_appliance.py bench` for the trainer against transformers + torch.compile at bloom-560m micro-batches 2
(with `--profile`) and 8 and bloom-1b7 micro-batch 8, `preflight` of BLOOM-176B's layout on 48 A100 nodes and its
first step-down, and bloom-1b7 micro-batches 2 and 16 (`runs`). Every output lands in DIR: one JSON per bench, its
log, the kernel tests' log, preflight-<model>/preflight.json, flash-host-cost.json, kernels.json (every kernel
measurement the benches made: each op's candidates and flash attention's tiles, timed at each shape), attention.json
(flash attention's TFLOP/s forward + backward per tile configuration, from those timings) and campaign.json (each
run's status, seconds and timeout, the GPU, the deadline).

The deadline (default 480 s, counted from the start, wheel installation included) bounds everything: a run starts
only when the time left is at least its floor (the least in which it can finish anything), and gets at most its
estimate x SLACK or what is left, whichever is less; a run past its time is stopped (its process group) and recorded
as "timed out", a run not started as "skipped" with the time that was left. The estimates come from the H200 runs of
2026-11-26 (docs/PERFORMANCE.md): about 90 s for the kernel selection at a shape it has not measured (kernels.json
keeps it: a second campaign with --kernels-cache DIR/kernels.json of the first skips that), the model's build and
compile, the warm-up and timed steps, then transformers + torch.compile's own compile and steps.

--wheels DIR: a GPU node without a package index gets the project's missing packages from DIR's wheels (installed
with pip --no-index into --site, default <temp>/bloom-campaign-site, with DIR/extra/ copied beside them), put first
on PYTHONPATH for every run. --only NAMES: those runs alone (a second call for what the deadline skipped).
--dry-run prints the plan (each run, its estimate, floor and command) and exits 0.
"""

from __future__ import annotations

import sys
from pathlib import Path

# bench/ holds a tokenize.py that would shadow the standard library's: keep bench/ off the import path, put the
# repository root on it.
_HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _HERE]
sys.path.insert(0, str(_HERE.parent))

import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import shlex  # noqa: E402
import shutil  # noqa: E402
import signal  # noqa: E402
import subprocess  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from collections.abc import Callable, Sequence  # noqa: E402
from dataclasses import dataclass, field  # noqa: E402
from typing import Any  # noqa: E402

ROOT = _HERE.parent
DEADLINE_S = 480.0
SLACK = 1.5  # a run may take this many times its estimate before it is stopped
SUMMARY_RESERVE_S = 5.0  # kept back for copying kernels.json and writing the summaries
TIMED_OUT = 124  # the status `timeout` gives a command it stopped


@dataclass(frozen=True)
class Run:
    """One command of the campaign: run from the repository root, its output to DIR/<name>.log."""

    name: str
    command: tuple[str, ...]
    estimate_s: float
    floor_s: float
    what: str


# The kernel selection at a shape kernels.json does not hold: about 90 s on an H200 (2026-11-26, bloom-560m), more
# where the block-level check compiles the block under two to four choices. Nothing with --kernels-cache.
SELECTION_S = 90.0


def bench_run(
    python: str, out: Path, model: str, micro_batch: int, steps: int, body_s: float, *, selection_s: float,
    profile: bool = False,
) -> Run:  # fmt: skip
    """`bench` of the trainer and transformers + torch.compile at one micro-batch a step, to DIR/<name>.json.
    body_s: the estimate past the kernel selection (building and compiling both contenders, 3 warm-up and `steps`
    timed steps each, the profile's 3 more)."""
    name = f"{model}-mb{micro_batch}"
    command = (
        python, "bloom_appliance.py", "bench", "--model", model, "--micro-batch", str(micro_batch), "--steps",
        str(steps), "--contenders", "trainer,hf-compile", "--no-kernel-table", "--out", str(out / f"{name}.json"),
        *(["--profile"] if profile else []),
    )  # fmt: skip
    what = f"{model} at micro-batch {micro_batch}: trainer vs transformers + torch.compile" + ", profiled" * profile
    return Run(name, command, body_s + selection_s, floor_s=min(body_s, 90.0), what=what)


def runs(python: str, out: Path, kernels_cached: bool = False) -> list[Run]:
    """The campaign, most wanted first: the kernels' correctness on the GPU, the bloom-560m steps the planner and
    the transformers comparison are judged by, then bloom-1b7 (a model the planner was not fitted on, head dim
    128). `kernels_cached`: an earlier campaign's kernels.json holds these shapes (no selection time)."""
    tests = (
        python, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rfE", "-m", "gpu", "tests/kernels",
        f"--junitxml={out / 'kernels-gpu.xml'}",
    )  # fmt: skip
    host_cost = (python, "-m", "bench.flash_host_cost", "--cuda", "--json", str(out / "flash-host-cost.json"))
    select = 0.0 if kernels_cached else SELECTION_S
    return [
        Run("kernels-gpu", tests, 90.0, 40.0, "the GPU kernel tests: training shapes against the fp32 twins"),
        preflight_run(python, out, "bloom-7b1", "h100-sxm5-x8-node", 120.0, "the one role of an 8 x H100 node's plan"),
        Run("flash-host-cost", host_cost, 45.0, 30.0, "flash attention's host time per call, its launches included"),
        bench_run(python, out, "bloom-560m", 2, 8, 120.0, selection_s=select, profile=True),
        bench_run(python, out, "bloom-560m", 8, 5, 90.0, selection_s=select),
        bench_run(python, out, "bloom-1b7", 8, 3, 120.0, selection_s=select),
        preflight_run(python, out, "bloom-176b", "jean-zay-a100-48n", 240.0, BLOOM_ROLES, "--step-downs", "1"),
        bench_run(python, out, "bloom-1b7", 2, 5, 90.0, selection_s=select),
        bench_run(python, out, "bloom-1b7", 16, 3, 120.0, selection_s=select),
    ]


BLOOM_ROLES = "BigScience's tp4 pp12 dp8 ZeRO-1 layout and its first step-down (memory; the times are an A100 plan's)"


def preflight_run(python: str, out: Path, model: str, hardware: str, estimate_s: float, what: str,
                  *extra: str) -> Run:  # fmt: skip
    """`preflight` of the plan for ``model`` on ``hardware``: each role built and stepped on this GPU, its figures
    beside the planner's, to DIR/preflight-<model>/preflight.json (its exit 2 when a role does not fit is a result,
    recorded there, not a failure of the campaign's machinery)."""
    command = (
        python, "bloom_appliance.py", "preflight", "--hardware", hardware, "--model", model, "--run-dir",
        str(out / f"preflight-{model}"), *extra,
    )  # fmt: skip
    return Run(f"preflight-{model}", command, estimate_s, floor_s=min(estimate_s, 90.0), what=f"preflight: {what}")


def install_run(python: str, wheels: Path, site: Path) -> Run:
    command = (
        python, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile", "--no-cache-dir",
        "--upgrade", "--target", str(site), *sorted(str(w) for w in wheels.glob("*.whl")),
    )  # fmt: skip
    return Run("install-wheels", command, 30.0, 30.0, f"the wheels of {wheels} into {site}")


# ----- the deadline -------------------------------------------------------------------------------------------------
Execute = Callable[[Run, float], int]  # (run, timeout in seconds) -> exit status, TIMED_OUT when stopped


@dataclass
class Campaign:
    """Runs one after the other within `deadline_s` of the clock's first reading (the module docstring)."""

    deadline_s: float
    execute: Execute
    clock: Callable[[], float] = time.monotonic
    say: Callable[[str], None] = print
    results: list[dict[str, Any]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.start = self.clock()

    def elapsed(self) -> float:
        return self.clock() - self.start

    def left_s(self) -> float:
        return self.deadline_s - SUMMARY_RESERVE_S - self.elapsed()

    def run(self, run: Run) -> dict[str, Any]:
        left = self.left_s()
        if left < run.floor_s:
            result = {"name": run.name, "status": "skipped", "left_s": round(left, 1), "floor_s": run.floor_s}
            self.say(f"[{self.elapsed():5.0f} s] skip {run.name}: {left:.0f} s left, it needs {run.floor_s:.0f}")
        else:
            timeout = min(left, run.estimate_s * SLACK)
            self.say(f"[{self.elapsed():5.0f} s] {run.name} ({run.what}), at most {timeout:.0f} s")
            began = self.clock()
            status = self.execute(run, timeout)
            seconds = self.clock() - began
            state = "ok" if status == 0 else "timed out" if status == TIMED_OUT else "failed"
            result = {"name": run.name, "status": state, "exit_status": status, "seconds": round(seconds, 1),
                      "timeout_s": round(timeout, 1), "estimate_s": run.estimate_s}  # fmt: skip
            self.say(f"[{self.elapsed():5.0f} s] {run.name}: {state} in {seconds:.0f} s")
        self.results.append(result)
        return result


def execute_in(out: Path, env: dict[str, str]) -> Execute:
    """Run a command from the repository root, stdout and stderr to out/<name>.log, stopped (its whole process
    group) at its timeout."""

    def execute(run: Run, timeout: float) -> int:
        with (out / f"{run.name}.log").open("w") as log:
            child = subprocess.Popen(
                run.command, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
            try:
                return child.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                os.killpg(child.pid, signal.SIGTERM)  # the bench and the compile workers it started
                try:
                    child.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    os.killpg(child.pid, signal.SIGKILL)
                    child.wait()
                return TIMED_OUT

    return execute


# ----- what the runs left -------------------------------------------------------------------------------------------
def attention_tflops(kernels_json: dict[str, Any]) -> list[dict[str, Any]]:
    """Flash attention's TFLOP/s, forward + backward, per tile configuration timed at each shape in kernels.json.
    FLOPs as FlashAttention counts them: the forward's two products 4 b h s^2 d, halved under the causal mask; the
    backward 2.5 times the forward (five products to the forward's two): 7 b h s^2 d in all."""
    from kernels.selection_cache import parse

    rows = []
    for key, record in parse(kernels_json).items():
        tiles = record.get("flash_tiles") if key.op == "flash_alibi_attention" else None
        if not tiles:
            continue
        shape = dict(key.shape)
        flops = 7 * shape["micro_batch_size"] * shape["heads"] * shape["seq_len"] ** 2 * shape["head_dim"]
        for label, ms in sorted(tiles["times_ms"].items(), key=lambda kv: kv[1]):
            rows.append({"device": key.device, **shape, "tiles": label, "ms": ms, "tflops": flops / ms / 1e9})
    return rows


def bench_kernels() -> Path:
    """The kernels.json `bench` keeps its selections in (run from the repository root)."""
    from appliance.benchmark.trainer_speed import KERNELS_CACHE

    return ROOT / KERNELS_CACHE


def summarise(out: Path, results: list[dict[str, Any]], deadline_s: float, source: Path) -> dict[str, Any]:
    """`source` (the benches' kernels.json) and attention.json into `out`, then campaign.json: each run's result,
    the GPU, the deadline."""
    attention: list[dict[str, Any]] = []
    if source.exists():
        shutil.copyfile(source, out / "kernels.json")
        try:
            attention = attention_tflops(json.loads(source.read_text()))
        except (ValueError, KeyError, TypeError) as error:
            attention = [{"error": f"kernels.json: {error}"}]
    (out / "attention.json").write_text(json.dumps(attention, indent=1) + "\n")
    summary = {"deadline_s": deadline_s, "gpu": _gpu(), "runs": results}
    (out / "campaign.json").write_text(json.dumps(summary, indent=1) + "\n")
    return summary


def _gpu() -> str:
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return "no nvidia-smi"
    query = [smi, "--query-gpu=name,memory.total,power.limit,driver_version", "--format=csv,noheader"]
    return subprocess.run(query, capture_output=True, text=True, timeout=30).stdout.strip()


def seed_kernels(cache: Path, target: Path) -> None:
    """Add the entries of an earlier campaign's kernels.json to `target`, the one `bench` keeps (entries it holds
    already stay)."""
    from kernels.selection_cache import SelectionCache

    target.parent.mkdir(parents=True, exist_ok=True)
    merged = SelectionCache.load(target)
    for key, record in SelectionCache.load(cache).items():
        if merged.get(key) is None:
            merged.put(key, record)
    merged.save(target)


# ----- the command --------------------------------------------------------------------------------------------------
def plan_text(plan: Sequence[Run], deadline_s: float) -> str:
    lines = [f"GPU campaign, deadline {deadline_s:.0f} s ({SUMMARY_RESERVE_S:.0f} s kept for the summary):"]
    total = 0.0
    for run in plan:
        total += run.estimate_s
        lines.append(f"  {run.name:16} ~{run.estimate_s:4.0f} s (from {total - run.estimate_s:4.0f} s; needs "
                     f"{run.floor_s:.0f} s left)  {run.what}")  # fmt: skip
        lines.append(f"  {'':16} {shlex.join(run.command)}")
    skipped = [run.name for run in _beyond(plan, deadline_s - SUMMARY_RESERVE_S)]
    lines.append(f"estimated {total:.0f} s in all" + (f"; past the deadline: {', '.join(skipped)}" * bool(skipped)))
    return "\n".join(lines)


def _beyond(plan: Sequence[Run], budget_s: float) -> list[Run]:
    """The runs the estimates say would not start: those whose floor exceeds what their predecessors leave."""
    used, late = 0.0, []
    for run in plan:
        if budget_s - used < run.floor_s:
            late.append(run)
        else:
            used += min(run.estimate_s, budget_s - used)
    return late


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="the folder every output goes to (created)")
    parser.add_argument("--wheels", type=Path, help="install these wheels first (a node without a package index)")
    parser.add_argument("--site", type=Path, default=Path(tempfile.gettempdir()) / "bloom-campaign-site",
                        help="where --wheels installs (default: %(default)s)")  # fmt: skip
    parser.add_argument("--deadline", type=float, default=DEADLINE_S, help="seconds for everything (default 480)")
    parser.add_argument("--kernels-cache", type=Path, help="an earlier campaign's kernels.json: its shapes are not "
                        "measured again")  # fmt: skip
    parser.add_argument("--only", metavar="NAMES", help="these runs alone, comma-separated (the dry run names them): "
                        "a second call for what the first skipped")  # fmt: skip
    parser.add_argument("--python", default=sys.executable, help="the interpreter every run uses")
    parser.add_argument("--dry-run", action="store_true", help="print the plan and its estimates, run nothing")
    args = parser.parse_args(argv)
    if args.wheels is not None and not args.wheels.is_dir():
        parser.error(f"--wheels {args.wheels}: not a folder")
    if args.kernels_cache is not None and not args.kernels_cache.is_file():
        parser.error(f"--kernels-cache {args.kernels_cache}: no such file")
    out = args.out.resolve()
    plan = runs(args.python, out, kernels_cached=args.kernels_cache is not None)
    if args.only:
        wanted, names = [name.strip() for name in args.only.split(",")], [run.name for run in plan]
        unknown = [name for name in wanted if name not in names]
        if unknown:
            parser.error(f"--only: no run named {', '.join(unknown)} (the runs: {', '.join(names)})")
        plan = [run for run in plan if run.name in wanted]
    if args.wheels:
        plan.insert(0, install_run(args.python, args.wheels, args.site))
    print(plan_text(plan, args.deadline), flush=True)
    if args.dry_run:
        return 0
    out.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, PYTHONUNBUFFERED="1", BLOOM_NO_REEXEC="1")
    env.pop("BLOOM_KERNELS", None)  # the kernel selection measures (and tunes flash attention's tiles)
    if args.wheels:
        env["PYTHONPATH"] = os.pathsep.join([str(args.site), str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    if args.kernels_cache:
        seed_kernels(args.kernels_cache, bench_kernels())
    campaign = Campaign(args.deadline, execute_in(out, env), say=lambda line: print(line, flush=True))
    for run in plan:
        result = campaign.run(run)
        if run.name == "install-wheels" and result["status"] == "ok" and (args.wheels / "extra").is_dir():
            shutil.copytree(args.wheels / "extra", args.site, dirs_exist_ok=True)
    summary = summarise(out, campaign.results, args.deadline, bench_kernels())
    failed = [r["name"] for r in summary["runs"] if r["status"] in ("failed", "timed out")]
    print(f"results in {out}: " + ", ".join(f"{r['name']} {r['status']}" for r in summary["runs"]), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
