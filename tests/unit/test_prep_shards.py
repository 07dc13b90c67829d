"""`prep` split into steps and slices, as SLURM array tasks run it: any number of slices gives the local run's
corpus byte for byte, and each unit's done marker makes a rerun redo only what failed, was killed or changed."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from test_prep_corpus_text import prose, write_jsonl
from test_prep_hostile import make_hostile

from appliance.data import prep, prep_units
from appliance.data.prep import prepare_corpus, run_step
from appliance.data.prep_work import UnitCommit, default_work_dir, parse_slice, slice_units
from appliance.errors import BadInput
from appliance.output_dirs import MARKER

FOOTER = "This page belongs to the example site and is shown on every page of it."


def corpus_inputs(root: Path) -> list[Path]:
    """Five work units whose cleaning needs the whole corpus at once: a template footer that reaches ten
    documents of its source only across two files, exact duplicates and a near duplicate in other files."""
    root.mkdir(parents=True)
    site = [{"text": prose(i) + "\n" + FOOTER, "lang": "en", "source": "site"} for i in range(6)]
    a = write_jsonl(root / "a.jsonl", site)
    b = write_jsonl(root / "b.jsonl.gz", [{"text": prose(i), "lang": "en"} for i in range(3, 9)], gz=True)
    (root / "c.txt").write_text(prose(99) + "\nWrite to someone@example.org for a copy.\n")
    more = [{"text": prose(i) + "\n" + FOOTER, "lang": "en", "source": "site"} for i in range(20, 26)]
    d = write_jsonl(root / "d.jsonl", more)
    words = prose(30).split()
    words[45] = "lighthouse"  # one word changed: word 5-gram Jaccard ~0.9 with the original
    e = root / "e.jsonl"
    write_jsonl(e, [{"text": prose(30), "lang": "en"}, {"text": " ".join(words), "lang": "en"}])
    with open(e, "a") as fh:
        fh.write('{"text": "a record cut short\n')
    return [a, b, root / "c.txt", d, e]


def files_of(corpus: Path) -> dict[str, bytes]:
    """The corpus's files; not the marker, which records the time and command line of the run that wrote them."""
    return {p.name: p.read_bytes() for p in sorted(corpus.iterdir()) if p.name != MARKER}


def run_sliced(inputs: list[Path], out: Path, slices: int, *, finish: bool = True) -> None:
    for i in range(slices):
        run_step("read", inputs, out, part=(i, slices))
    run_step("templates", inputs, out)
    for i in range(slices):
        run_step("filter", inputs, out, part=(i, slices))
    if finish:
        run_step("finish", inputs, out)


def test_any_number_of_slices_gives_the_local_corpus_byte_for_byte(tmp_path: Path) -> None:
    inputs = corpus_inputs(tmp_path / "in")
    report = prepare_corpus(inputs, tmp_path / "local")
    stages = {s["name"]: s for s in report["stages"]}
    # The cross-unit work really happens: the footer (12 documents of "site", 6 per file) is a template line,
    # three of b's documents repeat a's, one of e's is a near copy, and the bad JSON line is counted.
    assert stages["template_lines"]["bytes_in"] - stages["template_lines"]["bytes_out"] == 12 * (len(FOOTER) + 1)
    assert stages["exact_dedup"]["docs_in"] - stages["exact_dedup"]["docs_out"] == 3
    assert stages["near_dedup"]["docs_in"] - stages["near_dedup"]["docs_out"] == 1
    assert report["skipped"]["bad_json"]["count"] == 1
    local = files_of(tmp_path / "local")
    for slices in (1, 2, 3, 7):  # 7 slices for 5 units: two array tasks find nothing to do
        out = tmp_path / f"sliced-{slices}"
        run_sliced(inputs, out, slices)
        assert files_of(out) == local, f"{slices} slices"
        assert not default_work_dir(out).exists()


