"""`run --nnodes`: node 0 preflights the final plan (a `preflight` child process, as a stage keyed on plan.json)
after the data stages and before the train stage; the other nodes wait for it, and a role that does not fit ends
the run with exit 2 on node 0 and on the others.

The micro model on the CPU profile over 30 documents: the data stages take a second, each preflight about ten (the
child imports torch and DeepSpeed). The train stage's launch is replaced by one that records what it found and
stops the run (TrainLaunched), so no rank starts."""

from __future__ import annotations

import gzip
import io
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from appliance import head_run
from appliance.atomic import write_atomic
from appliance.cli import main
from appliance.cli_parser import build_parser
from appliance.errors import BadInput
from appliance.hardware.scaled import hardware_for
from appliance.monitor.events import EventWriter
from appliance.monitor.headless import HeadlessPrinter
from appliance.output_dirs import make_run_dir
from appliance.planner import load_model_shape, make_plan
from appliance.planner.layout import parse_layout_fields
from appliance.planner.runspec import load_spec
from appliance.run_request import RunRequest
from appliance.rundir import RunDir
from appliance.train import launch
from appliance.train.nodes import NodeGroup
from appliance.train.preflight_check import preflight_log, run_preflight

ROOT = Path(__file__).resolve().parents[2]
MODEL, HARDWARE = "bloom-micro-test", "cpu-laptop-2core"
MASTER = ("127.0.0.1", 29611)  # never listened on: the train launch is replaced
OVER_LAYOUT = "tp=2,pp=2,dp=2"  # 8 CPU ranks: with 4 GB of RAM, 410 MiB a rank, under what each one needs


class TrainLaunched(Exception):
    """The replaced train launch stops the run here."""


def node(rank: int) -> NodeGroup:
    return NodeGroup(nnodes=2, node_rank=rank, master_host=MASTER[0], master_port=MASTER[1])


def corpus(path: Path) -> Path:
    """A .jsonl of the sample corpus's first English documents."""
    from appliance.data.sample_corpus import SAMPLE_CORPUS_DIR

    with gzip.open(SAMPLE_CORPUS_DIR / "en.jsonl.gz", "rt", encoding="utf-8") as f:
        texts = [json.loads(line)["text"] for _, line in zip(range(30), f, strict=False)]
    path.write_text("".join(json.dumps({"text": text, "lang": "en"}) + "\n" for text in texts))
    return path


@pytest.fixture(scope="module")
def launches() -> Iterator[list[dict[str, Any]]]:
    """The train launches, each as what it found: stages.json's records and whether preflight.json existed."""
    found: list[dict[str, Any]] = []

    def run_plan(run_dir: RunDir, *, nodes: NodeGroup | None = None, **_: Any) -> int:
        records = json.loads(run_dir.manifest.read_text())
        found.append({"run_dir": run_dir.root, "records": records, "preflight": run_dir.preflight.exists()})
        raise TrainLaunched(str(run_dir.root))

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(launch, "run_plan", run_plan)
        yield found


@pytest.fixture(scope="module")
def inputs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return corpus(tmp_path_factory.mktemp("corpus") / "in.jsonl")


def head(run_dir: Path, inputs: Path, **request: Any) -> None:
    """Node 0's `run`, up to the train launch."""
    req = RunRequest(corpus=[inputs], run_dir=run_dir, model=MODEL, hardware=HARDWARE, nodes=node(0),
                     overrides={"workers": 1}, **request)  # fmt: skip
    with pytest.raises(TrainLaunched):
        head_run.run(req)


def events(run_dir: Path, kind: str) -> list[dict[str, Any]]:
    lines = RunDir(run_dir).metrics.read_text().splitlines()
    return [e for e in map(json.loads, lines) if e["kind"] == kind]


