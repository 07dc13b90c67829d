"""The SLURM scripts the appliance writes (`sbatch`: train/slurm.py; `prep --sbatch`: data/prep_slurm.py) under
hostile names: run directories, corpus paths, interpreters, partitions, accounts and model names that hold shell
syntax, quotes, spaces or sbatch's own syntax.

Each accepted script parses (`bash -n`), its `#SBATCH` lines read back, by sbatch's rules, to the intended words,
and it RUNS under bash with srun, sbatch, scontrol and python replaced by stubs that record their argv: every
hostile string reaches them as one intact word, nothing is executed from it (no PWNED file anywhere), and the
script creates only what it should, with its own permissions under a permissive umask (002). A value with a
control character, and a partition or account outside SLURM's characters, is refused with BadInput naming it.
"""

from __future__ import annotations

import dataclasses
import json
import re
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from appliance.cli import main
from appliance.data import prep_slurm
from appliance.data.prep_slurm import PrepJob, write_scripts
from appliance.errors import BadInput
from appliance.hardware.slurm import sbatch_word
from appliance.planner.runspec import load_spec
from appliance.train import slurm
from appliance.train.slurm import SlurmJob, job_for, sbatch_script

HOSTILE_NAMES = [
    "r$(touch PWNED)",
    "r`touch PWNED`",
    "r; touch PWNED",
    "r with  spaces",
    "r'single\"double",
    "r%j #hetjob",  # sbatch's reader: a comment, a heterogeneous job's separator, a file name pattern
    "-r",  # an option to whatever reads it as an argument
]
CONTROL_NAMES = ["r\ntouch PWNED", "r\rx", "r\x1b[2Jx"]

# Stands in for srun, sbatch, scontrol and python: records its argv, one JSON list per call, in $STUB_LOG/<name>.
# scontrol lists the allocation's first node; sbatch runs the job at once, as SLURM would later, and prints its id.
STUB = """#!{python}
import json, os, subprocess, sys
name = os.path.basename(sys.argv[0])
log = os.path.join(os.environ["STUB_LOG"], name + ".jsonl")
with open(log, "a") as out:
    out.write(json.dumps(sys.argv[1:]) + "\\n")
if "--preflight" in sys.argv[1:] and os.environ.get("STUB_PREFLIGHT_EXIT"):
    sys.exit(int(os.environ["STUB_PREFLIGHT_EXIT"]))
if name == "scontrol" and sys.argv[1:2] == ["show"]:
    print("node001")
if name == "sbatch":
    script = next(i for i, a in enumerate(sys.argv[1:], 1) if not a.startswith("--"))
    env = dict(os.environ, SLURM_ARRAY_TASK_ID="0", SLURM_CPUS_PER_TASK="1")
    job = subprocess.run(["bash", *sys.argv[script:]], env=env, stdout=subprocess.DEVNULL)
    if job.returncode:
        sys.exit(job.returncode)
    print(f"{{100 + sum(1 for _ in open(log))}};cluster1")
"""


@dataclasses.dataclass
class Stubs:
    bin: Path  # srun, sbatch, scontrol: first on PATH
    python: Path  # the interpreter the scripts are written with, in a directory with a hostile name
    log: Path

    def calls(self, name: str) -> list[list[str]]:
        path = self.log / f"{name}.jsonl"
        return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []

    def run(self, script: Path, *args: str, cwd: Path, env: dict[str, str] | None = None) -> None:
        """bash runs the script as SLURM would, from a shell whose umask lets the group write (002); nothing in
        `cwd`'s tree may have run a payload, whether the script then succeeded or not."""
        env = {"PATH": f"{self.bin}:/usr/bin:/bin", "STUB_LOG": str(self.log), **(env or {})}
        cmd = ["bash", "-c", 'umask 002 && exec bash "$@"', "bash", str(script), *args]
        done = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=60)
        assert not pwned(cwd), f"a payload ran: {pwned(cwd)}"
        assert done.returncode == 0, done.stderr


def install_stub(path: Path) -> Path:
    path.parent.mkdir(exist_ok=True)
    path.write_text(STUB.format(python=sys.executable))
    path.chmod(0o755)
    return path