def test_slices_cover_every_unit_once_and_balance_bytes() -> None:
    sizes = [100, 5, 5, 40, 60, 1, 0, 30]
    parts = [slice_units(sizes, i, 3) for i in range(3)]
    assert sorted(i for part in parts for i in part) == list(range(len(sizes)))
    assert all(part == sorted(part) for part in parts)  # corpus order within a slice
    loads = [sum(sizes[i] for i in part) for part in parts]
    assert max(loads) - min(loads) <= max(sizes)
    assert parts == [slice_units(sizes, i, 3) for i in range(3)]  # every task computes the same deal
    assert parse_slice("2/3") == (2, 3)
    for bad in ("3/3", "a/2", "1", "-1/2", "1/0"):
        with pytest.raises(BadInput, match="--slice"):
            parse_slice(bad)


def test_a_failed_slice_is_the_only_one_redone(tmp_path: Path) -> None:
    inputs = corpus_inputs(tmp_path / "in")
    out = tmp_path / "corpus"
    first = {i: run_step("read", inputs, out, part=(i, 3)) for i in (0, 2)}  # task 1 of 3 failed
    assert all(r["done_now"] == r["units"] for r in first.values())
    with pytest.raises(BadInput, match="run --step read on every slice first"):
        run_step("templates", inputs, out)
    rerun = {i: run_step("read", inputs, out, part=(i, 3)) for i in range(3)}  # the whole array again
    assert rerun[0]["done_now"] == [] and rerun[2]["done_now"] == []
    assert rerun[1]["done_now"] == rerun[1]["units"] != []
    with pytest.raises(BadInput, match="run --step templates first"):
        run_step("filter", inputs, out, part=(0, 3))
    run_step("templates", inputs, out)
    for i in range(3):
        run_step("filter", inputs, out, part=(i, 3))
    run_step("finish", inputs, out)
    prepare_corpus(inputs, tmp_path / "local")
    assert files_of(out) == files_of(tmp_path / "local")