@pytest.fixture(scope="module")
def preflighted(tmp_path_factory: pytest.TempPathFactory, inputs: Path, launches: list[dict[str, Any]]) -> Path:
    run_dir = tmp_path_factory.mktemp("head") / "run"
    head(run_dir, inputs)
    return run_dir


def test_node_0_preflights_the_final_plan_before_the_train_stage(
    preflighted: Path, launches: list[dict[str, Any]]
) -> None:
    launch_seen = next(x for x in launches if x["run_dir"] == preflighted)
    assert launch_seen["preflight"] and "preflight" in launch_seen["records"]
    assert launch_seen["records"]["preflight"]["key"] == head_run.preflight_key(RunDir(preflighted))
    stages = [(e["name"], e["state"]) for e in events(preflighted, "stage")]
    assert stages.index(("data", "done")) < stages.index(("preflight", "started"))
    assert stages.index(("preflight", "done")) < stages.index(("train", "started"))
    # The plan it checked is the run's final one, the plan the ranks train.
    record = json.loads(RunDir(preflighted).preflight.read_text())
    assert record["layout"] == load_spec(RunDir(preflighted).plan).layout.describe()
    (event,) = events(preflighted, "preflight")
    assert [(r["role"], r["fits"]) for r in event["roles"]] == [("whole", True)]


def test_the_headless_log_prints_a_line_per_role(preflighted: Path) -> None:
    out = io.StringIO()
    printer = HeadlessPrinter(stream=out)
    for event in events(preflighted, "preflight"):
        printer.handle(event)
    lines = out.getvalue().splitlines()
    layout = events(preflighted, "preflight")[0]["layout"]
    assert lines[0].endswith(f"preflight {MODEL} at {layout}: every role fits")
    assert lines[1].startswith("  whole (stages [0]): fits, ") and " ms per micro-batch (planned " in lines[1]


def test_a_rerun_of_the_same_plan_skips_the_recorded_preflight(preflighted: Path, inputs: Path) -> None:
    before = RunDir(preflighted).preflight.stat().st_mtime_ns
    head(preflighted, inputs)
    states = [e["state"] for e in events(preflighted, "stage") if e["name"] == "preflight"]
    assert states == ["started", "done", "skipped"]  # the first launch ran it (the control), the rerun did not
    assert RunDir(preflighted).preflight.stat().st_mtime_ns == before
    assert preflight_log(RunDir(preflighted)).read_text().count("$ ") == 1


def test_the_other_node_starts_once_node_0s_preflight_is_recorded(
    preflighted: Path, launches: list[dict[str, Any]]
) -> None:
    with pytest.raises(TrainLaunched):
        head_run.run_on_other_node(RunRequest(corpus=[], run_dir=preflighted, nodes=node(1)), node(1), wait_s=5)
    assert launches[-1]["run_dir"] == preflighted


@pytest.fixture(scope="module")
def unchecked(tmp_path_factory: pytest.TempPathFactory, inputs: Path, launches: list[dict[str, Any]]) -> Path:
    run_dir = tmp_path_factory.mktemp("no-preflight") / "run"
    head(run_dir, inputs, preflight=False)
    return run_dir


def test_no_preflight_trains_without_it(unchecked: Path, launches: list[dict[str, Any]]) -> None:
    launch_seen = next(x for x in launches if x["run_dir"] == unchecked)
    assert not launch_seen["preflight"] and "preflight" not in launch_seen["records"]
    assert "data" in launch_seen["records"]  # control: the launch saw the data stages
    assert not [e for e in events(unchecked, "stage") if e["name"] == "preflight"]
    parser = build_parser()
    assert parser.parse_args(["run", "--no-preflight"]).preflight is False
    assert parser.parse_args(["run"]).preflight is None
    assert RunRequest(corpus=[], nodes=node(0)).preflights and not RunRequest(corpus=[]).preflights
    assert not RunRequest(corpus=[], nodes=node(0), preflight=False).preflights


