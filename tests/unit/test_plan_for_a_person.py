"""`plan` as a person reads it: the answer in under 25 lines (--verbose for the reasoning), every layout in --layout's
notation (so each can be given back to --layout), memory in GiB where the bytes are binary, no MFU against a made-up
CPU peak, and a plan that cannot run refused (exit 2, with the reason) unless --allow-infeasible."""

from __future__ import annotations

import json
import re

import pytest

from appliance import cli
from appliance.errors import EXIT_BAD_INPUT
from appliance.planner import parse_layout

PLANS = {
    "cpu": ["--hardware", "cpu-laptop-2core"],
    "one H100": ["--hardware", "h100-sxm5-x1", "--corpus-tokens", "1000000000"],
    "8 x H100, 32K tokens": ["--hardware", "h100-sxm5-x8-node", "--model", "bloom-7b1", "--seq-len", "32768"],
    "two A100 nodes": ["--hardware", "a100-80gb-x8-node", "--nodes", "2", "--model", "bloom-3b"],
    "BLOOM": ["--hardware", "jean-zay-a100-48n", "--model", "bloom-176b"],
}
# --layout's keys, and a layout as plan prints it: tp= then key=value pairs, up to the first character not in one.
SHORT_KEYS = {"tp", "pp", "dp", "mbs", "gbs", "zero", "recompute", "sp", "tp2d", "cp", "cp_mode", "ep"}
PRINTED_LAYOUT = re.compile(r"\btp2?d?=\d+(?:,[a-z_]+=[A-Za-z0-9_]+)*")


def plan_text(capsys: pytest.CaptureFixture[str], *args: str) -> str:
    assert cli.main(["plan", *args]) == 0
    return capsys.readouterr().out


@pytest.fixture(scope="module")
def bloom_verbose() -> str:
    from appliance.hardware import load_hardware
    from appliance.planner import format_plan, load_model_shape, make_plan

    plan = make_plan(load_hardware("jean-zay-a100-48n"), load_model_shape("bloom-176b"))
    try:
        return format_plan(plan, spares=2, verbose=True)
    except TypeError:  # a format_plan without --verbose printed everything: check that
        return format_plan(plan, spares=2)