def test_a_task_killed_halfway_redoes_only_its_uncommitted_units(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    inputs = corpus_inputs(tmp_path / "in")
    out = tmp_path / "corpus"
    read = prep_units._read

    def killed_at_unit_2(task: prep_units.ReadTask, docs: Path, lines: Path) -> object:
        if task.index == 2:
            raise KeyboardInterrupt  # what SIGINT does; SIGKILL leaves the same files behind
        return read(task, docs, lines)

    with monkeypatch.context() as patched:
        patched.setattr(prep_units, "_read", killed_at_unit_2)
        with pytest.raises(KeyboardInterrupt):
            run_step("read", inputs, out)
    assert run_step("read", inputs, out)["done_now"] == [2, 3, 4]


def test_a_changed_input_redoes_its_own_units(tmp_path: Path) -> None:
    inputs = corpus_inputs(tmp_path / "in")
    out = tmp_path / "corpus"
    run_sliced(inputs, out, 2, finish=False)
    a, e = inputs[0], inputs[4]
    os.utime(a, ns=(1, 1))  # touched, same bytes: still done
    with open(e, "a") as fh:
        fh.write(json.dumps({"text": prose(40), "lang": "en"}) + "\n")
    redone = [i for part in range(2) for i in run_step("read", inputs, out, part=(part, 2))["done_now"]]
    assert redone == [4]
    run_step("templates", inputs, out)  # the new read keys: picked again, the same lines come out
    refiltered = [i for part in range(2) for i in run_step("filter", inputs, out, part=(part, 2))["done_now"]]
    assert refiltered == [4]
    run_step("finish", inputs, out)
    prepare_corpus(inputs, tmp_path / "fresh")
    assert files_of(out) == files_of(tmp_path / "fresh")
    assert prose(40) in (out / "shard-00000.jsonl").read_text()


def test_a_killed_local_prep_resumes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    inputs = corpus_inputs(tmp_path / "in")
    out = tmp_path / "run" / "corpus"
    filter_step = prep.filter_step

    def killed_at_unit_3(task: prep_units.FilterTask) -> tuple[int, bool]:
        if task.index == 3:
            raise KeyboardInterrupt
        return filter_step(task)

    with monkeypatch.context() as patched:
        patched.setattr(prep, "filter_step", killed_at_unit_3)
        with pytest.raises(KeyboardInterrupt):
            prepare_corpus(inputs, out)
    assert not out.exists() and default_work_dir(out).is_dir()

    committed: list[str] = []
    commit = UnitCommit.commit

    def spy(self: UnitCommit, content: dict) -> None:
        committed.append(self.marker.name)
        commit(self, content)

    monkeypatch.setattr(UnitCommit, "commit", spy)
    prepare_corpus(inputs, out)
    assert committed == ["filter-00003.done", "filter-00004.done"]  # all read, templates and units 0-2 kept
    assert not default_work_dir(out).exists()
    prepare_corpus(inputs, tmp_path / "fresh")
    assert files_of(out) == files_of(tmp_path / "fresh")


def test_step_arguments_are_checked(tmp_path: Path) -> None:
    inputs = corpus_inputs(tmp_path / "in")
    with pytest.raises(BadInput, match="--slice applies to --step read or filter"):
        run_step("templates", inputs, tmp_path / "corpus", part=(0, 2))
    with pytest.raises(BadInput, match="--step 'dedup'"):
        run_step("dedup", inputs, tmp_path / "corpus")
    with pytest.raises(BadInput, match="no current read output"):
        run_step("finish", inputs, tmp_path / "corpus")


def test_a_work_dir_that_is_not_ours_is_refused_and_left_alone(tmp_path: Path) -> None:
    inputs = corpus_inputs(tmp_path / "in")
    busy = tmp_path / "scratch"
    busy.mkdir()
    (busy / "thesis.tex").write_text("keep me")
    with pytest.raises(BadInput, match=r"holds other files \(thesis\.tex\)"):
        prepare_corpus(inputs, tmp_path / "corpus", work_dir=busy)
    assert (busy / "thesis.tex").read_text() == "keep me"
    with pytest.raises(BadInput, match="must be outside --out"):
        prepare_corpus(inputs, tmp_path / "corpus", work_dir=tmp_path / "corpus" / "work")
    run_step("read", inputs, tmp_path / "one", work_dir=tmp_path / "shared")
    with pytest.raises(BadInput, match="already used for --out"):
        run_step("read", inputs, tmp_path / "two", work_dir=tmp_path / "shared")
    prepare_corpus(inputs, tmp_path / "one", work_dir=tmp_path / "shared")  # its own corpus: resumes, then cleans
    assert not (tmp_path / "shared").exists() and (tmp_path / "one" / "shard-00000.jsonl").exists()


def test_slices_and_a_resumed_run_count_bad_files_and_removed_characters_alike(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The file skipped whole, the records skipped and the characters removed are counted per unit and summed
    in finish: a sliced run and a run killed and resumed report them exactly as one local run does."""
    cases = make_hostile(tmp_path / "in")
    inputs = [tmp_path / "in"]
    local = prepare_corpus(inputs, tmp_path / "local")
    assert local["removed_characters"]["nul"]["docs"] == 3 and len(local["skipped_files"]) == 4

    out = tmp_path / "sliced"
    for i in range(3):
        run_step("read", inputs, out, part=(i, 3))
    assert run_step("templates", inputs, out)["files_skipped"] == [str(cases["j_garbage.txt"][0])]
    filtered = [run_step("filter", inputs, out, part=(i, 3)) for i in range(3)]
    assert sorted(len(f["skipped_whole"]) for f in filtered) == [0, 0, 1]  # the garbage file's one unit
    run_step("finish", inputs, out)
    assert files_of(out) == files_of(tmp_path / "local")

    filter_step = prep.filter_step

    def killed_at_unit_5(task: prep_units.FilterTask) -> tuple[int, bool]:
        if task.index == 5:
            raise KeyboardInterrupt
        return filter_step(task)

    resumed = tmp_path / "resumed"
    with monkeypatch.context() as patched:
        patched.setattr(prep, "filter_step", killed_at_unit_5)
        with pytest.raises(KeyboardInterrupt):
            prepare_corpus(inputs, resumed)
    assert prepare_corpus(inputs, resumed) == local
    assert files_of(resumed) == files_of(tmp_path / "local")
