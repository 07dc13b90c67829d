"""The planner's 1D vs Optimus 2D tensor-parallel model (planner/tp2d.py): the per-block formulas on a small shape
worked by hand, the verdicts for BLOOM-176B on its 48 x 8 A100 cluster and on 128 x 8 H100, `plan` printing the
comparison, and the byte-counting wrapper of bench/tp2d_memory.py against known collectives and the real 1D layers.

The formulas are float64 arithmetic on small integers, so hand-computed values compare at rel=1e-12 (rounding of
a few float operations). Bytes counted on gloo ranks are computed from tensor sizes by the same conventions, so
they are exact too: no summation-order noise enters them.
"""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch
import torch.distributed as dist

from appliance.hardware import load_hardware
from appliance.parallel.tensor import mappings
from appliance.parallel.testing import run_distributed
from appliance.parallel.topology import ParallelTopology
from appliance.planner import format_plan, load_model_shape, make_plan, parse_layout
from appliance.planner.device import make_device
from appliance.planner.model_shape import ModelShape
from appliance.planner.runspec import RunSpec
from appliance.planner.tp2d import (
    break_even_tokens,
    compare,
    comparison_lines,
    grid_side,
    parameters_1d,
    parameters_2d,
    sent_1d,
    sent_2d,
    sent_2d_axes,
)
from bench import tp2d_memory

EXACT = 1e-12
SMALL = ModelShape(layers=1, hidden=64, heads=4, vocab_size=512, seq_len=64)  # f = 256
BLOOM_LAYOUT = "tp=4,pp=12,dp=8,mbs=2,gbs=2048,zero=1,recompute=none,sp=1"


def test_formulas_on_a_small_block() -> None:
    """Pass: h=64, b=4, s=64 (bsh = 16384, h^2 = 4096) gives the hand-computed per-block counts."""
    bsh, hh = 4 * 64 * 64, 64 * 64
    # 1D over 4 ranks: 8 (t-1)/t bsh = 6 bsh; full recompute adds the forward's 2 all-reduces: 9 bsh
    assert sent_1d(SMALL, 4, 64, 4) == pytest.approx(6 * bsh, rel=EXACT)
    assert sent_1d(SMALL, 4, 64, 4, "full") == pytest.approx(9 * bsh, rel=EXACT)
    # 2D on 2 x 2: 3 (q-1)/q^2 = 3/4 of 7 bsh (rows) and of 12 h^2 (columns)
    rows, columns = sent_2d_axes(SMALL, 4, 64, 2)
    assert rows == pytest.approx(0.75 * 7 * bsh, rel=EXACT)
    assert columns == pytest.approx(0.75 * 12 * hh, rel=EXACT)
    # plus the vectors: LayerNorm statistics 2 (q-1)/q * 8 bs/q = 1024, bias and LayerNorm gradients
    # 2 (q-1)/q * 13h/q = 416: 0.75 * (114688 + 49152) + 1440
    assert sent_2d(SMALL, 4, 64, 2) == pytest.approx(122880 + 1440, rel=EXACT)
    assert sum(sent_2d_axes(SMALL, 4, 64, 4)) == pytest.approx(3 * 3 / 16 * (7 * bsh + 12 * hh), rel=EXACT)
    # bs > 36 h / (8q - 13): 768 tokens at q = 2, where 1D's 6 bs h meets 2D's 0.75 (7 bs h + 12 h^2)
    assert break_even_tokens(SMALL, 2) == pytest.approx(768, rel=EXACT)
    assert sent_1d(SMALL, 12, 64, 4) == pytest.approx(sum(sent_2d_axes(SMALL, 12, 64, 2)), rel=EXACT)  # bs = 768
    # parameters: 1D (12 h^2 + 3h + f)/4 + 6h = 12400 + 384; 2D 12 h^2/4 + (9h + f)/2 = 12288 + 416
    assert parameters_1d(SMALL, 4) == 12784
    assert parameters_2d(SMALL, 2) == 12704
    assert [grid_side(t) for t in (1, 4, 8, 16, 64)] == [None, 2, None, 4, 8]


