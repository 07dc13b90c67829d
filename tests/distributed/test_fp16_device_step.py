"""ZeRO's fp16 step with the dynamic loss scale on the device (parallel/step/fp16_step.py), at dp = 2 and ZeRO 2: a step
reads nothing on the host until its figures are asked for; the scale follows DeepSpeed's own scaler through overflows,
hysteresis and growth; the training tracks DeepSpeed's own step within fp16's noise floor; an overflow changes nothing
but the scale; a resume from a checkpoint continues the same scales. One launch trains the same steps with the step as
patched, as DeepSpeed ships it, and as DeepSpeed ships it on one-sample micro-batches (the noise floor).

fp16 on a CPU: each rank answers DeepSpeed's accelerator check yes, as test_fp16_training.py explains."""

from __future__ import annotations

import itertools
import math
import os
from pathlib import Path
from typing import Any

import pytest
import torch
from device_steps import Batches, engine_snapshot, one_sample_each, random_micro_batches
from noise_floor import relative_norm

from appliance.model.config import BloomConfig
from appliance.parallel.step.host_reads import counting_host_reads
from appliance.parallel.testing import build_test_engine, run_distributed
from appliance.parallel.topology import ParallelTopology

pytestmark = pytest.mark.distributed

CONFIG = BloomConfig(vocab_size=256, hidden_size=64, n_layer=2, n_head=4)
DP, MBS, SEQ, STEPS, COUNT = 2, 2, 16, 10, 4  # COUNT: micro-batches per step on each DP rank
GRAD_CLIP = 0.5
# A start far above the largest scale at which this model's scaled gradients fit in fp16, so the first steps
# overflow (the first absorbed by the hysteresis of 2, the next ones halving the scale), and a window of 2 clean steps
# so that the scale grows again within the run.
FORCED_START = {"scale": 2.0**24, "hysteresis_left": 2, "iteration": 0, "last_overflow_iteration": -1}
SCALE_WINDOW = 2
# The first applied step's moments and masters: both steps unscale and clip the same gradients by the same factor,
# ours dividing inside the fused kernel and DeepSpeed multiplying by its rounded inverse first, so each element differs
# by about two fp32 roundings (2^-23 = 1.2e-7 relative), the second moment by twice that (measured: 1.6e-7, as in the
# noise-floor test below). 1e-6 leaves room for another CPU's rounding; a factor off at all (the loss scale of the
# wrong step: 2x; the clip not applied: the norm 0.71 / 0.5 = 1.4x) is far beyond it.
FIRST_STEP_RTOL = 1e-6
RESUME_AT = 5  # the resumed engine starts at this step, from the state the device run had after the step before
FIRST_APPLIED = 5  # the first step that does not overflow from FORCED_START (2^20 fits, measured)


def _micro_batches(rank: int, step: int) -> Batches:
    return random_micro_batches(CONFIG.vocab_size, rank=rank, step=step, mbs=MBS, seq=SEQ, count=COUNT)


def _engine(topology: ParallelTopology, step_engine: str, *, one_sample: bool = False) -> Any:
    engine = build_test_engine(
        CONFIG, topology, micro_batch_size=1 if one_sample else MBS, global_batch_size=MBS * COUNT * DP,
        dtype="fp16", zero_stage=2, weight_decay=0.1, grad_clip=GRAD_CLIP, lr=1e-2, step_engine=step_engine,
    )  # fmt: skip
    engine.engine.optimizer.loss_scaler.scale_window = SCALE_WINDOW  # the configured 500 would never grow here
    return engine


def _figures(result: Any) -> dict[str, Any]:
    return {"loss": result.loss, "norm": result.grad_norm, "scale": result.loss_scale, "overflow": result.overflow}


def _train(
    engine: Any, rank: int, steps: range, *, one_sample: bool = False, save: Path | None = None
) -> dict[str, Any]:
    scaler = type(engine.engine.optimizer.loss_scaler).__name__
    out: dict[str, Any] = {"device_figures": engine.device_figures, "scaler": scaler, "steps": [], "scalers": []}
    for step in steps:
        batches = _micro_batches(rank, step)
        out["steps"].append(_figures(engine.train_batch(one_sample_each(batches) if one_sample else batches)))
        out["scalers"].append(engine.loss_scaler_state())
        if step == FIRST_APPLIED:
            out["first"] = engine_snapshot(engine)
        if save is not None and step == RESUME_AT - 1:
            save.mkdir(parents=True, exist_ok=True)
            engine.save_model(save, {})
            out["resume_from"] = {"optimizer": engine.optimizer_state(), "scaler": engine.loss_scaler_state()}
    out["last"] = engine_snapshot(engine)
    return out


