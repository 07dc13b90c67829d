"""`prep --sbatch`: the chain of SLURM jobs, run under bash with a stand-in `sbatch` that runs each job (every
array task in turn) at once. A failed array task stops the chain; submitting again redoes only that task's units
and the corpus equals a local run's byte for byte."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from test_prep_shards import corpus_inputs, files_of

from appliance.cli import main
from appliance.data.prep import prepare_corpus
from appliance.data.prep_slurm import PrepJob, batch_script, submit_script, write_scripts
from appliance.data.prep_work import default_work_dir
from appliance.errors import BadInput

# Runs the batch script now, as SLURM would later: each array task in turn with SLURM's variables, its output
# in the --output file. A job whose afterok dependency did not succeed is cancelled, as --kill-on-invalid-dep
# does. FAKE_FAIL="NAME:TASK" fails that array task without running it (a node lost, a task killed).
FAKE_SBATCH = r"""#!/bin/bash
set -euo pipefail
array="" dep="" name="" out=""
while [ $# -gt 0 ]; do
    case "$1" in
        --parsable|--kill-on-invalid-dep=yes) ;;
        --array=*) array="${1#--array=}" ;;
        --dependency=afterok:*) dep="${1#--dependency=afterok:}" ;;
        --job-name=*) name="${1#--job-name=}" ;;
        --output=*) out="${1#--output=}" ;;
        -*) echo "fake sbatch: unexpected option $1" >&2; exit 1 ;;
        *) break ;;
    esac
    shift
done
state="$FAKE_SLURM_DIR"
id=$(( $(cat "$state/next-id" 2>/dev/null || echo 100) + 1 ))
echo "$id" > "$state/next-id"
echo "$id $name array=$array dep=$dep $*" >> "$state/calls"
status=ok
if [ -n "$dep" ] && [ "$(cat "$state/job-$dep")" != ok ]; then
    status=cancelled
else
    tasks=(none)
    if [ -n "$array" ]; then tasks=($(seq "${array%-*}" "${array#*-}")); fi
    for task in "${tasks[@]}"; do
        log="${out//\%x/$name}"; log="${log//\%A/$id}"; log="${log//\%j/$id}"; log="${log//\%a/$task}"
        if [ "$name:$task" = "${FAKE_FAIL:-}" ]; then status=failed; continue; fi
        if [ "$task" = none ]; then
            (unset SLURM_ARRAY_TASK_ID; SLURM_JOB_ID=$id SLURM_CPUS_PER_TASK=1 bash "$@") > "$log" 2>&1 || status=failed
        else
            SLURM_JOB_ID=$id SLURM_ARRAY_TASK_ID=$task SLURM_CPUS_PER_TASK=1 bash "$@" > "$log" 2>&1 || status=failed
        fi
    done