@pytest.mark.parametrize("hardware", ["jean-zay-a100-48n", "h100-sxm5-128n"])
def test_verdicts_for_bloom_176b(hardware: str) -> None:
    """Pass: at BLOOM's micro-batch (2 x 2048 tokens) 1D+sp beats the 2 x 2 grid and the 8 x 8 one, the weight
    broadcasts being the reason; at 64 sequences per micro-batch (131k tokens) the 8 x 8 grid wins, 1D's 64-rank
    all-reduces crossing nodes; parameters per block differ only by the h-sized vectors 1D replicates (under 6h)."""
    hw, model = load_hardware(hardware), load_model_shape("bloom-176b")
    layout = parse_layout(BLOOM_LAYOUT)
    device = make_device(hw, hw.world_gpus)
    for q in (2, 8):
        v = compare(model, layout, device, hw, q)
        assert not v.two_d_wins and v.reason.startswith("1D+sp is better because 2D sends")
        assert "weight broadcasts" in v.reason
        assert v.two_d.sent_bytes > v.one_d.sent_bytes
        assert v.two_d.activation_bytes == pytest.approx(v.one_d.activation_bytes, rel=EXACT)
        assert abs(v.two_d.parameters - v.one_d.parameters) < 6 * model.hidden  # replicated vectors only
    big = compare(model, replace(layout, micro_batch_size=64, global_batch_size=0), device, hw, 8)
    assert big.two_d_wins and big.reason.startswith("2D wins because")
    assert "cross nodes" in big.reason
    assert big.two_d.sent_bytes < big.one_d.sent_bytes


def test_plan_prints_the_comparison() -> None:
    """Pass: `plan --verbose` for BLOOM-176B on Jean Zay shows 1D, 1D+sp and 2D rows for 4, 16 and 64 ranks, a
    verdict per grid and what a 2 x 2 grid would change in place of the chosen 1D tp=4 (never that the chosen
    layout is one); a CPU plan shows none of it."""
    text = format_plan(make_plan(load_hardware("jean-zay-a100-48n"), load_model_shape("bloom-176b")), verbose=True)
    section = text.split("Tensor parallel: 1D vs 2D")[1]
    for row in ("1D tp=4", "1D+sp tp=4", "2D 2x2", "1D+sp tp=16", "2D 4x4", "1D+sp tp=64", "2D 8x8"):
        assert row in section
    assert "1D+sp is better because" in section and "2D wins because" in section
    assert "chosen: 1D tp=4; a 2x2 grid in its place would take +" in section and "as a 2x2 grid" not in section
    cpu = make_plan(load_hardware("cpu-laptop-2core"), load_model_shape("bloom-micro-test"))
    assert "Tensor parallel: 1D vs 2D" not in format_plan(cpu, verbose=True)


