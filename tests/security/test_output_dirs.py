"""One rule for every output folder (appliance/output_dirs.py): a writer writes only into a folder that is new, empty,
or marked as its own earlier output of the same kind. Anything else exits 2 naming the folder and what it holds,
and its files stay as they were, byte for byte. An output that is, holds or lies inside one of the command's
inputs is refused; a rerun replaces only the files it wrote; --force writes beside someone else's files and never
over them. Run directories made before the marker keep resuming."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from tokenizers.pre_tokenizers import WhitespaceSplit
from writer_inputs import write_raw_corpus

from appliance import cli
from appliance.errors import EXIT_BAD_INPUT, BadInput
from appliance.eval.hf_export import export_hf
from appliance.hardware import load_hardware
from appliance.model.bloom import BloomForCausalLM
from appliance.model.config import BloomConfig
from appliance.output_dirs import MARKER, claim_run_dir
from appliance.planner import load_model_shape, make_plan
from appliance.rundir import RunDir, point_latest

# What a user keeps in a folder they point a writer at by mistake.
THESIS = {"thesis.tex": "\\documentclass{article} % three years of work", "src/notes.py": "print('mine')\n"}
# A folder that is not an export, with a config.json of its own.
PROJECT = {"src/notes.py": "print('mine')\n", "README": "my project\n", "config.json": '{"learning_rate": 0.1}\n'}


def tree(root: Path) -> dict[str, bytes | None]:
    """Every path under root with its bytes (None for a folder)."""
    return {str(p.relative_to(root)): None if p.is_dir() else p.read_bytes() for p in sorted(root.rglob("*"))}


def folder_of(root: Path, files: dict[str, str]) -> dict[str, bytes | None]:
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    return tree(root)


def refused(capsys: pytest.CaptureFixture[str], *argv: object) -> str:
    """The error line of a command that must exit 2."""
    assert cli.main([str(a) for a in argv]) == EXIT_BAD_INPUT
    return capsys.readouterr().err


def succeeds(capsys: pytest.CaptureFixture[str], *argv: object) -> None:
    code = cli.main([str(a) for a in argv])
    assert code == 0, capsys.readouterr().err
    capsys.readouterr()


@pytest.fixture(scope="module")
def raw(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_raw_corpus(tmp_path_factory.mktemp("raw") / "raw" / "docs.jsonl").parent


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory, raw: Path) -> Path:
    """A prepared corpus (prep's output), the input of `tokenizer` and `tokenize`."""
    out = tmp_path_factory.mktemp("prepared") / "corpus"
    assert cli.main(["prep", "--input", str(raw), "--out", str(out), "--workers", "1"]) == 0
    return out


def word_tokenizer(path: Path, size: int = 200) -> Path:
    vocab = {token: i for i, token in enumerate(("<unk>", "<s>", "</s>", "<pad>"))}
    vocab |= {f"w{i}": i for i in range(len(vocab), size)}
    tokenizer = Tokenizer(WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = WhitespaceSplit()
    path.parent.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(path))
    return path


# ----------------------------------------------------------------------------------------------------------- prep


def test_prep_refuses_a_folder_of_someone_elses_files(tmp_path: Path, raw: Path, capsys) -> None:
    out = tmp_path / "out"
    before = folder_of(out, THESIS)
    err = refused(capsys, "prep", "--input", raw, "--out", out)
    assert f"--out {out}: holds src, thesis.tex and no {MARKER}" in err and "--force" in err
    assert tree(out) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # no work folder either


def test_prep_refuses_an_out_that_is_or_holds_its_input(tmp_path: Path, raw: Path, capsys, monkeypatch) -> None:
    sb1 = tmp_path / "sb1"
    write_raw_corpus(sb1 / "docs.jsonl")
    before = tree(tmp_path)
    assert f"--out {sb1}: is --input {sb1}" in refused(capsys, "prep", "--input", sb1, "--out", sb1)
    monkeypatch.chdir(tmp_path)
    assert f"--out {tmp_path}: contains --input sb1" in refused(capsys, "prep", "--input", "sb1", "--out", tmp_path)
    assert "--out .: contains --input sb1" in refused(capsys, "prep", "--input", "sb1", "--out", ".")
    inside = sb1 / "prepared"
    assert f"lies inside --input {sb1}" in refused(capsys, "prep", "--input", sb1, "--out", inside)
    assert tree(tmp_path) == before


def test_prep_writes_into_an_empty_current_folder(tmp_path: Path, raw: Path, capsys, monkeypatch) -> None:
    """`--out .` was refused only by accident (its work folder fell inside it): an empty current folder is fine."""
    here = tmp_path / "here"
    here.mkdir()
    monkeypatch.chdir(here)
    succeeds(capsys, "prep", "--input", raw, "--out", ".", "--workers", "1")
    assert {"shard-00000.jsonl", "prep_report.json", MARKER} <= {p.name for p in here.iterdir()}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["here"]  # the work folder beside it is gone


def test_prep_rerun_replaces_only_its_own_files(tmp_path: Path, raw: Path, capsys) -> None:
    out = tmp_path / "out"
    succeeds(capsys, "prep", "--input", raw, "--out", out, "--workers", "1")
    marker = json.loads((out / MARKER).read_text())
    assert marker["kind"] == "prep" and marker["files"] == ["prep_report.json", "prep_report.md", "shard-00000.jsonl"]
    assert "prep --input" in marker["command"] and marker["version"] and marker["time"]
    (out / "thesis.tex").write_text(THESIS["thesis.tex"])  # added after the first run
    other = write_raw_corpus(tmp_path / "other" / "docs.jsonl", 20, skip=30)
    succeeds(capsys, "prep", "--input", other, "--out", out, "--workers", "1")
    assert (out / "thesis.tex").read_text() == THESIS["thesis.tex"]
    assert json.loads((out / "prep_report.json").read_text())["inputs"] == [str(other)]  # replaced


def test_prep_force_writes_beside_foreign_files_never_over_them(tmp_path: Path, raw: Path, capsys) -> None:
    beside = tmp_path / "beside"
    before = folder_of(beside, THESIS)
    succeeds(capsys, "prep", "--input", raw, "--out", beside, "--workers", "1", "--force")
    assert {name: data for name, data in tree(beside).items() if name in before} == before
    assert (beside / "shard-00000.jsonl").exists()

    over = tmp_path / "over"
    before = folder_of(over, {**THESIS, "shard-00000.jsonl": "my own shard\n"})
    err = refused(capsys, "prep", "--input", raw, "--out", over, "--workers", "1", "--force")
    assert f"--out {over}: holds shard-00000.jsonl, which `prep` would replace and did not write" in err
    assert tree(over) == before


def test_prep_sbatch_refuses_a_foreign_script_folder(tmp_path: Path, raw: Path, capsys) -> None:
    scripts = tmp_path / "scripts"
    before = folder_of(scripts, THESIS)
    err = refused(capsys, "prep", "--input", raw, "--out", tmp_path / "out", "--sbatch", "--script-dir", scripts)
    assert f"--script-dir {scripts}: holds src, thesis.tex" in err
    assert tree(scripts) == before and not (tmp_path / "out").exists()


# ------------------------------------------------------------------------------------------ tokenizer, tokenize


def test_tokenizer_refuses_foreign_files_and_its_corpus(tmp_path: Path, corpus: Path, capsys) -> None:
    out = tmp_path / "tok"
    before = folder_of(out, THESIS)
    args = ("tokenizer", "--corpus", corpus, "--vocab-size", "300")
    assert f"--out {out}: holds src, thesis.tex" in refused(capsys, *args, "--out", out)
    assert tree(out) == before
    corpus_before = tree(corpus)
    assert f"--out {corpus}: is --corpus {corpus}" in refused(capsys, *args, "--out", corpus)
    assert f"lies inside --corpus {corpus}" in refused(capsys, *args, "--out", corpus / "tok")
    assert tree(corpus) == corpus_before


def test_tokenizer_rerun_and_force_keep_foreign_files(tmp_path: Path, corpus: Path, capsys) -> None:
    out = tmp_path / "tok"
    before = folder_of(out, THESIS)
    args = ("tokenizer", "--corpus", corpus, "--vocab-size", "300", "--out", out)
    succeeds(capsys, *args, "--force")
    first = (out / "tokenizer.json").read_bytes()
    succeeds(capsys, *args[:-3], "320", "--out", out)  # a rerun into its own output: no --force needed
    assert (out / "tokenizer.json").read_bytes() != first  # replaced: another vocabulary
    assert {name: data for name, data in tree(out).items() if name in before} == before


def test_tokenize_refuses_foreign_files_and_its_corpus(tmp_path: Path, corpus: Path, capsys) -> None:
    tokenizer = word_tokenizer(tmp_path / "tokenizer.json")
    out = tmp_path / "data"
    before = folder_of(out, THESIS)
    args = ("tokenize", "--corpus", corpus, "--tokenizer", tokenizer, "--workers", "1")
    assert f"--out {out}: holds src, thesis.tex" in refused(capsys, *args, "--out", out)
    assert tree(out) == before
    corpus_before = tree(corpus)
    assert f"--out {corpus}: is --corpus {corpus}" in refused(capsys, *args, "--out", corpus)
    assert tree(corpus) == corpus_before


def test_a_folder_marked_by_another_kind_is_refused_even_with_force(tmp_path: Path, corpus: Path, capsys) -> None:
    before = tree(corpus)
    tokenizer = word_tokenizer(tmp_path / "tokenizer.json")
    err = refused(capsys, "tokenize", "--corpus", corpus, "--tokenizer", tokenizer, "--out", corpus, "--force")
    assert "is --corpus" in err
    copy = tmp_path / "copy"
    folder_of(copy, {name: data.decode() for name, data in before.items() if data is not None})
    err = refused(capsys, "tokenize", "--corpus", corpus, "--tokenizer", tokenizer, "--out", copy, "--force")
    assert f"--out {copy}: holds the output of `prep` ({MARKER}), not of `tokenize`" in err
    assert tree(copy) == before


# ----------------------------------------------------------------------------------------------------------- export

CONFIG = BloomConfig(vocab_size=256, hidden_size=32, n_layer=1, n_head=4)


@pytest.fixture(scope="module")
def weights() -> dict[str, torch.Tensor]:
    return BloomForCausalLM(CONFIG, seed=0).state_dict()


def test_export_refuses_a_project_folder_with_a_config_json(tmp_path: Path, capsys) -> None:
    """From the command line, before any checkpoint is read (this one, committed as far as `export`'s first check
    can tell, lists no files)."""
    run = tmp_path / "run"
    run_files = {
        "plan.json": "{}",
        "tokenizer/tokenizer.json": "{}",
        "checkpoints/step-00000001/manifest.json": '{"files": []}',
    }
    folder_of(run, run_files)
    out = tmp_path / "project"
    before = folder_of(out, PROJECT)
    err = refused(capsys, "export", "--run-dir", run, "--out", out)
    assert f"--out {out}: holds README, config.json, src and no {MARKER}" in err and "--force" in err
    assert tree(out) == before
    assert f"--out {run}: contains --run-dir {run / 'plan.json'}" in refused(capsys, "export", "--run-dir", run,
                                                                               "--out", run)  # fmt: skip
    inside = run / "checkpoints" / "x"
    assert "lies inside --run-dir" in refused(capsys, "export", "--run-dir", run, "--out", inside)
    assert {name: data for name, data in tree(run).items() if data is not None} == {
        name: text.encode() for name, text in run_files.items()
    }


def test_export_rerun_replaces_only_its_files_and_force_never_overwrites(tmp_path: Path, weights) -> None:
    tokenizer = word_tokenizer(tmp_path / "tokenizer.json")
    out = tmp_path / "export"
    export_hf(weights, CONFIG, tokenizer, out, max_shard_bytes=40_000)  # shards: model-0000N-of-0000M.safetensors
    shards = sorted(p.name for p in out.glob("model-*.safetensors"))
    assert len(shards) > 1
    (out / "README.md").write_text("model card\n")  # a user's, added afterwards
    export_hf(weights, CONFIG, tokenizer, out)  # one file now: the shards and their index are the earlier export's
    assert (out / "README.md").read_text() == "model card\n"
    assert not list(out.glob("model-*.safetensors")) and not (out / "model.safetensors.index.json").exists()
    assert (out / "model.safetensors").exists()

    project = tmp_path / "project"
    before = folder_of(project, PROJECT)
    with pytest.raises(BadInput, match=r"holds config.json, which `export` would replace and did not write"):
        export_hf(weights, CONFIG, tokenizer, project, force=True)
    assert tree(project) == before
    notes = tmp_path / "notes"
    before = folder_of(notes, THESIS)
    export_hf(weights, CONFIG, tokenizer, notes, force=True)
    assert {name: data for name, data in tree(notes).items() if name in before} == before
    assert (notes / "config.json").exists()


# --------------------------------------------------------------------------------------- run, import, sbatch, bench


def test_run_refuses_an_ordinary_folder_and_keeps_its_corpus_folder(tmp_path: Path, raw: Path, capsys) -> None:
    run = tmp_path / "mine"
    before = folder_of(run, {**THESIS, "corpus/my-data.txt": "my own corpus notes\n"})
    err = refused(capsys, "run", "--headless", "--corpus", raw, "--run-dir", run)
    assert f"--run-dir {run}: holds corpus, src, thesis.tex and no {MARKER}" in err
    assert tree(run) == before
    empty = tmp_path / "empty"
    write_raw_corpus(empty / "in.jsonl")
    err = refused(capsys, "run", "--headless", "--corpus", empty / "in.jsonl", "--run-dir", empty)
    assert f"--run-dir {empty}: contains --corpus {empty / 'in.jsonl'}" in err


def test_train_refuses_a_folder_whose_plan_is_not_a_runs(tmp_path: Path, capsys) -> None:
    run = tmp_path / "mine"
    before = folder_of(run, {"plan.json": '{"my": "plan"}', **THESIS})
    assert f"--run-dir {run}: holds plan.json, src, thesis.tex" in refused(capsys, "train", "--run-dir", run)
    assert tree(run) == before


def test_import_refuses_a_foreign_folder_and_its_own_input(tmp_path: Path, capsys) -> None:
    hf = tmp_path / "hf"
    hf_before = folder_of(hf, {"config.json": "{}", "tokenizer.json": "{}"})
    run = tmp_path / "mine"
    before = folder_of(run, THESIS)
    assert f"--run-dir {run}: holds src, thesis.tex" in refused(capsys, "import", "--hf-dir", hf, "--run-dir", run)
    assert f"--run-dir {hf}: is --hf-dir {hf}" in refused(capsys, "import", "--hf-dir", hf, "--run-dir", hf)
    assert tree(run) == before and tree(hf) == hf_before


SBATCH = ("sbatch", "--hardware", "h100-sxm5-x1", "--model", "bloom-micro-test")


def test_sbatch_refuses_foreign_files_and_replaces_its_own_script(tmp_path: Path, capsys) -> None:
    mine = tmp_path / "mine"
    before = folder_of(mine, THESIS)
    assert f"--run-dir {mine}: holds src, thesis.tex" in refused(capsys, *SBATCH, "--run-dir", mine)
    assert tree(mine) == before

    run, script = tmp_path / "run", tmp_path / "job.sbatch"
    script.write_text("#!/bin/bash\n# my own job\n")
    err = refused(capsys, *SBATCH, "--run-dir", run, "--out", script)
    assert f"--out {script}: exists and is not a script `sbatch` wrote" in err
    assert script.read_text() == "#!/bin/bash\n# my own job\n" and not run.exists()

    succeeds(capsys, *SBATCH, "--run-dir", run)
    elsewhere = tmp_path / "jobs" / "train.sbatch"
    elsewhere.parent.mkdir()
    succeeds(capsys, *SBATCH, "--run-dir", run, "--out", elsewhere)
    (run / "train.sbatch").write_text("stale\n")
    elsewhere.write_text("stale\n")
    succeeds(capsys, *SBATCH, "--run-dir", run)  # its own scripts: replaced on a rerun
    succeeds(capsys, *SBATCH, "--run-dir", run, "--out", elsewhere)
    assert "#SBATCH" in (run / "train.sbatch").read_text() and "#SBATCH" in elsewhere.read_text()


def test_bench_refuses_to_replace_a_file_that_is_not_a_bench_result(tmp_path: Path, capsys) -> None:
    out = tmp_path / "thesis.tex"
    out.write_text(THESIS["thesis.tex"])
    err = refused(capsys, "bench", "--quick", "--contenders", "trainer", "--no-kernel-table", "--out", out)
    assert f"--out {out}: exists and is not an earlier bench result" in err
    assert out.read_text() == THESIS["thesis.tex"]


# ------------------------------------------------------------------------------------ runs made before the marker


def test_a_run_directory_from_before_the_marker_is_still_a_run(tmp_path: Path) -> None:
    spec = make_plan(load_hardware("cpu-laptop-2core"), load_model_shape("bloom-micro-test")).spec()
    planned = tmp_path / "planned"
    folder_of(planned, {"plan.json": spec.dumps().decode(), "notes.txt": "mine"})
    assert claim_run_dir(planned).record == {}  # no marker, yet ours: it resumes
    staged = tmp_path / "staged"
    folder_of(staged, {"stages.json": json.dumps({"plan": {"key": "k", "outputs": "o", "seconds": 1.0}})})
    claim_run_dir(staged)
    other = tmp_path / "other"
    folder_of(other, {"stages.json": "[1, 2]", "notes.txt": "mine"})
    with pytest.raises(BadInput, match=r"holds notes\.txt, stages\.json and no"):  # control: a stages.json not ours
        claim_run_dir(other)


def test_runs_latest_never_replaces_a_users_file(tmp_path: Path) -> None:
    runs = tmp_path / "runs"
    (runs / "a").mkdir(parents=True)
    point_latest(runs, runs / "a")
    assert (runs / "latest").resolve() == (runs / "a").resolve()  # a link of ours is repointed
    (runs / "b").mkdir()
    point_latest(runs, runs / "b")
    assert (runs / "latest").resolve() == (runs / "b").resolve()
    (runs / "latest").unlink()
    (runs / "latest").write_text("my list of the latest papers\n")
    point_latest(runs, runs / "a")
    assert (runs / "latest").read_text() == "my list of the latest papers\n"
    assert RunDir(runs / "a").root.is_dir()
