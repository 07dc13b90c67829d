"""Every (tp, pp, dp) layout trains like one process: losses, grad norms, weights and evaluations within a few
noise floors of the single-process reference, and bit for bit like itself when resumed at the same layout.

One launch per layout (spawns are the slow part); each launch trains a tiny BLOOM for 10 steps on a fixed token
stream with a batch ramp-up (4, 4, 4, then 8 samples per step: every layout sees the same samples in every step),
then also checks, on the same ranks: resuming from a step-5 checkpoint at the same layout, the drift check on
injected drift (tp = 2), a bf16 run (some layouts), and what the test harness set up in the rank (the CPU
accelerator, the collective guard). The ZeRO stage, recompute mode and sequence parallelism vary across layouts
so that each is exercised somewhere. The reference (reference_training.py) is a plain BloomForCausalLM with
torch.optim.AdamW in this process, with no DeepSpeed and no process group; the noise floor (noise_floor.py) is
how far it moves when its sums are reordered, measured here on this CPU.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import reference_training
import torch
import torch.distributed as dist
from noise_floor import (
    BASE,
    NoiseFloor,
    Order,
    assert_outside,
    assert_within,
    bound,
    check_floor,
    floor_of,
    measure_floor,
    pinned_threads,
)
from reference_training import Recipe

from appliance.data.sampler import PretrainingSampler
from appliance.model.bloom import BloomForCausalLM
from appliance.model.config import BloomConfig
from appliance.model.ops import cross_entropy
from appliance.parallel.checkpoint.weight_shards import gather_full_state_dict
from appliance.parallel.tensor.drift import ReplicaDriftError
from appliance.parallel.testing import WrongDeviceError, build_test_engine, collective_guard, run_distributed
from appliance.parallel.topology import ParallelTopology
from appliance.train.schedule import BatchRampup, LRSchedule

pytestmark = pytest.mark.distributed

CONFIG = BloomConfig(vocab_size=256, hidden_size=64, n_layer=2, n_head=4)  # 256 = 128 x tp(2)
SEQ, MBS, STEPS, RESUME_AT, SEED = 16, 2, 10, 5, 1234
RAMPUP = BatchRampup(start=4, increment=4, samples=12, final=8)
LR = LRSchedule(lr=1e-2, min_lr=1e-3, warmup_samples=8, decay_samples=68)
OPTIMIZER = {"weight_decay": 0.1, "betas": (0.9, 0.95), "eps": 1e-8}
GRAD_CLIP = 0.5  # low enough that clipping acts in some steps
# Bounds are multiples of the noise floor this CPU measures (noise_floor.py). The layouts reorder the same sums
# as the floor's reorderings do, but at more places at once (every matmul split over TP ranks, gradients summed over
# DP ranks, micro-batches and ZeRO partitions, DeepSpeed's clipping), and independent roundings add up like a
# random walk: measured at 0.4-3.6 x the floor over the eight layouts, so 10 x leaves room for other CPUs.
FP32_FACTOR = 10.0
# A bf16 layout differs from the bf16 reference by bf16 rounding of its own, as large as the bf16 reference's gap
# to fp32 (the floor), so its gap to fp32 is at most about twice that: measured 0.8-1.0 x, bound 4 x.
BF16_FACTOR = 4.0
TEETH = 10.0  # a real bug must land this far beyond a bound (measured: 29 x and more)
FP32_QUANTITIES = ("losses", "norms", "weights", "logits", "logprobs", "eval_sum_dp1", "eval_sum_dp2")

# (tp, pp, dp) -> what else this launch exercises.
LAYOUTS: dict[tuple[int, int, int], dict[str, Any]] = {
    (1, 1, 1): {"zero": 0, "recompute": "none", "sp": False, "bf16": True},
    (2, 1, 1): {"zero": 1, "recompute": "selective", "sp": True, "bf16": False},
    (1, 2, 1): {"zero": 0, "recompute": "full", "sp": False, "bf16": False},
    (1, 1, 2): {"zero": 2, "recompute": "none", "sp": False, "bf16": True},  # the planner's 8 x H100: tp1 pp1 dp8
    (2, 2, 1): {"zero": 1, "recompute": "selective", "sp": False, "bf16": True},
    (2, 1, 2): {"zero": 2, "recompute": "full", "sp": True, "bf16": False},
    (1, 2, 2): {"zero": 1, "recompute": "none", "sp": False, "bf16": False},
    (2, 2, 2): {"zero": 1, "recompute": "full", "sp": True, "bf16": True},
}


def token_stream() -> torch.Tensor:
    """Samples of SEQ + 1 tokens: arithmetic progressions mod 200 with a per-sample start and stride, so the
    loss has something to learn. Ids 200..255 are vocabulary padding, never a label."""
    steps = [RAMPUP.global_batch_at(c) for c in _consumed_before_each_step()]
    n = sum(steps)
    g = torch.Generator().manual_seed(0)
    start, stride = torch.randint(0, 200, (n, 1), generator=g), torch.randint(1, 7, (n, 1), generator=g)
    return (start + stride * torch.arange(SEQ + 1)) % 200


def _consumed_before_each_step() -> list[int]:
    consumed, out = 0, []
    for _ in range(STEPS):
        out.append(consumed)
        consumed += RAMPUP.global_batch_at(consumed)
    return out


_batch = reference_training.batch


# ---- the single-process reference ----------------------------------------------------------------------------
RECIPE = Recipe(
    config=CONFIG,
    seed=SEED,
    micro_batch_size=MBS,
    steps=[(consumed, RAMPUP.global_batch_at(consumed)) for consumed in _consumed_before_each_step()],
    lr_at=LR.at,
    grad_clip=GRAD_CLIP,
    **OPTIMIZER,
)


def reference_run(order: Order = BASE, **options: Any) -> dict[str, Any]:
    """The reference trained in ``order`` (options: see reference_training.train), and evaluated as the layouts
    evaluate."""
    model, trace = reference_training.train(RECIPE, token_stream(), order, **options)
    with pinned_threads(order.threads):
        return trace | _reference_outputs(model)


def _reference_outputs(model: BloomForCausalLM) -> dict[str, Any]:
    """What the evaluation paths compute, from the reference model: logits and target log-probabilities on the
    probe, the log-softmax behind the greedy and next-token choices, and the eval sums at dp 1 and 2."""
    from appliance.eval.scoring import ModelScorer

    probe = _probe_batches()
    scorer = ModelScorer(model, torch.device("cpu"))
    logprobs, _ = scorer.target_logprobs(probe["ids"], probe["targets"])
    model.eval()
    with torch.no_grad():
        out: dict[str, Any] = {
            "logits": model(probe["ids"]),
            "logprobs": logprobs,
            "all_logprobs": torch.log_softmax(model(probe["ids"]).float(), dim=-1),
            "next_logprobs": torch.log_softmax(
                model(probe["prompts"] * probe["mask"], attention_mask=probe["mask"])[:, -1].float(), dim=-1
            ),
        }
        for dp in (1, 2):
            batches = [b for rank in range(dp) for b in _eval_micro_batches(rank)]
            out[f"eval_sum_dp{dp}"] = sum(float(cross_entropy(model(x), y, reduction="sum")) for x, y in batches)
    model.train()
    return out


# ---- one layout, on its ranks ----------------------------------------------------------------------------
def _engine(topology: ParallelTopology, options: dict[str, Any], dtype: str) -> Any:
    return build_test_engine(
        CONFIG,
        topology,
        micro_batch_size=MBS,
        global_batch_size=RAMPUP.final,
        zero_stage=options["zero"],
        dtype=dtype,
        grad_clip=GRAD_CLIP,
        recompute=options["recompute"],
        sequence_parallel=options["sp"],
        lr=0.0,
        seed=SEED,
        **OPTIMIZER,
    )


def _train(engine: Any, topology: ParallelTopology, first_step: int, save_at: int | None, save_dir: Path) -> dict:
    tokens = token_stream()
    consumed_list = _consumed_before_each_step()
    sampler = iter(PretrainingSampler(len(tokens), consumed_list[first_step], MBS, engine.dp_rank, topology.dp))
    losses, norms = [], []
    for step in range(first_step, STEPS):
        if step == save_at:
            _save(engine, save_dir)
        consumed = consumed_list[step]
        batch = RAMPUP.global_batch_at(consumed)
        engine.set_lr(LR.at(consumed + batch))
        micro = [_batch(tokens, next(sampler)) for _ in range(batch // (MBS * topology.dp))]
        result = engine.train_batch(micro)
        losses.append(result.loss)
        norms.append(result.grad_norm)
    return {"losses": losses, "norms": norms}


def _save(engine: Any, step_dir: Path) -> None:
    step_dir.mkdir(parents=True, exist_ok=True)
    engine.save_model(step_dir, {"step": "test"})
    torch.save(engine.optimizer_state(), step_dir / f"rank{dist.get_rank()}.pt")
    dist.barrier()


def _inject_drift(engine: Any) -> str | None:
    """Change one TP-replicated parameter by one ulp on TP rank 1; the check must name it on every rank."""
    engine.check_drift()  # clean after training
    name, param = next((n, p) for n, p in engine.named_parameters() if not getattr(p, "tensor_model_parallel", 0))
    if engine.tp_rank == 1:
        with torch.no_grad():
            flat = param.view(-1)
            flat[0] = torch.nextafter(flat[0], torch.tensor(float("inf"), dtype=flat.dtype))
    try:
        engine.check_drift()
    except ReplicaDriftError as e:
        return f"{name}|{e}"
    return None


def _optimizer_tensors(engine: Any) -> list[torch.Tensor]:
    """Copies of what the optimizer updates: the master parameters it steps (fp32 partitions under bf16 or ZeRO,
    the model's own parameters otherwise) and Adam's state for each."""
    base = engine.engine.optimizer
    base = getattr(base, "optimizer", base)  # DeepSpeed's bf16 and ZeRO optimizers wrap a torch AdamW
    out = []
    for group in base.param_groups:
        for param in group["params"]:
            out.append(param.detach().clone())
            out += [v.detach().clone() for v in base.state.get(param, {}).values() if isinstance(v, torch.Tensor)]
    return out


def _non_finite_step(engine: Any, topology: ParallelTopology) -> dict[str, Any]:
    """One step whose loss is NaN on every rank that computes one: the engine must skip the update everywhere."""
    weights = [p.detach().clone() for _, p in engine.named_parameters()]
    optimizer = _optimizer_tensors(engine)
    tokens = token_stream()
    micro = [_batch(tokens, [2 * i, 2 * i + 1]) for i in range(RAMPUP.final // (MBS * topology.dp))]
    engine.loss_fn.inject_nan = True
    try:
        result = engine.train_batch(micro)
    finally:
        engine.loss_fn.inject_nan = False
    after = [p.detach() for _, p in engine.named_parameters()]
    return {
        "loss": result.loss,
        "grad_norm": result.grad_norm,
        "weights_unchanged": all(torch.equal(a, b) for a, b in zip(weights, after, strict=True)),
        "optimizer_unchanged": all(
            torch.equal(a, b) for a, b in zip(optimizer, _optimizer_tensors(engine), strict=True)
        ),
        "next_step_loss": engine.train_batch(micro).loss,  # a clean step afterwards trains normally
    }


def _probe_batches() -> dict[str, torch.Tensor]:
    """Inputs for the evaluation paths: an odd length (sequence parallelism pads it) and left-padded prompts."""
    tokens = token_stream()
    mask = torch.ones(3, 6, dtype=torch.int64)
    mask[1, :2] = 0  # one prompt two tokens shorter, padded on the left
    return {"ids": tokens[:3, :11], "targets": tokens[:3, 1:12], "prompts": tokens[3:6, :6], "mask": mask}


def _eval_micro_batches(dp_rank: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Two micro-batches per DP rank; the last row of the second one is padding (labels ignored)."""
    tokens = token_stream()
    first = _batch(tokens, [4 * dp_rank, 4 * dp_rank + 1])
    inputs, labels = _batch(tokens, [4 * dp_rank + 2, 4 * dp_rank + 3])
    labels = labels.clone()
    labels[-1] = -100
    return [first, (inputs, labels)]


def _evaluate(engine: Any) -> dict[str, Any]:
    probe = _probe_batches()
    scorer = engine.task_model()
    logprobs, greedy = scorer.target_logprobs(probe["ids"], probe["targets"])
    return {
        "logprobs": logprobs,
        "greedy": greedy,
        "next": scorer.next_tokens(probe["prompts"] * probe["mask"], probe["mask"]),
        "sums": engine.eval_sums(_eval_micro_batches(engine.dp_rank)),
    }


def _harness(engine: Any) -> dict[str, Any]:
    """What run_distributed set up in this rank: the accelerator and the collective guard."""
    import deepspeed.comm.comm as ds_comm
    from deepspeed.accelerator import get_accelerator

    guard = collective_guard()
    try:
        dist.all_reduce(torch.zeros(2, 3, device="meta"))  # refused before any rank communicates
        refused = None
    except WrongDeviceError as e:
        refused = str(e)
    return {
        "env": {key: os.environ.get(key) for key in ("DS_ACCELERATOR", "CUDA_VISIBLE_DEVICES")},
        "accelerator": get_accelerator().device_name(),
        "cuda_devices": torch.cuda.device_count(),
        "shm_op_built": ds_comm.cdb.shm_comm_op is not None,  # DeepSpeed's CPU shared-memory all-reduce
        "engine_device": str(engine.engine.device),
        "guard_device": str(guard.device),
        "meta_all_reduce": refused,
    }


def _optimizer_kind(engine: Any) -> dict[str, Any]:
    optimizer = engine.engine.optimizer
    return {
        "stage": engine.engine.zero_optimization_stage(),
        "class": type(optimizer).__name__,
        "partitions_gradients": bool(getattr(optimizer, "partition_gradients", False)),
    }


def layout_run(topology: ParallelTopology, options: dict[str, Any], root: Path) -> dict[str, Any]:
    os.environ.setdefault("LOCAL_RANK", "0")  # read by DeepSpeed's PipelineModule
    engine = _engine(topology, options, "fp32")
    out_shapes = {name: tuple(p.shape) for name, p in engine.named_parameters()}  # compared with preflight's roles
    before = collective_guard().calls.copy()
    out: dict[str, Any] = {"shapes": out_shapes, "first": _train(engine, topology, 0, RESUME_AT, root / "step5")}
    out["collectives"] = dict(collective_guard().calls - before)  # ten training steps, saves included
    out["harness"] = _harness(engine)
    _save(engine, root / "final")
    if dist.get_rank() == 0:  # the whole model on one rank, assembled from the checkpoint just written
        out["whole_model_logits"] = engine.module(_probe_batches()["ids"]).detach()
    # Resume at the same layout from the step-5 checkpoint, into the same engine, and redo steps 6..10.
    engine.load_model(root / "step5")
    engine.load_optimizer_state(torch.load(root / "step5" / f"rank{dist.get_rank()}.pt", weights_only=True))
    out["resumed"] = _train(engine, topology, RESUME_AT, None, root)
    out["eval"] = _evaluate(engine)
    out["non_finite"] = {"fp32": _non_finite_step(engine, topology)}
    out["drift"] = _inject_drift(engine) if topology.tp > 1 else None
    if options["bf16"]:
        bf16 = _engine(topology, options, "bf16")
        out["bf16_optimizer"] = _optimizer_kind(bf16)
        out["bf16"] = _train(bf16, topology, 0, None, root)
        out["non_finite"]["bf16"] = _non_finite_step(bf16, topology)
    return out


# ---- the checks ----------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def measured() -> tuple[dict[str, Any], NoiseFloor]:
    return measure_floor(reference_run)


@pytest.fixture(scope="module")
def reference(measured: tuple[dict[str, Any], NoiseFloor]) -> dict[str, Any]:
    return measured[0]


@pytest.fixture(scope="module")
def floor(measured: tuple[dict[str, Any], NoiseFloor]) -> NoiseFloor:
    return measured[1]


@pytest.fixture(scope="module")
def bf16_floor(reference: dict[str, Any]) -> NoiseFloor:
    """How far bf16 training moves the single-process reference from its fp32 run."""
    return floor_of(reference, [("bf16 reference", reference_run(dtype="bf16"))])


@pytest.fixture(scope="module", params=list(LAYOUTS), ids=lambda layout: "tp{}-pp{}-dp{}".format(*layout))
def launch(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    tp, pp, dp = request.param
    root = tmp_path_factory.mktemp(f"tp{tp}-pp{pp}-dp{dp}")
    options = LAYOUTS[request.param]
    results = run_distributed(layout_run, tp * pp * dp, options, root, tp=tp, pp=pp, dp=dp, timeout_s=400)
    return {"layout": request.param, "options": options, "root": root, "ranks": results}


def test_noise_floor_is_nonzero_but_small(floor: NoiseFloor, bf16_floor: NoiseFloor) -> None:
    """Pass: reordering the reference's sums moves every compared quantity, by no more than rounding amplified by
    training (so the bounds below are neither 0 nor loose); bf16 moves the losses further, but under 1%."""
    check_floor(floor, FP32_QUANTITIES)
    assert floor["losses"] < bf16_floor["losses"] < 1e-2, (floor.report(), bf16_floor.report())


def test_the_bounds_have_teeth(reference: dict[str, Any], floor: NoiseFloor, bf16_floor: NoiseFloor) -> None:
    """Pass: two real bugs, the learning rate off by 1% and one micro-batch of step 4 lost, move every compared
    quantity of the reference past TEETH x its bound (its factor x the floor)."""
    for bug, trace in (
        ("lr x 1.01", reference_run(lr_scale=1.01)),
        ("micro-batch lost", reference_run(drop_micro_batch=3)),
    ):
        for key in FP32_QUANTITIES:
            assert_outside(trace[key], reference[key], key, floor, TEETH * FP32_FACTOR, bug)
        if bug == "micro-batch lost":  # 1% of lr moves the losses less than bf16 rounding does
            assert_outside(trace["losses"], reference["losses"], "losses", bf16_floor, TEETH * BF16_FACTOR, bug)


def test_losses_and_grad_norms_equal_one_process(
    launch: dict[str, Any], reference: dict[str, Any], floor: NoiseFloor
) -> None:
    for rank, result in enumerate(launch["ranks"]):
        for key in ("losses", "norms"):
            assert_within(result["first"][key], reference[key], key, floor, FP32_FACTOR, f"rank {rank} {key}")
    assert reference["losses"][-1] < reference["losses"][0] - 0.4  # it learned something: the test has teeth


def test_gathered_parameters_equal_one_process(
    launch: dict[str, Any], reference: dict[str, Any], floor: NoiseFloor
) -> None:
    gathered = gather_full_state_dict(launch["root"] / "final")
    assert_within(gathered, reference["weights"], "weights", floor, FP32_FACTOR, "gathered weights")


def test_resume_at_the_same_layout_repeats_the_steps(launch: dict[str, Any]) -> None:
    for result in launch["ranks"]:
        assert result["resumed"]["losses"] == result["first"]["losses"][RESUME_AT:]
        assert result["resumed"]["norms"] == result["first"]["norms"][RESUME_AT:]


def test_evaluation_paths_equal_one_process(
    launch: dict[str, Any], reference: dict[str, Any], floor: NoiseFloor
) -> None:
    """Pass: logits of the whole model, target log-probabilities and eval sums within their bounds; where the
    greedy and next-token answers differ from the reference's, the reference had a near tie there (the chosen
    tokens' log-probabilities within the bound of each other)."""
    probe = _probe_batches()
    logits = launch["ranks"][0]["whole_model_logits"]
    assert_within(logits, reference["logits"], "logits", floor, FP32_FACTOR, "whole-model logits")
    greedy_tie = bound(floor, "all_logprobs.max_abs", FP32_FACTOR)
    next_tie = bound(floor, "next_logprobs.max_abs", FP32_FACTOR)
    every = reference["all_logprobs"]
    best = every.max(dim=-1).values
    behind = best - every.gather(-1, probe["targets"][..., None]).squeeze(-1)  # the target's gap to the top
    top2 = every.topk(2, dim=-1).values
    margin = top2[..., 0] - top2[..., 1]
    nexts = reference["next_logprobs"]
    for rank, result in enumerate(launch["ranks"]):  # every rank of every replica returns the replica's answer
        what = f"rank {rank}"
        assert_within(result["eval"]["logprobs"], reference["logprobs"], "logprobs", floor, FP32_FACTOR, what)
        greedy = result["eval"]["greedy"]
        # "the target is the argmax": the reference puts the target within the bound of its top log-prob
        assert bool((behind[greedy] <= greedy_tie).all()), (what, behind[greedy], greedy_tie)
        # "it is not": the reference's argmax is another token, or only by a near tie
        assert bool(((behind > 0) | (margin <= greedy_tie))[~greedy].all()), (what, greedy, margin, greedy_tie)
        chosen = nexts.gather(-1, result["eval"]["next"][:, None]).squeeze(-1)
        assert bool((nexts.max(dim=-1).values - chosen <= next_tie).all()), (what, chosen, next_tie)
    dp = launch["layout"][2]
    tokens = sum(int((y != -100).sum()) for rank in range(dp) for _, y in _eval_micro_batches(rank))
    assert sum(r["eval"]["sums"][1] for r in launch["ranks"]) == tokens  # counted once per replica
    loss_sum = sum(r["eval"]["sums"][0] for r in launch["ranks"])
    key = f"eval_sum_dp{dp}"
    assert_within(loss_sum, reference[key], key, floor, FP32_FACTOR, "summed eval loss")


def test_drift_check_names_the_injected_parameter(launch: dict[str, Any]) -> None:
    if launch["layout"][0] == 1:
        pytest.skip("no TP-replicated copies at tp=1")
    by_position: dict[tuple[int, int], set[str]] = {}
    for rank, result in enumerate(launch["ranks"]):
        assert result["drift"] is not None, f"rank {rank} did not detect the drift"
        name, message = result["drift"].split("|", 1)
        assert name in message and "differ from rank" in message
        by_position.setdefault((rank // launch["layout"][0],), set()).add(name)
    assert all(len(names) == 1 for names in by_position.values())  # both TP ranks report the same parameter


def test_bf16_losses_track_fp32(launch: dict[str, Any], reference: dict[str, Any], bf16_floor: NoiseFloor) -> None:
    if not launch["options"]["bf16"]:
        pytest.skip("bf16 runs in " + ", ".join(str(k) for k, v in LAYOUTS.items() if v["bf16"]))
    for rank, result in enumerate(launch["ranks"]):
        what = f"rank {rank} bf16 losses against the fp32 reference"
        assert_within(result["bf16"]["losses"], reference["losses"], "losses", bf16_floor, BF16_FACTOR, what)


def test_bf16_runs_the_optimizer_of_its_zero_stage(launch: dict[str, Any]) -> None:
    """Pass: bf16 with ZeRO-2 (at tp1 pp1 dp2: the planner's layout for 8 x H100 is tp1 pp1 dp8) gets DeepSpeed's
    ZeRO stage-2 optimizer, which partitions the gradients; bf16 at ZeRO 0 or 1 gets DeepSpeed's bf16 optimizer;
    one replica on one stage (tp1 pp1 dp1) steps without DeepSpeed's engine, with the flat AdamW."""
    if not launch["options"]["bf16"]:
        pytest.skip("bf16 runs in " + ", ".join(str(k) for k, v in LAYOUTS.items() if v["bf16"]))
    _, pp, dp = launch["layout"]
    if pp == 1 and dp == 1:
        want = {"stage": 0, "class": "FlatAdamW", "partitions_gradients": False}
    elif launch["options"]["zero"] == 2:
        want = {"stage": 2, "class": "DeepSpeedZeroOptimizer", "partitions_gradients": True}
    else:
        want = {"stage": 1, "class": "BF16_Optimizer", "partitions_gradients": False}
    for result in launch["ranks"]:
        assert result["bf16_optimizer"] == want


def test_ranks_run_on_the_cpu_accelerator(launch: dict[str, Any]) -> None:
    """Pass: every rank started with DS_ACCELERATOR=cpu and no CUDA device visible, DeepSpeed's accelerator and
    the engine's device are the CPU, and DeepSpeed's CPU shared-memory all-reduce was not built."""
    for result in launch["ranks"]:
        harness = result["harness"]
        assert harness["env"] == {"DS_ACCELERATOR": "cpu", "CUDA_VISIBLE_DEVICES": ""}
        assert harness["accelerator"] == "cpu" and harness["cuda_devices"] == 0
        assert harness["engine_device"] == harness["guard_device"] == "cpu"
        assert not harness["shm_op_built"]


def test_collective_guard_sees_the_training_and_refuses_a_wrong_device(launch: dict[str, Any]) -> None:
    """Pass: the guard counted the collectives of ten engine steps on every rank, through each route the layout
    uses (DeepSpeed's comm layer, our TP mappings' import-time aliases, pipeline point-to-point), and refused a
    tensor on the meta device naming the call, the device and the shape."""
    tp, pp, dp = launch["layout"]
    options = launch["options"]
    # clipping's global norm, DeepSpeed's gradient all-reduce, TP's reduce_from; one replica on one rank needs none
    expected = {"all_reduce"} if tp * pp * dp > 1 else set()
    if dp > 1 and options["zero"] > 0:
        # ZeRO: the updated partitions travel as one async broadcast per (layer, owner) piece, overlapped with the
        # next forward (parallel/zero/param_gather.py, on by default) instead of DeepSpeed's all-gather
        expected.add("broadcast")
    if pp > 1:
        expected |= {"send", "recv"}
    if tp > 1 and options["sp"]:
        expected |= {"all_gather_single", "reduce_scatter_single"}  # the mappings' aliases bound at import
    for rank, result in enumerate(launch["ranks"]):
        calls = result["collectives"]
        assert expected <= {name for name, count in calls.items() if count > 0}, (rank, calls)
        message = result["harness"]["meta_all_reduce"]
        assert message == (
            "torch.distributed.all_reduce was handed a tensor on meta of shape (2, 3); this rank computes on cpu"
        )


def test_a_non_finite_loss_skips_the_step_on_every_rank_and_changes_nothing(launch: dict[str, Any]) -> None:
    """Pass: with the loss NaN, every rank reports a non-finite loss or norm, the weights, master weights and Adam
    state are bit-identical afterwards (fp32 and, where run, bf16 optimizers), and the next clean step trains."""
    import math

    for rank, result in enumerate(launch["ranks"]):
        for dtype, step in result["non_finite"].items():
            assert not (math.isfinite(step["loss"]) and math.isfinite(step["grad_norm"])), (rank, dtype)
            assert not math.isfinite(step["grad_norm"]), (rank, dtype)  # the norm is global: all ranks see it
            assert step["weights_unchanged"] and step["optimizer_unchanged"], (rank, dtype)
            assert math.isfinite(step["next_step_loss"]), (rank, dtype)


def test_every_ranks_shard_shapes_equal_preflights_role_for_its_stage(launch: dict[str, Any], tmp_path: Path) -> None:
    """preflight (one process, the fake process group) of a plan with this launch's model and layout: every launched
    rank holds, by Hugging Face name, the parameters and shapes of the role standing for its pipeline stage."""
    if launch["layout"] != (2, 2, 2):
        pytest.skip("compared at tp=2, pp=2, dp=2")
    from appliance.hardware.scaled import hardware_for
    from appliance.planner import load_model_shape, make_plan
    from appliance.planner.layout import parse_layout_fields
    from appliance.preflight.run import preflight

    options = launch["options"]
    model = tmp_path / "launched.toml"
    model.write_text(
        f'name = "launched"\nlayers = {CONFIG.n_layer}\nhidden = {CONFIG.hidden_size}\nheads = {CONFIG.n_head}\n'
        f"vocab_size = {CONFIG.vocab_size}\nseq_len = {SEQ}\n"
    )
    tp, pp, dp = launch["layout"]
    layout = (
        f"tp={tp},pp={pp},dp={dp},mbs={MBS},gbs={RAMPUP.final},zero={options['zero']},"
        f"recompute={options['recompute']},sp={int(options['sp'])}"
    )
    spec = make_plan(hardware_for("cpu-laptop-2core"), load_model_shape(str(model)), fixed=parse_layout_fields(layout))
    roles = preflight(spec.spec(), steps=2).reports
    topology = ParallelTopology(tp=tp, pp=pp, dp=dp, world_size=tp * pp * dp)
    for rank, result in enumerate(launch["ranks"]):
        (role,) = [r for r in roles if topology.pp_rank(rank) in r.role.stages]
        assert result["shapes"] == role.shapes, (rank, role.role.name)
    assert {r.role.name for r in roles} == {"first", "last"} and roles[0].shapes != roles[1].shapes