def test_plan_json_holds_the_comparison_the_text_prints() -> None:
    """Pass: `plan --json` for BLOOM-176B at tp=4 on Jean Zay holds tensor_parallel: 1D, 1D+sp and 2D per grid
    (q = 2, 4, 8) with the verdicts and the chosen tp=4 as a 2 x 2 grid; read back through RunSpec it renders to
    exactly the lines `plan` prints; a CPU plan holds null there, and a plan written before the key reads as None."""
    hw, model = load_hardware("jean-zay-a100-48n"), load_model_shape("bloom-176b")
    plan = make_plan(hw, model, layout=parse_layout(BLOOM_LAYOUT))
    written = json.loads(json.dumps(plan.to_json()))  # what `plan --json` prints, as a reader parses it
    section = written["tensor_parallel"]
    assert [g["q"] for g in section["grids"]] == [2, 4, 8]
    labels = [[row["label"] for row in g["schemes"]] for g in section["grids"]]
    assert labels == [[f"1D tp={q * q}", f"1D+sp tp={q * q}", f"2D {q}x{q}"] for q in (2, 4, 8)]
    q2 = section["grids"][0]
    assert q2["two_d_wins"] is False and q2["reason"].startswith("1D+sp is better because 2D sends")
    two_d, one_d_sp = q2["schemes"][2], q2["schemes"][1]
    device = make_device(hw, hw.world_gpus)
    assert two_d["sent_bytes"] == device.act_bytes * sent_2d(model, 2, model.seq_len, 2)
    assert two_d["block_s"] > one_d_sp["block_s"]
    assert section["chosen"]["tp"] == 4 and section["chosen"]["q"] == 2 and section["chosen"]["step_delta_s"] > 0
    read = RunSpec.from_json(written, "plan.json").report.tensor_parallel
    assert read == plan.tensor_parallel and read is not None
    text = format_plan(plan, verbose=True)
    text = text.split("Tensor parallel: 1D vs 2D (a comparison only: the search places 1D groups):\n")[1]
    lines = comparison_lines(read)
    assert text.splitlines()[: len(lines)] == [f"  {line}" for line in lines]

    cpu = make_plan(load_hardware("cpu-laptop-2core"), load_model_shape("bloom-micro-test")).to_json()
    assert cpu["tensor_parallel"] is None
    del written["tensor_parallel"]
    assert RunSpec.from_json(written, "plan.json").report.tensor_parallel is None


def _counted(topology: ParallelTopology) -> dict[str, float]:
    """On 4 ranks (tp = 4, also a 2 x 2 mesh): known collectives through the wrapper over a 2-rank mesh row, then
    one block of each scheme (bench/tp2d_memory.py's launch)."""
    group, n = topology.tp_row_group, 1000
    out: dict[str, float] = {}
    with tp2d_memory.counting_sent_bytes() as counter:
        dist.all_reduce(torch.ones(n), group=group)
        out["all_reduce"] = counter.sent
        dist.broadcast(torch.ones(n), src=dist.get_global_rank(group, 0), group=group)
        out["broadcast"] = counter.sent - out["all_reduce"]
        before = counter.sent
        mappings._gather(torch.ones(n, 2), 0, group)  # the module-bound all_gather_single our 1D layers use
        out["all_gather"] = counter.sent - before
    for scheme, measured in tp2d_memory._measure_all(topology, list(tp2d_memory.SCHEMES)).items():
        out.update({f"{scheme} {key}": value for key, value in measured.items()})
    return out


@pytest.mark.distributed
def test_byte_counter_and_blocks_on_gloo() -> None:
    """Pass: over 2 ranks an all-reduce of 4000 bytes counts 4000 sent, a broadcast 2000, an all-gather of an
    8000-byte piece 8000; real blocks on 4 ranks (1D tp=4 with and without sequence parallelism, 2D on 2 x 2) send
    exactly the planner's bytes (1D: 8 (t-1)/t bsh; 2D: 3 (q-1)/q^2 (7 bsh + 12 h^2) plus the vector terms) and
    hold its parameter counts; the 2D block keeps fewer activations than 1D+sp, which keeps fewer than 1D."""
    results = run_distributed(_counted, 4, tp=4, tp2d=2, timeout_s=300)
    model = tp2d_memory.block_shape()
    for rank in results:
        assert rank["all_reduce"] == 4000 and rank["broadcast"] == 2000 and rank["all_gather"] == 8000
        for scheme in tp2d_memory.SCHEMES:
            want = tp2d_memory.predicted(scheme, model)
            assert rank[f"{scheme} sent_bytes"] == pytest.approx(want["sent_bytes"], rel=EXACT), scheme
            assert rank[f"{scheme} parameters"] == want["parameters"], scheme
        assert rank["2d activation_bytes"] < rank["1d+sp activation_bytes"] < rank["1d activation_bytes"]
