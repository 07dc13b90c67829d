"""Context parallelism trains like one process: each cp layout's losses, gradient norms and gathered weights within
the noise-floor bounds of test_3d_equivalence.py, ring and Ulysses agree, and checkpoints move across cp.

Launches are the slow part, so one launch of four ranks builds every layout in turn on the same ranks (each its own
ParallelTopology, whose groups are created in the same order everywhere): cp=4 in both modes; cp=2 with tp=2
(Ulysses), with tp=2 + sequence parallelism (ring), with pp=2 (ring) and with dp=2 (Ulysses, ZeRO-1). Every one
trains the tiny BLOOM of test_3d_equivalence.py for its 10 steps with its batch ramp-up, on the same samples, and is
compared with the same single-process reference (reference_training.py) and noise floor (noise_floor.py).
"""

from __future__ import annotations

import functools
import json
import os
import shutil
from pathlib import Path
from typing import Any

import pytest
import reference_training
import torch
import torch.distributed as dist
from noise_floor import NoiseFloor, Order, assert_outside, assert_within, measure_floor
from prepared_runs import copy_run, events, explain, prepare_run, reference_losses, step_losses, train
from test_3d_equivalence import (
    CONFIG,
    FP32_FACTOR,
    GRAD_CLIP,
    MBS,
    OPTIMIZER,
    RAMPUP,
    SEED,
    TEETH,
    _eval_micro_batches,
    _evaluate,
    _train,
    reference_run,
    token_stream,
)

from appliance.parallel.checkpoint.weight_shards import gather_full_state_dict
from appliance.parallel.context.training import whole_sequences
from appliance.parallel.testing import build_test_engine, run_distributed
from appliance.parallel.topology import ParallelTopology
from appliance.rundir import RunDir

pytestmark = pytest.mark.distributed

WORLD = 4
# Bounds: FP32_FACTOR (10) x the noise floor, as test_3d_equivalence.py. Measured here (2026-11-24, 2-core AMD EPYC
# VM): losses 0.6-1.7 x, gathered weights 1.1-1.6 x, target log-probabilities 1.3-1.5 x, gradient norms 4.9-5.7 x
# the floor. The norms sit higher because cutting every sequence into cp slices reorders the per-token sums inside
# each weight gradient (then summed over the cp ranks), a reordering the floor's own (micro-batch order, sample
# split, threads) does not make; the largest gap is at step 1, before any update (6e-7 relative, a few float32 ulps
# of the norm). Without attention across the CP ranks the first loss lands 600 x the floor away.
# name -> (tp, pp, dp, cp, cp_mode, zero, sequence parallel). Heads 4: Ulysses needs heads / tp divisible by cp.
LAYOUTS: dict[str, tuple[int, int, int, int, str, int, bool]] = {
    "cp4-ulysses": (1, 1, 1, 4, "ulysses", 0, False),
    "cp4-ring": (1, 1, 1, 4, "ring", 0, False),
    "tp2-cp2-ulysses": (2, 1, 1, 2, "ulysses", 1, False),
    "tp2-sp-cp2-ring": (2, 1, 1, 2, "ring", 1, True),
    "pp2-cp2-ring": (1, 2, 1, 2, "ring", 0, False),
    "dp2-cp2-ulysses": (1, 1, 2, 2, "ulysses", 1, False),
}


def _engine(topology: ParallelTopology, cp_mode: str, zero: int, sp: bool) -> Any:
    return build_test_engine(
        CONFIG,
        topology,
        micro_batch_size=MBS,
        global_batch_size=RAMPUP.final,
        zero_stage=zero,
        dtype="fp32",
        grad_clip=GRAD_CLIP,
        recompute="none",
        sequence_parallel=sp,
        lr=0.0,
        seed=SEED,
        cp_mode=cp_mode,
        **OPTIMIZER,
    )


def _topology(tp: int, pp: int, dp: int, cp: int) -> ParallelTopology:
    topology = ParallelTopology(tp=tp, pp=pp, dp=dp, cp=cp, world_size=dist.get_world_size())
    topology.init_process_groups()
    return topology


