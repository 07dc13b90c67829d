"""`sbatch` writes the plan `plan` prints for the same inputs, says which (`the same plan:` names the command), with
its layout, budget, corpus and the time it asks SLURM for; and it refuses to send the sample corpus's 10-minute smoke
run to an allocation of several nodes unless --smoke asks for it."""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import pytest

from appliance import cli
from appliance.errors import EXIT_BAD_INPUT

CASES = {
    # --nodes: two of the 8-GPU node preset, for a corpus of the user's, with a budget
    "two nodes, a corpus, a budget": ["--hardware", "a100-80gb-x8-node", "--nodes", "2", "--model", "bloom-1b7",
                                      "--budget", "6h", "--corpus", "CORPUS"],
    # BLOOM's cluster with the sample corpus: the smoke run, asked for
    "48 nodes, the smoke run": ["--hardware", "jean-zay-a100-48n", "--model", "bloom-176b", "--smoke"],
    # one node and the sample corpus: the smoke run needs no flag
    "one node, the sample corpus": ["--hardware", "h100-sxm5-x8-node", "--model", "bloom-560m"],
}  # fmt: skip


def sbatch(tmp_path: Path, capsys: pytest.CaptureFixture[str], args: list[str]) -> tuple[int, str, str]:
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("A line of text for the corpus.\n")
    argv = ["sbatch", "--run-dir", str(tmp_path / "run"), *(str(corpus) if a == "CORPUS" else a for a in args)]
    code = cli.main(argv)
    captured = capsys.readouterr()
    return code, captured.out, captured.err


@pytest.mark.parametrize("case", list(CASES))
def test_the_script_trains_the_plan_that_plan_prints(
    case: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, err = sbatch(tmp_path, capsys, CASES[case])
    assert code == 0, err
    written = json.loads((tmp_path / "run" / "plan.json").read_text())
    script = (tmp_path / "run" / "train.sbatch").read_text()
    # The output names the plan command; it holds the same hardware, nodes, model and budget as the inputs.
    command = re.search(r"the same plan: \./bloom_appliance\.py (plan .*)$", out, re.M)
    assert command is not None, out
    words = shlex.split(command.group(1))
    for flag in ("--hardware", "--nodes", "--model"):
        if flag in CASES[case]:
            assert words[words.index(flag) + 1] == CASES[case][CASES[case].index(flag) + 1]
    assert cli.main([*words, "--json"]) == 0
    planned = json.loads(capsys.readouterr().out)
    assert written["layout"] == planned["layout"]
    assert written["train"]["global_batch_size"] == planned["train"]["global_batch_size"]
    assert written["model"]["name"] == planned["model"]["name"]
    nodes = planned["layout"]["world_size"] // planned["hardware"]["gpus_per_node"]
    assert f"#SBATCH --nodes={nodes}" in script
    # ... and the output says the layout, the budget, the corpus and the time asked of SLURM.
    layout = re.search(r"^  layout: (\S+)$", out, re.M)
    assert layout is not None and f"tp={planned['layout']['tp']},pp={planned['layout']['pp']}" in layout.group(1)
    assert re.search(r"^  budget: ", out, re.M) and re.search(r"^  corpus: .*tokens", out, re.M)
    assert "--time=20:00:00" in out and f"SLURM: {nodes} nodes x" in out


def test_the_smoke_run_goes_to_many_nodes_only_when_asked(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = sbatch(tmp_path, capsys, ["--hardware", "jean-zay-a100-48n", "--model", "bloom-176b"])
    assert code == EXIT_BAD_INPUT and out == ""
    assert "--smoke" in err and "48 nodes" in err and "--corpus" in err
    assert not (tmp_path / "run").exists()  # refused before anything is written
    # Only the smoke run takes --smoke.
    code, _, err = sbatch(tmp_path, capsys, ["--hardware", "a100-80gb-x8-node", "--corpus", "CORPUS", "--smoke"])
    assert code == EXIT_BAD_INPUT and "--smoke" in err