def _rank(topology: ParallelTopology, root: str) -> dict[str, Any]:
    import torch.distributed as dist
    from deepspeed.accelerator import get_accelerator

    os.environ.setdefault("LOCAL_RANK", "0")
    get_accelerator().is_fp16_supported = lambda: True  # the one check between DeepSpeed and fp16 on this CPU
    rank, saved = dist.get_rank(), Path(root) / f"step-{RESUME_AT:08d}"
    out: dict[str, Any] = {}
    for name, step_engine, one_sample in (("deepspeed", "deepspeed", False), ("floor", "deepspeed", True)):
        engine = _engine(topology, step_engine, one_sample=one_sample)
        engine.load_loss_scaler_state(FORCED_START)
        out[name] = _train(engine, rank, range(STEPS), one_sample=one_sample)
        engine.close()
    engine = _engine(topology, "auto")
    engine.load_loss_scaler_state(FORCED_START)
    out["auto"] = _train(engine, rank, range(STEPS), save=saved)
    with counting_host_reads() as issuing:
        pending = [engine.train_batch_async(_micro_batches(rank, STEPS + s)) for s in range(2)]
    with counting_host_reads() as reading:
        figures = [_figures(p.result()) for p in pending]
    out["reads"] = {"issuing": dict(issuing.counts), "reading": dict(reading.counts), "figures": figures}
    # An overflow: a scale far too large, as a checkpoint's scaler state would set it, with no hysteresis left.
    engine.load_loss_scaler_state({**engine.loss_scaler_state(), "scale": 2.0**30, "hysteresis_left": 1})
    before, scaler_before = engine_snapshot(engine), engine.loss_scaler_state()
    overflowed = _figures(engine.train_batch(_micro_batches(rank, 99)))
    after = engine_snapshot(engine)
    out["overflow"] = {
        "figures": overflowed,
        "changed": [k for part in before for k in before[part] if not torch.equal(before[part][k], after[part][k])],
        "scalers": (scaler_before, engine.loss_scaler_state()),
    }
    engine.close()
    dist.barrier()  # the model file written
    engine = _engine(topology, "auto")
    engine.load_model(saved)
    # (DeepSpeed's own step would have no optimizer state to save here: its overflow steps return before AdamW's
    # first step creates the moments. The device step runs the fused step skipped: zero moments at step 0.)
    engine.load_optimizer_state(out["auto"]["resume_from"]["optimizer"])
    engine.load_loss_scaler_state(out["auto"]["resume_from"]["scaler"])
    out["resumed"] = _train(engine, rank, range(RESUME_AT, STEPS))
    engine.close()
    del out["auto"]["resume_from"]
    return out