def _save(engine: Any, step_dir: Path) -> None:
    """Model and optimizer files as the trainer writes them (every rank calls; the writers write)."""
    if dist.get_rank() == 0:
        step_dir.mkdir(parents=True, exist_ok=True)
    dist.barrier()
    shard = engine.optimizer_shard()
    engine.save_model(step_dir, {"step": "test"})
    engine.save_optimizer(step_dir, shard, {"step": "test"})
    dist.barrier()


def _files(step_dir: Path) -> list[str]:
    return sorted(p.name for p in step_dir.iterdir())


def all_layouts(_: ParallelTopology, root: Path) -> dict[str, Any]:
    os.environ.setdefault("LOCAL_RANK", "0")  # read by DeepSpeed's PipelineModule
    out: dict[str, Any] = {}
    for name, (tp, pp, dp, cp, mode, zero, sp) in LAYOUTS.items():
        topology = _topology(tp, pp, dp, cp)
        engine = _engine(topology, mode, zero, sp)
        out[name] = _train(engine, topology, 0, None, root)
        out[name]["eval"] = _evaluate(engine)  # scoring (CP switched off inside) and eval_sums (CP slices)
        _save(engine, root / name)
        if name == "dp2-cp2-ulysses":
            out["reshard"] = _reshard(engine, root)
        engine.close()
    # Teeth: the same cp=4 split with the context-parallel core switched off (each rank attends only within its own
    # quarter of the sequence) must leave the reference's losses.
    topology = _topology(1, 1, 1, 4)
    engine = _engine(topology, "ulysses", 0, False)
    tokens = token_stream()
    first_step = [reference_training.batch(tokens, [2 * i, 2 * i + 1]) for i in range(RAMPUP.start // MBS)]
    with whole_sequences(engine.engine.module):
        out["no_cp_attention"] = [engine.train_batch(first_step).loss]
    return out


def _reshard(cp2: Any, root: Path) -> dict[str, Any]:
    """Save at dp=2 cp=2, load at dp=4 cp=1 (ZeRO-1 over 4 ranks either way); save there, load back at cp=2."""
    before = {"weights": cp2.model_shard(), "optimizer": cp2.optimizer_state()}
    cp1 = _engine(_topology(1, 1, 4, 1), "ulysses", 1, False)
    cp1.load_model(root / "dp2-cp2-ulysses")
    loaded = cp1.load_optimizer(root / "dp2-cp2-ulysses")
    at_cp1 = {"weights": cp1.model_shard(), "optimizer": cp1.optimizer_state()}
    _save(cp1, root / "from-cp1")
    cp1.close()
    back = _engine(_topology(1, 1, 2, 2), "ring", 1, False)
    back.load_model(root / "from-cp1")
    back.load_optimizer(root / "from-cp1")
    at_cp2 = {"weights": back.model_shard(), "optimizer": back.optimizer_state()}
    back.close()
    return {"loaded": loaded, "before": before, "at_cp1": at_cp1, "at_cp2": at_cp2}


# ---- the checks ----------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def measured() -> tuple[dict[str, Any], NoiseFloor]:
    return measure_floor(reference_run)  # test_3d_equivalence.py's reference: training and evaluation paths


@pytest.fixture(scope="module")
def launch(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("cp")
    ranks = run_distributed(all_layouts, WORLD, root, dp=WORLD, timeout_s=500)
    return {"root": root, "ranks": ranks}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_losses_norms_and_weights_equal_one_process(
    name: str, launch: dict[str, Any], measured: tuple[dict[str, Any], NoiseFloor]
) -> None:
    """Pass: at every cp layout each rank's step losses and gradient norms, and the weights gathered from its
    checkpoint, lie within FP32_FACTOR x the noise floor (test_3d_equivalence.py says why 10 x) of one process."""
    reference, floor = measured
    for rank, result in enumerate(launch["ranks"]):
        for key in ("losses", "norms"):
            assert_within(result[name][key], reference[key], key, floor, FP32_FACTOR, f"{name} rank {rank} {key}")
    gathered = gather_full_state_dict(launch["root"] / name)
    assert_within(gathered, reference["weights"], "weights", floor, FP32_FACTOR, f"{name} gathered weights")


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_evaluation_equals_one_process(
    name: str, launch: dict[str, Any], measured: tuple[dict[str, Any], NoiseFloor]
) -> None:
    """Pass: target log-probabilities scored at every cp layout (each CP rank alone on whole sequences) within the
    bound of one process's, on every rank; eval_sums count every token once over all ranks (each CP rank its
    slice) and their loss sum is within the bound of one process's."""
    reference, floor = measured
    dp = LAYOUTS[name][2]
    for rank, result in enumerate(launch["ranks"]):
        got = result[name]["eval"]["logprobs"]
        assert_within(got, reference["logprobs"], "logprobs", floor, FP32_FACTOR, f"{name} rank {rank}")
    tokens = sum(int((y != -100).sum()) for rank in range(dp) for _, y in _eval_micro_batches(rank))
    sums = [r[name]["eval"]["sums"] for r in launch["ranks"]]
    assert sum(s[1] for s in sums) == tokens, sums
    key = f"eval_sum_dp{dp}"
    assert_within(sum(s[0] for s in sums), reference[key], key, floor, FP32_FACTOR, f"{name} summed eval loss")


def test_ring_and_ulysses_agree(launch: dict[str, Any], measured: tuple[dict[str, Any], NoiseFloor]) -> None:
    """Pass: the two modes at cp=4 train the same losses and norms within the bound of each other."""
    _, floor = measured
    ranks = launch["ranks"]
    for key in ("losses", "norms"):
        ring, ulysses = ranks[0]["cp4-ring"][key], ranks[0]["cp4-ulysses"][key]
        assert_within(ring, ulysses, key, floor, FP32_FACTOR, f"cp4 ring against ulysses {key}")


def test_the_bounds_have_teeth(launch: dict[str, Any], measured: tuple[dict[str, Any], NoiseFloor]) -> None:
    """Pass: without the context-parallel core (each CP rank attends within its own slice) the losses leave the
    reference by TEETH x the bound: the equality above needs attention across the CP ranks."""
    reference, floor = measured
    got = launch["ranks"][0]["no_cp_attention"]
    want = reference["losses"][:1]  # the first step's samples and weights
    assert_outside(got, want, "losses", floor, TEETH * FP32_FACTOR, "cp4 without cp attention")


def test_only_cp_rank_0_writes_the_model_and_the_state_is_shared_over_dp_x_cp(launch: dict[str, Any]) -> None:
    """Pass: at tp1 pp1 dp2 cp2 one model file (rank 0's) and the optimizer state spread over the four ranks of
    DeepSpeed's data-parallel group, indices 0..3; at tp2 cp2 one model shard per TP rank."""
    root = launch["root"]
    dp2 = _files(root / "dp2-cp2-ulysses")
    assert "model.safetensors" in dp2 and not [f for f in dp2 if f.startswith("model-")], dp2
    assert [f for f in dp2 if f.startswith("optim-")] == [f"optim-tp00-pp00-dp{d:02d}.safetensors" for d in range(4)]
    tp2 = [f for f in _files(root / "tp2-cp2-ulysses") if f.startswith("model")]
    assert len(tp2) == 2, tp2


def test_checkpoints_move_across_cp(launch: dict[str, Any]) -> None:
    """Pass: a checkpoint written at cp=2 loads at cp=1 with the same weights and optimizer state (every tensor
    equal: weights and Adam state do not depend on cp), and one written at cp=1 loads back at cp=2."""
    for rank, result in enumerate(launch["ranks"]):
        moved = result["reshard"]
        assert moved["loaded"], f"rank {rank}: no optimizer state loaded"
        for stage in ("at_cp1", "at_cp2"):
            for part in ("weights", "optimizer"):
                want, got = moved["before"][part], moved[stage][part]
                assert got.keys() == want.keys(), (rank, stage, part)
                for key in want:
                    assert torch.equal(got[key], want[key]), f"rank {rank} {stage} {part} {key}"


# ---- `train --layout ...,cp=2` continues a run ----------------------------------------------------------------
CLI_STEPS, CLI_MOVED_AT = 6, 3


def cli_reference(run_dir: RunDir, order: Order) -> dict[str, Any]:
    """The run's training in one process (as test_exact_resume.py's reference); its trace is the losses after
    CLI_MOVED_AT."""
    return reference_losses(run_dir, order, steps=CLI_STEPS, from_step=CLI_MOVED_AT)


@pytest.fixture(scope="module")
def cli_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """A dp=2 run stopped after step 3, then continued twice from that checkpoint: at the same layout, and with
    `train --layout tp=1,pp=1,dp=1,cp=2,cp_mode=ring` (two ranks either way)."""
    root = tmp_path_factory.mktemp("cp-cli")
    base = prepare_run(
        root / "base",
        "tp=1,pp=1,dp=2,mbs=2,gbs=8,zero=1,recompute=none",
        train_samples=8 * CLI_STEPS,
        warmup_samples=16,
        decay_samples=8 * CLI_STEPS,
        eval_interval=CLI_STEPS,
        eval_samples=4,
        save_interval=CLI_MOVED_AT,
        eval_task_limit=1,
    )
    out: dict[str, Any] = {"straight": copy_run(base, root / "straight")}
    out["first"] = train(out["straight"], "--stop-at-step", str(CLI_MOVED_AT))
    shutil.copytree(out["straight"].root, root / "moved")
    out["moved"] = RunDir(root / "moved")
    out["straight_second"] = train(out["straight"])
    out["moved_second"] = train(out["moved"], "--layout", "tp=1,pp=1,dp=1,cp=2,cp_mode=ring")
    return out


def test_train_with_a_cp_layout_continues_the_run(cli_runs: dict[str, Any]) -> None:
    """Pass: `train --layout ...,cp=2` continues step 3's dp=2 checkpoint on two CP ranks (the warning names both
    layouts, the data position is kept, the final evaluation runs at cp=2) and its losses follow the dp=2 run's
    within FACTOR x the noise floor of those steps, measured on this run's single-process reference."""
    assert cli_runs["first"].returncode == 3, explain(cli_runs["first"])
    for key in ("straight_second", "moved_second"):
        assert cli_runs[key].returncode == 0, explain(cli_runs[key])
    moved = cli_runs["moved"]
    changes = [e["message"] for e in events(moved, "warning") if "layout changed" in e["message"]]
    assert len(changes) == 1 and "tp=1,pp=1,dp=2 -> tp=1,pp=1,dp=1,cp=2" in changes[0], changes
    assert [e["resumed_step"] for e in events(moved, "recovery")] == [CLI_MOVED_AT]
    plan = json.loads(moved.plan.read_text())["layout"]
    assert (plan["cp"], plan["cp_mode"], plan["dp"]) == (2, "ring", 1)
    final = [e for e in events(moved, "eval") if "tasks" in e]
    assert [e["step"] for e in final] == [CLI_STEPS] and final[0]["tasks"], final  # the final evaluation, at cp=2
    manifest = json.loads((moved.checkpoints / f"step-{CLI_STEPS:08d}" / "manifest.json").read_text())
    assert manifest["consumed_samples"] == 8 * CLI_STEPS and manifest["layout"]["cp"] == 2
    straight, got = step_losses(cli_runs["straight"]), step_losses(moved)
    assert sorted(got) == list(range(1, CLI_STEPS + 1))
    floor = measure_floor(functools.partial(cli_reference, cli_runs["straight"]))[1]
    after = range(CLI_MOVED_AT + 1, CLI_STEPS + 1)
    what = "cp=2 continuation against the dp=2 one"
    assert_within([got[s] for s in after], [straight[s] for s in after], "losses", floor, FP32_FACTOR, what)