def make_stubs(root: Path) -> Stubs:
    for name in ("srun", "sbatch", "scontrol"):
        install_stub(root / "bin" / name)
    (root / "stub-log").mkdir()
    return Stubs(bin=root / "bin", python=install_stub(root / "py" / "python"), log=root / "stub-log")


def pwned(root: Path) -> list[Path]:
    return [p for p in root.rglob("*") if "PWNED" in p.name and p.is_file()]


def tree(root: Path) -> set[Path]:
    return set(root.rglob("*"))


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def sbatch_directives(script: str) -> list[str]:
    """The options sbatch reads from a script, by its own reader (src/sbatch/opt.c, _opt_batch_script and
    _get_argument): #SBATCH lines up to the first command; in each, "hetjob"/"packjob" (any case) blanked, words
    split at whitespace outside quotes (' or "), a backslash escaping the next character, an unescaped # ending it."""
    words: list[str] = []
    for line in script.splitlines()[1:]:
        if line.strip() and not line.startswith("#"):
            break
        if not line.startswith("#SBATCH"):
            continue
        text = re.sub("(?i)hetjob|packjob", lambda m: " " * len(m[0]), line[len("#SBATCH") :])
        word: list[str] = []
        in_word, quote, escaped = False, "", False
        for char in text:
            if escaped:
                word.append(char)
                escaped = False
            elif char == "\\":
                in_word = escaped = True
            elif quote:
                quote = "" if char == quote else quote
                word += [char] if quote else []
            elif char in "'\"":
                in_word, quote = True, char
            elif char == "#":
                break
            elif char.isspace():
                if in_word:
                    words.append("".join(word))
                word, in_word = [], False
            else:
                word.append(char)
                in_word = True
        assert not quote, f"sbatch: unmatched quote in {line!r}"
        if in_word:
            words.append("".join(word))
    return words


def test_the_checks_can_fail(tmp_path: Path) -> None:
    """Positive controls: the PWNED search finds a payload that ran, and the model of sbatch's reader splits an
    unescaped space and blanks a heterogeneous job's separator, so the tests below would see either."""
    subprocess.run(["bash", "-c", 'echo "r$(touch PWNED)"'], cwd=tmp_path, check=True, capture_output=True)
    assert pwned(tmp_path) == [tmp_path / "PWNED"]
    assert sbatch_directives("#!/bin/bash\n#SBATCH --output=/a b # c\n") == ["--output=/a", "b"]
    assert sbatch_directives("#!/bin/bash\n#SBATCH --output=/x-hetjob-y\nls\n#SBATCH --late") == ["--output=/x-", "-y"]
    for value in ["--output=/a b", "x'y\"z", "c#d", "e\\f", "/HetJob/packjob", "\tg"]:
        assert sbatch_directives(f"#!/bin/bash\n#SBATCH {sbatch_word(value)}\n") == [value]


@pytest.fixture
def train_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Stubs, Path]:
    """Stubs, and the appliance's directory (where the script cds) moved to a temporary one with a hostile name."""
    repo = tmp_path / "repo `touch PWNED`"
    repo.mkdir()
    monkeypatch.setattr(slurm, "REPO_ROOT", repo)
    return make_stubs(tmp_path), repo


def _run_train_script(job: SlurmJob, corpus: list[Path], stubs: Stubs, repo: Path) -> list[str]:
    """Writes, checks and runs the training script; returns the argv srun received."""
    text = sbatch_script(job, corpus=corpus, python=str(stubs.python))
    assert subprocess.run(["bash", "-n"], input=text, text=True).returncode == 0
    script = repo.parent / "train.sbatch"
    script.write_text(text)
    stubs.run(script, cwd=repo.parent, env={"SLURM_JOB_ID": "42", "SLURM_JOB_NODELIST": "node[001-002]"})
    (srun,) = stubs.calls("srun")
    return srun