@pytest.fixture(scope="module")
def launch(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return run_distributed(_rank, DP, str(tmp_path_factory.mktemp("fp16")), dp=DP, timeout_s=600)


def _largest_difference(got: dict[str, Any], want: dict[str, Any]) -> dict[str, float]:
    """Per quantity: the largest loss difference, relative difference of the finite norms and per-tensor relative
    norm (weights and optimizer state after the last step)."""
    pairs = list(zip(got["steps"], want["steps"], strict=True))
    return {
        "losses": max(abs(a["loss"] - b["loss"]) for a, b in pairs),
        "norms": max(abs(a["norm"] - b["norm"]) / b["norm"] for a, b in pairs if math.isfinite(b["norm"])),
        **{
            part: max(
                relative_norm(got["last"][part][k].double(), want["last"][part][k].double()) for k in want["last"][part]
            )
            for part in ("weights", "state")
        },
    }


def _on_the_device(run: dict[str, Any]) -> bool:
    """Whether `run` trained with the device scaler and step (the runs compared with DeepSpeed's must have)."""
    return run["device_figures"] and run["scaler"] == "DeviceLossScaler"


def test_the_step_keeps_its_verdicts_on_the_device(launch: list[dict[str, Any]]) -> None:
    for result in launch:
        assert _on_the_device(result["auto"]) and _on_the_device(result["resumed"])
        assert not result["deepspeed"]["device_figures"] and result["deepspeed"]["scaler"] == "DynamicLossScaler"


def test_a_step_reads_nothing_on_the_host_until_its_figures_are_asked_for(launch: list[dict[str, Any]]) -> None:
    """No scalar read, nonzero or device-to-host copy while two steps are issued; one read per step afterwards,
    which brings the loss scale and the overflow flag with the loss and the norm."""
    for result in launch:
        reads = result["reads"]
        assert reads["issuing"] == {}, reads["issuing"]
        assert reads["reading"] == {"tolist": 2}
        figures = reads["figures"]
        assert figures[0]["scale"] == result["auto"]["scalers"][-1]["scale"]  # the scale the step ran at
        assert all(f["overflow"] == math.isinf(f["norm"]) for f in figures)


def test_the_scale_follows_deepspeeds_own_scaler(launch: list[dict[str, Any]]) -> None:
    """The same scale, overflow verdict and scaler state after every step as DeepSpeed's scaler in DeepSpeed's step,
    over a run that overflows (the first overflow absorbed by the hysteresis, the next ones halving the scale), grows
    after SCALE_WINDOW clean steps, overflows at the grown scale and comes down again."""
    for result in launch:
        ours, theirs = result["auto"], result["deepspeed"]
        assert _on_the_device(ours)
        verdicts = [(s["scale"], s["overflow"]) for s in ours["steps"]]
        assert verdicts == [(s["scale"], s["overflow"]) for s in theirs["steps"]]
        assert ours["scalers"] == theirs["scalers"]
        scales, overflows = [v[0] for v in verdicts], [v[1] for v in verdicts]
        assert overflows[:2] == [True, True] and scales[0] == scales[1] > scales[2]  # hysteresis, then a halving
        assert any(later > earlier for earlier, later in itertools.pairwise(scales))  # a growth
        assert not all(overflows) and overflows[-1]  # trained, then overflowed at the grown scale


def test_steps_track_deepspeeds_own_within_the_fp16_noise_floor(launch: list[dict[str, Any]]) -> None:
    """The first applied step: DeepSpeed multiplies the gradients by the rounded inverse of clip x scale, the fused
    kernel divides by the product, so moments and masters part by a few fp32 roundings (FIRST_STEP_RTOL). After it the
    runs part at fp16 rounding: where the fp32 masters differ in the last bit, an fp16 weight at a rounding boundary
    rounds the other way and the next steps carry that on. DeepSpeed's own step on the same samples cut into
    one-sample micro-batches parts from itself the same way (its fp16 gradients summed in another order): that
    distance, measured in the same launch, is the floor. Measured by `pytest tests/distributed/
    test_fp16_device_step.py` on a 2-core AMD EPYC CPU, 2026-11-26: ours 9.1e-6 (losses), 1.1e-6 (finite norms),
    0.013 (weights), 0.013 (state) against a floor of 1.0e-4, 5.1e-5, 0.029, 0.029 (the largest per-tensor figures are
    the attention biases', which start at zero)."""
    for result in launch:
        assert _on_the_device(result["auto"])
        for key, want in result["deepspeed"]["first"]["state"].items():
            got = result["auto"]["first"]["state"][key]
            assert relative_norm(got.double(), want.double()) <= FIRST_STEP_RTOL, key
        ours = _largest_difference(result["auto"], result["deepspeed"])
        floor = _largest_difference(result["floor"], result["deepspeed"])
        assert all(value > 0 for value in floor.values()), f"the one-sample run did not move: {floor}"
        for quantity, value in ours.items():
            assert value <= floor[quantity], f"{quantity}: {value:.3g} > noise floor {floor[quantity]:.3g}"


def test_an_overflow_changes_nothing_but_the_scale(launch: list[dict[str, Any]]) -> None:
    """Weights, fp32 masters, moments and step counts as before it; the scale halved (no hysteresis left), the
    overflow counted at its iteration."""
    for result in launch:
        assert _on_the_device(result["auto"])
        overflow = result["overflow"]
        figures, (before, after) = overflow["figures"], overflow["scalers"]
        assert figures["overflow"] and math.isinf(figures["norm"]) and figures["scale"] == 2.0**30
        assert overflow["changed"] == []
        iteration = before["iteration"]
        assert after == {**before, "scale": 2.0**29, "iteration": iteration + 1, "last_overflow_iteration": iteration}


def test_a_resume_continues_the_same_scales(launch: list[dict[str, Any]]) -> None:
    """An engine built afresh from the checkpoint the device run took after step RESUME_AT - 1 (weights, optimizer
    state, scaler state) trains the remaining steps as that run did: the same figures and scaler states, exactly."""
    for result in launch:
        assert _on_the_device(result["resumed"])
        assert result["resumed"]["steps"] == result["auto"]["steps"][RESUME_AT:]
        assert result["resumed"]["scalers"] == result["auto"]["scalers"][RESUME_AT:]