def test_the_other_node_waits_for_node_0s_preflight(unchecked: Path, launches: list[dict[str, Any]]) -> None:
    """The data stages are there, the preflight is not: a node that expects one waits (here 0.3 s), and one given
    --no-preflight too starts (the control)."""
    with pytest.raises(BadInput, match=r"node 0's preflight did not end in 0 s; give --no-preflight on every node"):
        head_run.run_on_other_node(RunRequest(corpus=[], run_dir=unchecked, nodes=node(1)), node(1), wait_s=0.3)
    request = RunRequest(corpus=[], run_dir=unchecked, nodes=node(1), preflight=False)
    with pytest.raises(TrainLaunched):
        head_run.run_on_other_node(request, node(1), wait_s=5)


def small_hardware(tmp_path: Path) -> Path:
    """cpu-laptop-2core with 4 GB of RAM (tests/unit/test_preflight.py): the micro model at tp=2, pp=2, dp=2 does
    not fit its 8 ranks."""
    text = (ROOT / "presets" / "hardware" / f"{HARDWARE}.toml").read_text()
    lines = ["ram_gb = 4" if line.startswith("ram_gb") else line for line in text.splitlines()]
    lines = [f'name = "{HARDWARE}-small"' if line.startswith("name") else line for line in lines]
    path = tmp_path / "small.toml"
    path.write_text("\n".join(lines) + "\n")
    return path


def test_a_plan_that_does_not_fit_ends_the_run_with_exit_2_on_every_node(
    tmp_path: Path, inputs: Path, launches: list[dict[str, Any]], capsys: pytest.CaptureFixture[str]
) -> None:
    """The plan in the run directory beforehand, as `sbatch` writes it (the planner would refuse to make it)."""
    spec = make_plan(hardware_for(str(small_hardware(tmp_path))), load_model_shape(MODEL),
                     fixed=parse_layout_fields(OVER_LAYOUT)).spec()  # fmt: skip
    run_dir, _ = make_run_dir(tmp_path / "run")
    write_atomic(run_dir.plan, spec.dumps())
    flags = ["--nnodes", "2", "--node-rank", "0", "--master", "{}:{}".format(*MASTER), "--layout", OVER_LAYOUT]
    code = main(["run", "--headless", "--corpus", str(inputs), "--run-dir", str(run_dir.root), *flags])
    out, err = capsys.readouterr()
    assert code == 2, err
    message = err.strip().splitlines()[-1]
    assert message.startswith("error: preflight: does not fit the device's memory: role first (stage 0"), message
    assert "MiB of 409.6 MiB" in message
    assert "DOES NOT FIT: first, last" in out and "  last (stages [1]): DOES NOT FIT, " in out
    assert not [x for x in launches if x["run_dir"] == run_dir.root]  # no node trains
    assert "preflight" not in json.loads(run_dir.manifest.read_text())  # a rerun checks again
    # The other node: exit 2 with node 0's verdict, not a wait for a rendezvous that never comes.
    with pytest.raises(BadInput, match=r"node 0's preflight: does not fit the device's memory: role first \(stages"):
        head_run.run_on_other_node(RunRequest(corpus=[], run_dir=run_dir.root, nodes=node(1)), node(1), wait_s=5)


def test_a_preflight_that_fails_otherwise_is_an_error_naming_its_log(tmp_path: Path) -> None:
    """Not a refusal (exit 2) but another exit: a RuntimeError that names logs/preflight.log, which holds the
    command; no `preflight` event, since no preflight.json was written."""
    run_dir = RunDir(tmp_path / "run").make()
    with pytest.raises(RuntimeError, match=r"preflight failed \(exit code 1\); its output: .*/logs/preflight\.log"):
        run_preflight(run_dir, EventWriter(run_dir.metrics), python="/bin/false")
    assert preflight_log(run_dir).read_text().startswith("$ /bin/false ")
    assert not run_dir.metrics.read_text()