fi
echo "$status" > "$state/job-$id"
echo "$id;cluster1"
"""


def _submit(submit: Path, state: Path, fail: str = "") -> subprocess.CompletedProcess:
    env = {**os.environ, "PATH": f"{state / 'bin'}:{os.environ['PATH']}", "FAKE_SLURM_DIR": str(state)}
    if fail:
        env["FAKE_FAIL"] = fail
    done = subprocess.run(["bash", str(submit)], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    return done


def _step_output(log: Path) -> dict:
    text = log.read_text()
    return json.loads(text[text.index("{") :])


def test_chain_under_bash_resumes_after_a_failed_task(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    inputs = [p.relative_to(tmp_path) for p in corpus_inputs(tmp_path / "in")]  # as a user types them
    state = tmp_path / "slurm-state"
    (state / "bin").mkdir(parents=True)
    (state / "bin" / "sbatch").write_text(FAKE_SBATCH)
    (state / "bin" / "sbatch").chmod(0o755)
    job = PrepJob(inputs=inputs, out_dir=Path("corpus"), script_dir=Path("scripts"), array_size=2, cwd=tmp_path)
    submit = write_scripts(job, python=sys.executable)

    first = _submit(submit, state, fail="prep-read:1")
    assert "read 101 (2 tasks) -> templates 102 -> filter 103 (2 tasks) -> finish 104" in first.stdout
    calls = (state / "calls").read_text().splitlines()
    assert [c.split()[1:4] for c in calls] == [
        ["prep-read", "array=0-1", "dep="],
        ["prep-templates", "array=", "dep=101"],
        ["prep-filter", "array=0-1", "dep=102"],
        ["prep-finish", "array=", "dep=103"],
    ]
    assert [(state / f"job-{i}").read_text().strip() for i in range(101, 105)] == ["failed"] + ["cancelled"] * 3
    assert not Path("corpus").exists()
    task0 = _step_output(tmp_path / "scripts" / "logs" / "prep-read-101_0.out")
    assert task0["done_now"] == task0["units"] != []

    _submit(submit, state)  # the same chain again, as a user reruns submit.sh
    assert [(state / f"job-{i}").read_text().strip() for i in range(105, 109)] == ["ok"] * 4
    again0 = _step_output(tmp_path / "scripts" / "logs" / "prep-read-105_0.out")
    again1 = _step_output(tmp_path / "scripts" / "logs" / "prep-read-105_1.out")
    assert again0["done_now"] == [] and again0["already_done"] == len(task0["units"])
    assert again1["done_now"] == again1["units"] != []
    assert sorted(task0["units"] + again1["units"]) == list(range(5))

    prepare_corpus(inputs, Path("local"))
    assert files_of(Path("corpus")) == files_of(Path("local"))
    assert not default_work_dir(Path("corpus")).exists()


def test_scripts_have_the_directives_and_parse(tmp_path: Path) -> None:
    job = PrepJob(
        inputs=[Path("/data/roots en"), Path("/data/code")],
        out_dir=Path("/scratch/corpus"),
        script_dir=tmp_path,
        array_size=16,
        cwd=Path("/home/me"),
        work_dir=Path("/scratch/prep work"),
        strict=True,
        partition="cpu_p1",
        account="abc@cpu",
        time_limit="2-00:00:00",
    )
    batch, submit = batch_script(job), submit_script(job)
    for directive in ("--cpus-per-task=8", "--time=2-00:00:00", "--requeue", "--partition=cpu_p1", "--account=abc@cpu"):
        assert f"#SBATCH {directive}" in batch
    assert "'/data/roots en' /data/code --out /scratch/corpus --work-dir '/scratch/prep work' --strict" in batch
    assert 'read|filter) prep --slice "$SLURM_ARRAY_TASK_ID/16"' in batch
    assert submit.count("--array=0-15") == 2 and submit.count("--dependency=afterok:") == 3
    for text in (batch, submit):
        assert subprocess.run(["bash", "-n"], input=text, text=True).returncode == 0
    with pytest.raises(BadInput, match="--time"):
        PrepJob(inputs=[], out_dir=tmp_path, script_dir=tmp_path, array_size=2, cwd=tmp_path, time_limit="soon")
    with pytest.raises(BadInput, match="--array-size"):
        PrepJob(inputs=[], out_dir=tmp_path, script_dir=tmp_path, array_size=0, cwd=tmp_path)


def test_cli_writes_the_scripts(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    monkeypatch.chdir(tmp_path)
    corpus_inputs(tmp_path / "in")
    assert main(["prep", "--input", "in", "--out", "corpus", "--sbatch", "--partition", "cpu"]) == 0
    assert "submit with: bash" in capsys.readouterr().out
    batch = (tmp_path / "corpus.prep-slurm" / "prep.sbatch").read_text()
    assert '--slice "$SLURM_ARRAY_TASK_ID/5"' in batch  # one task per work unit (5 files)
    assert f"cd {tmp_path}" in batch and "--input in --out corpus --work-dir .corpus.prep-work" in batch
    assert os.access(tmp_path / "corpus.prep-slurm" / "submit.sh", os.X_OK)
    assert not (tmp_path / "corpus").exists()  # nothing ran
    assert main(["prep", "--input", "in", "--out", "corpus", "--slice", "0/2"]) == 2  # --slice needs --step


def test_an_out_named_dot_gets_its_folders_name_for_the_work_directory(tmp_path, monkeypatch):
    """`--out .` (or `..`) has no name of its own: the work directory beside it takes the folder's real name, not
    `..prep-work` (a dot-dot name inside the parent)."""
    here = tmp_path / "corpus"
    here.mkdir()
    monkeypatch.chdir(here)
    assert default_work_dir(Path(".")) == tmp_path / ".corpus.prep-work"
    assert default_work_dir(Path("..")) == tmp_path.parent / f".{tmp_path.name}.prep-work"
    assert default_work_dir(Path("out")) == Path(".out.prep-work")  # a named folder keeps its relative path