def test_a_plan_that_fails_preflight_stops_the_job_before_any_node_trains(train_env: tuple[Stubs, Path]) -> None:
    """The preflight stage exits 2 when a role does not fit: the job ends there with its code, srun never starts the
    agents. The positive control is every other train-script test here, where it exits 0 and srun is called."""
    stubs, repo = train_env
    job = SlurmJob(run_dir=repo.parent / "run", nodes=2, gpus_per_node=8, cpus_per_task=8, job_name="bloom-1b7")
    script = repo.parent / "train.sbatch"
    script.write_text(sbatch_script(job, corpus=[repo.parent / "corpus"], python=str(stubs.python)))
    env = {"PATH": f"{stubs.bin}:/usr/bin:/bin", "STUB_LOG": str(stubs.log), "STUB_PREFLIGHT_EXIT": "2",
           "SLURM_JOB_ID": "42", "SLURM_JOB_NODELIST": "node[001-002]"}  # fmt: skip
    done = subprocess.run(["bash", str(script)], cwd=repo.parent, env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2, done.stderr
    (prepare,) = stubs.calls("python")  # nothing after the preflight: no lock, no export
    assert {"--prepare-only", "--preflight"} <= set(prepare)
    assert stubs.calls("srun") == []


def test_the_job_preflights_once_as_a_stage_a_requeue_skips(train_env: tuple[Stubs, Path]) -> None:
    """The batch shell's `run --prepare-only --preflight` checks the final plan as its `preflight` stage (keyed on
    plan.json: a requeued job skips it, tests/unit/test_run_preflight.py); nothing else preflights: no `preflight`
    command of its own, and srun starts the agents, which never do."""
    from appliance.cli_parser import build_parser

    stubs, repo = train_env
    job = SlurmJob(run_dir=repo.parent / "run", nodes=2, gpus_per_node=8, cpus_per_task=8, job_name="bloom-1b7")
    srun = _run_train_script(job, [repo.parent / "corpus"], stubs, repo)
    calls = stubs.calls("python")
    checking = [call for call in calls if {"preflight", "--preflight"} & set(call)]
    assert len(checking) == 1 and checking[0] is calls[0]  # control: the scan sees the run's --preflight
    args = build_parser().parse_args(calls[0][1:])  # the words after bloom_appliance.py, as `run` reads them
    assert (args.command, args.prepare_only, args.preflight) == ("run", True, True)
    assert not {"preflight", "--preflight"} & set(srun)


def script_text(root: Path) -> str:
    return (root / "train.sbatch").read_text()


@pytest.mark.parametrize("name", HOSTILE_NAMES)
def test_train_script_passes_a_hostile_run_dir_intact(train_env: tuple[Stubs, Path], name: str) -> None:
    stubs, repo = train_env
    root = repo.parent
    run_dir = root / name
    job = SlurmJob(run_dir=run_dir, nodes=2, gpus_per_node=8, cpus_per_task=8, job_name="bloom-1b7")
    before = tree(root)
    srun = _run_train_script(job, [root / "corpus"], stubs, repo)

    run = str(run_dir)
    assert srun[srun.index("--run-dir") + 1] == run and f"--log-dir={run}/logs" in srun
    assert "--rdzv-endpoint=node001:29500" in srun and "--rdzv-id=42" in srun  # the job's values, computed there
    prepare, lock, export = stubs.calls("python")
    assert prepare[prepare.index("--run-dir") + 1] == run and prepare[-2:] == ["--corpus", str(root / "corpus")]
    assert "--preflight" in prepare  # the plan.json the job trains, checked first
    assert lock[lock.index("--run-dir") + 1] == run and export[-2:] == ["--out", f"{run}/export"]
    output = f"--output={run.replace('%', '%%')}/logs/slurm-%j.out"
    assert output in sbatch_directives(script_text(root))
    # Only the run directory's own parts, with the script's permissions whatever the umask it ran under.
    created = tree(root) - before - {root / "train.sbatch"} - set(stubs.log.iterdir())
    assert created == {run_dir, run_dir / "logs", run_dir / "control", run_dir / "control" / "lock"}
    assert (mode(run_dir), mode(run_dir / "logs"), mode(run_dir / "control")) == (0o750, 0o750, 0o700)
    assert mode(run_dir / "control" / "lock") == 0o640


def test_train_script_passes_hostile_corpus_paths_intact(train_env: tuple[Stubs, Path]) -> None:
    stubs, repo = train_env
    root = repo.parent
    stubs.python = install_stub(root / "py $(touch PWNED)" / "python")
    corpus = [root / name for name in HOSTILE_NAMES]
    job = SlurmJob(run_dir=root / "run", nodes=1, gpus_per_node=8, cpus_per_task=8, partition="gpu_p5")
    srun = _run_train_script(job, corpus, stubs, repo)
    prepare = stubs.calls("python")[0]
    assert prepare[prepare.index("--corpus") + 1 :] == [str(p) for p in corpus]
    assert srun[2] == str(stubs.python)  # the interpreter's hostile directory too


@pytest.fixture(scope="module")
def plan_json(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A plan.json for 48 nodes of 8 GPUs, as `sbatch` writes it (the sample corpus's smoke run: --smoke)."""
    run_dir = tmp_path_factory.mktemp("plan") / "run"
    args = ["--run-dir", str(run_dir), "--hardware", "jean-zay-a100-48n", "--model", "bloom-176b", "--smoke"]
    assert main(["sbatch", *args]) == 0
    return run_dir / "plan.json"


def test_a_hostile_model_name_becomes_a_plain_job_name(
    train_env: tuple[Stubs, Path], tmp_path: Path, plan_json: Path
) -> None:
    stubs, repo = train_env
    spec = load_spec(plan_json)
    spec = dataclasses.replace(spec, model=dataclasses.replace(spec.model, name="bloom $(touch PWNED);'#hetjob"))
    job = job_for(spec, tmp_path / "run", partition="gpu_p5", account="abc@a100")
    assert job.job_name == "bloom___touch_PWNED____hetjob"
    _run_train_script(job, [tmp_path], stubs, repo)
    words = sbatch_directives(script_text(tmp_path))
    assert words[0] == "--job-name=bloom___touch_PWNED____hetjob"
    assert words[-2:] == ["--partition=gpu_p5", "--account=abc@a100"]


@pytest.mark.parametrize("name", CONTROL_NAMES)
def test_control_characters_are_refused_at_input(tmp_path: Path, plan_json: Path, name: str) -> None:
    char = f"U\\+{ord(name[1]):04X}"  # the character after "r"
    spec = load_spec(plan_json)
    job = dict(nodes=1, gpus_per_node=8, cpus_per_task=8)
    with pytest.raises(BadInput, match=f"--run-dir .*{char}"):
        SlurmJob(run_dir=tmp_path / name, **job)
    for flag in ("partition", "account"):
        with pytest.raises(BadInput, match=f"--{flag} .*{char}"):
            SlurmJob(run_dir=tmp_path, **job, **{flag: name})
    with pytest.raises(BadInput, match=f"--corpus .*{char}"):
        sbatch_script(SlurmJob(run_dir=tmp_path, **job), corpus=[tmp_path / name])
    with pytest.raises(BadInput, match=f"model name .*{char}"):
        job_for(dataclasses.replace(spec, model=dataclasses.replace(spec.model, name=name)), tmp_path)


@pytest.mark.parametrize("name", ["gpu$(touch PWNED)", "gpu;touch PWNED", "gpu p5", "gpu#x", "gpu'x", "gpu\nls"])
def test_partitions_and_accounts_outside_slurms_characters_are_refused(tmp_path: Path, name: str) -> None:
    for flag in ("partition", "account"):
        names = {flag: name}
        with pytest.raises(BadInput, match=f"--{flag} "):
            SlurmJob(run_dir=tmp_path, nodes=1, gpus_per_node=8, cpus_per_task=8, **names)
        with pytest.raises(BadInput, match=f"--{flag} "):
            PrepJob(inputs=[], out_dir=tmp_path, script_dir=tmp_path, array_size=1, cwd=tmp_path, **names)


def test_a_backslash_cannot_reach_slurms_log_file_name(tmp_path: Path) -> None:
    """slurmd reads a backslash in --output as "expand nothing" and drops it: the log would go elsewhere."""
    with pytest.raises(BadInput, match=r"--run-dir .*backslash"):
        SlurmJob(run_dir=tmp_path / "a\\b", nodes=1, gpus_per_node=8, cpus_per_task=8)
    with pytest.raises(BadInput, match=r"--script-dir .*backslash"):
        PrepJob(inputs=[], out_dir=tmp_path, script_dir=tmp_path / "a\\b", array_size=1, cwd=tmp_path)


def test_cli_refuses_before_writing_anything(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture, plan_json: Path
) -> None:
    """A plan.json whose model name holds a newline, a partition with one: exit 2 naming it, no script written."""
    monkeypatch.chdir(tmp_path)
    table = json.loads(plan_json.read_text())
    table["model"]["name"] = "bloom\ntouch PWNED"
    Path("run").mkdir()
    Path("run/plan.json").write_text(json.dumps(table))
    capsys.readouterr()
    assert main(["sbatch", "--run-dir", "run", "--out", "job.sbatch"]) == 2
    assert "model name" in capsys.readouterr().err and not Path("job.sbatch").exists()
    Path("other").mkdir()
    Path("other/plan.json").write_text(plan_json.read_text())
    assert main(["sbatch", "--run-dir", "other", "--partition", "gpu\ntouch PWNED"]) == 2
    assert "--partition" in capsys.readouterr().err and [p.name for p in Path("other").iterdir()] == ["plan.json"]
    assert main(["prep", "--input", "run", "--out", "c", "--sbatch", "--array-size", "2", "--account", "a\nb"]) == 2
    assert "--account" in capsys.readouterr().err and not Path("c.prep-slurm").exists()


def test_prep_scripts_pass_hostile_paths_intact(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    stubs = make_stubs(tmp_path)
    stubs.python = install_stub(tmp_path / "py $(touch PWNED)" / "python")
    repo = tmp_path / "repo $(touch PWNED)"
    monkeypatch.setattr(prep_slurm, "REPO_ROOT", repo)
    cwd = tmp_path / "cwd; touch PWNED"
    cwd.mkdir()
    inputs = [Path(name) for name in HOSTILE_NAMES]  # relative, as typed, read from cwd
    job = PrepJob(
        inputs=inputs,
        out_dir=Path("out $(touch PWNED)"),
        script_dir=tmp_path / "scripts 100%j `touch PWNED`",
        array_size=2,
        cwd=cwd,
        work_dir=Path("work'\"#hetjob"),
        partition="cpu_p1",
        account="abc@cpu",
    )
    submit = write_scripts(job, python=str(stubs.python))
    batch = submit.parent / "prep.sbatch"
    for script in (batch, submit):
        assert subprocess.run(["bash", "-n", str(script)]).returncode == 0
    assert sbatch_directives(batch.read_text())[-2:] == ["--partition=cpu_p1", "--account=abc@cpu"]
    before = tree(tmp_path)
    stubs.run(submit, cwd=tmp_path)

    jobs = stubs.calls("sbatch")
    assert [j[-1] for j in jobs] == ["read", "templates", "filter", "finish"]
    assert all(j[-2] == str(batch.resolve()) for j in jobs)
    logs = str((job.script_dir / "logs").resolve()).replace("%", "%%")
    assert f"--output={logs}/%x-%A_%a.out" in jobs[0] and f"--output={logs}/%x-%j.out" in jobs[1]
    steps = stubs.calls("python")
    assert len(steps) == 4
    read = steps[0]
    assert read[read.index("--input") + 1 : read.index("--out")] == [*HOSTILE_NAMES[:-1], "./-r"]
    assert read[read.index("--out") + 1] == str(job.out_dir) and read[read.index("--work-dir") + 1] == str(job.work_dir)
    assert read[read.index("--slice") + 1] == "0/2"
    created = tree(tmp_path) - before - set(stubs.log.iterdir())
    assert created == {job.script_dir / "logs"} and mode(job.script_dir / "logs") == 0o750
    assert mode(submit) == mode(batch) == 0o750


@pytest.mark.parametrize("field", ["inputs", "out_dir", "work_dir", "script_dir", "cwd"])
def test_prep_refuses_control_characters_at_input(tmp_path: Path, field: str) -> None:
    fields = dict(inputs=[tmp_path], out_dir=tmp_path, script_dir=tmp_path, array_size=1, cwd=tmp_path)
    bad = tmp_path / "x\ny"
    fields[field] = [bad] if field == "inputs" else bad
    with pytest.raises(BadInput, match="U\\+000A"):
        PrepJob(**fields)