@pytest.mark.parametrize("case", list(PLANS))
def test_plan_answers_in_under_25_lines(case: str, capsys: pytest.CaptureFixture[str]) -> None:
    text = plan_text(capsys, *PLANS[case])
    lines = text.splitlines()
    assert 10 <= len(lines) < 25, text
    # The answer is there: the layout (in --layout's notation, the one --json holds), the verdict, the speed, memory.
    printed = re.search(r"^Layout: (\S+)$", text, re.M)
    assert printed is not None
    assert cli.main(["plan", *PLANS[case], "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    fields = {k: doc["layout"][k] for k in parse_layout("tp=1,pp=1,dp=1").to_dict() if k in doc["layout"]}
    assert parse_layout(printed.group(1)).to_dict() == fields
    assert "Verdict: FEASIBLE" in text and "Step: " in text and "GiB per" in text
    # --verbose is the reasoning: longer, and it holds every memory term --json lists.
    verbose = plan_text(capsys, *PLANS[case], "--verbose")
    assert len(verbose.splitlines()) > len(lines)
    for key, gib in doc["memory_breakdown_gb"].items():
        assert gib <= 0 or f"  {key:<18} {gib:9.2f} GiB" in verbose


def test_every_printed_layout_is_in_layout_notation(bloom_verbose: str) -> None:
    """The chosen layout, the rejected ones (constraint, memory, speed) and the step-downs after lost nodes: each in
    --layout's keys, each parsed back by --layout's parser to the layout it names."""
    assert "micro_batch_size=" not in bloom_verbose and "sequence_parallel=" not in bloom_verbose
    found = PRINTED_LAYOUT.findall(bloom_verbose)
    assert len(found) > 15  # the chosen one, a dozen rejected, the step-downs
    for text in found:
        keys = [part.split("=")[0] for part in text.split(",")]
        assert set(keys) <= SHORT_KEYS, text
        if {"tp", "pp", "dp", "mbs"} <= set(keys):  # a whole layout: it reads back to exactly itself
            assert parse_layout(text).describe() == text
        else:  # a tp/pp/dp combination the search refused: --layout takes it as the fields to fix
            from appliance.planner.layout import layout_text, parse_layout_fields

            assert layout_text(parse_layout_fields(text)) == text


def test_a_grid_is_named_only_when_the_layout_has_one(bloom_verbose: str) -> None:
    """BLOOM's plan is 1D tp=4: the comparison says what a 2x2 grid would change, never that the plan is one."""
    assert "chosen: 1D tp=4" in bloom_verbose and "as a 2x2 grid" not in bloom_verbose


def test_memory_is_in_gib_of_the_model_built_on_the_meta_device(capsys: pytest.CaptureFixture[str]) -> None:
    """bloom-7b1 at tp=1, pp=1 holds all its weights on every GPU, 2 bytes each in bf16: counted from the model as
    the ranks build it (on the meta device, no memory taken), that is 13.17 GiB (14.1 GB): the plan says 13.17 GiB."""
    import torch

    from appliance.model.bloom import BloomBlock, BloomEmbedding, BloomFinal
    from appliance.model.config import config_for_shape
    from appliance.planner import load_model_shape

    shape = load_model_shape("bloom-7b1")
    config = config_for_shape(shape, shape.padded_vocab(1))
    with torch.device("meta"):
        parts = [BloomEmbedding(config), *(BloomBlock(config, i) for i in range(config.n_layer)), BloomFinal(config)]
    parameters = sum(p.numel() for part in parts for p in part.parameters())
    gib = parameters * 2 / 2**30
    assert gib == pytest.approx(13.17, abs=0.005)  # the control: the figure the GB label used to carry
    layout = "tp=1,pp=1,dp=8,mbs=1,zero=1,recompute=full"
    text = plan_text(capsys, "--hardware", "h100-sxm5-x8-node", "--model", "bloom-7b1", "--layout", layout, "--verbose")
    assert f"  {'weights':<18} {gib:9.2f} GiB" in text
    # No memory figure left labelled GB (GB stays for bytes sent over links: powers of ten)
    assert not re.search(r"\d GB (per (GPU|rank)(?! and block)|available)", text)
    assert re.search(r"\d GB per rank and block", text)  # the control: the regex sees GB where it is


def test_cpu_plans_show_no_mfu_and_no_gpu(capsys: pytest.CaptureFixture[str]) -> None:
    text = plan_text(capsys, "--hardware", "cpu-laptop-2core")
    step = next(line for line in text.splitlines() if line.startswith("Step: "))
    assert "per rank" in step and "no MFU on CPU ranks" in step and "GPU" not in step
    gpu = plan_text(capsys, "--hardware", "h100-sxm5-x1", "--model", "bloom-560m")  # the control: GPUs show MFU
    assert re.search(r"^Step: .* per GPU .*MFU \d+\.\d%", gpu, re.M)


def test_a_plan_that_cannot_run_exits_2_unless_allowed(capsys: pytest.CaptureFixture[str]) -> None:
    args = ["plan", "--hardware", "jean-zay-a100-48n", "--model", "bloom-176b"]
    layout = ["--layout", "tp=4,pp=12,dp=8,mbs=2,zero=0,recompute=none,sp=0"]
    assert cli.main([*args, *layout]) == EXIT_BAD_INPUT
    captured = capsys.readouterr()
    assert captured.out == ""
    assert "NOT FEASIBLE: needs" in captured.err and "GiB" in captured.err and "--allow-infeasible" in captured.err
    assert cli.main([*args, *layout, "--allow-infeasible"]) == 0
    assert "Verdict: NOT FEASIBLE" in capsys.readouterr().out
    assert cli.main([*args, "--layout", "tp=4,pp=12,dp=8"]) == 0  # the control: completed, it fits
