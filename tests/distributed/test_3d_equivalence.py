"""Every (tp, pp, dp) layout trains exactly like one process: same losses, same grad norms, same weights.

One launch per layout (spawns are the slow part); each launch trains a tiny BLOOM for 10 steps on a fixed token
stream with a batch ramp-up (4, 4, 4, then 8 samples per step: every layout sees the same samples in every step),
then also checks, on the same ranks: resuming from a step-5 checkpoint at the same layout, the drift check on
injected drift (tp = 2), and a bf16 run (some layouts). The ZeRO stage, recompute mode and sequence parallelism
vary across layouts so that each is exercised somewhere. The reference is a plain BloomForCausalLM with
torch.optim.AdamW in this process, with no DeepSpeed and no process group.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from appliance.data.sampler import PretrainingSampler
from appliance.model.bloom import BloomForCausalLM
from appliance.model.config import BloomConfig
from appliance.model.ops import cross_entropy
from appliance.parallel.drift import ReplicaDriftError
from appliance.parallel.engine import build_engine, param_groups
from appliance.parallel.shards import gather_full_state_dict
from appliance.parallel.testing import run_distributed
from appliance.parallel.topology import ParallelTopology
from appliance.train.schedule import BatchRampup, LRSchedule

pytestmark = pytest.mark.distributed

CONFIG = BloomConfig(vocab_size=256, hidden_size=64, n_layer=2, n_head=4)  # 256 = 128 x tp(2)
SEQ, MBS, STEPS, RESUME_AT, SEED = 16, 2, 10, 5, 1234
RAMPUP = BatchRampup(start=4, increment=4, samples=12, final=8)
LR = LRSchedule(lr=1e-2, min_lr=1e-3, warmup_samples=8, decay_samples=68)
OPTIMIZER = {"weight_decay": 0.1, "betas": (0.9, 0.95), "eps": 1e-8}
GRAD_CLIP = 0.5  # low enough that clipping acts in some steps
FP32_TOL, BF16_TOL = 1e-5, 2e-2

# (tp, pp, dp) -> what else this launch exercises.
LAYOUTS: dict[tuple[int, int, int], dict[str, Any]] = {
    (1, 1, 1): {"zero": 0, "recompute": "none", "sp": False, "bf16": True},
    (2, 1, 1): {"zero": 1, "recompute": "selective", "sp": True, "bf16": False},
    (1, 2, 1): {"zero": 0, "recompute": "full", "sp": False, "bf16": False},
    (1, 1, 2): {"zero": 2, "recompute": "none", "sp": False, "bf16": False},
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


def _batch(tokens: torch.Tensor, indices: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    sample = tokens[indices]
    return sample[:, :-1].contiguous(), sample[:, 1:].contiguous()


# ---- the single-process reference ----------------------------------------------------------------------------
def reference_run() -> dict[str, Any]:
    tokens = token_stream()
    model = BloomForCausalLM(CONFIG)
    model.init_weights(torch.Generator().manual_seed(SEED))
    named = [(n, p) for n, p in model.named_parameters()]  # the tied head appears once
    optimizer = torch.optim.AdamW(
        param_groups(named, OPTIMIZER["weight_decay"]), lr=0.0, betas=OPTIMIZER["betas"], eps=OPTIMIZER["eps"]
    )
    losses, norms = [], []
    for consumed in _consumed_before_each_step():
        batch = RAMPUP.global_batch_at(consumed)
        for group in optimizer.param_groups:
            group["lr"] = LR.at(consumed + batch)
        optimizer.zero_grad()
        micro = [list(range(i, i + MBS)) for i in range(consumed, consumed + batch, MBS)]
        total = 0.0
        for indices in micro:
            inputs, labels = _batch(tokens, indices)
            loss = cross_entropy(model(inputs), labels)
            (loss / len(micro)).backward()
            total += loss.item() / len(micro)
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), GRAD_CLIP)))
        optimizer.step()
        losses.append(total)
    state = {k: v.detach().clone() for k, v in model.state_dict().items() if k != "lm_head.weight"}
    return {"losses": losses, "norms": norms, "state": state}


# ---- one layout, on its ranks ----------------------------------------------------------------------------
def _engine(topology: ParallelTopology, options: dict[str, Any], dtype: str) -> Any:
    return build_engine(
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


def layout_run(topology: ParallelTopology, options: dict[str, Any], root: Path) -> dict[str, Any]:
    os.environ.setdefault("LOCAL_RANK", "0")  # read by DeepSpeed's PipelineModule
    engine = _engine(topology, options, "fp32")
    out: dict[str, Any] = {"first": _train(engine, topology, 0, RESUME_AT, root / "step5")}
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
        out["bf16"] = _train(bf16, topology, 0, None, root)
        out["non_finite"]["bf16"] = _non_finite_step(bf16, topology)
    return out


# ---- the checks ----------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def reference() -> dict[str, Any]:
    return reference_run()


@pytest.fixture(scope="module", params=list(LAYOUTS), ids=lambda layout: "tp{}-pp{}-dp{}".format(*layout))
def launch(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    tp, pp, dp = request.param
    root = tmp_path_factory.mktemp(f"tp{tp}-pp{pp}-dp{dp}")
    options = LAYOUTS[request.param]
    results = run_distributed(layout_run, tp * pp * dp, options, root, tp=tp, pp=pp, dp=dp, timeout_s=400)
    return {"layout": request.param, "options": options, "root": root, "ranks": results}


def _relative(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-12)


def test_losses_and_grad_norms_equal_one_process(launch: dict[str, Any], reference: dict[str, Any]) -> None:
    for rank, result in enumerate(launch["ranks"]):
        for step, (got, want) in enumerate(zip(result["first"]["losses"], reference["losses"], strict=True)):
            assert _relative(got, want) < FP32_TOL, (rank, step, got, want)
        for step, (got, want) in enumerate(zip(result["first"]["norms"], reference["norms"], strict=True)):
            assert _relative(got, want) < FP32_TOL, (rank, step, got, want)
    assert reference["losses"][-1] < reference["losses"][0] - 0.4  # it learned something: the test has teeth


def test_gathered_parameters_equal_one_process(launch: dict[str, Any], reference: dict[str, Any]) -> None:
    gathered = gather_full_state_dict(launch["root"] / "final")
    assert gathered.keys() == reference["state"].keys()
    for name, want in reference["state"].items():
        assert gathered[name].shape == want.shape, name
        assert float((gathered[name] - want).abs().max()) < FP32_TOL, name


def test_resume_at_the_same_layout_repeats_the_steps(launch: dict[str, Any]) -> None:
    for result in launch["ranks"]:
        assert result["resumed"]["losses"] == result["first"]["losses"][RESUME_AT:]
        assert result["resumed"]["norms"] == result["first"]["norms"][RESUME_AT:]


def test_evaluation_paths_equal_one_process(launch: dict[str, Any], reference: dict[str, Any]) -> None:
    from appliance.eval.scoring import ModelScorer

    model = BloomForCausalLM(CONFIG)
    missing, _ = model.load_state_dict(reference["state"], strict=False)
    assert missing == ["lm_head.weight"]
    probe = _probe_batches()
    scorer = ModelScorer(model, torch.device("cpu"))
    logprobs, greedy = scorer.target_logprobs(probe["ids"], probe["targets"])
    next_tokens = scorer.next_tokens(probe["prompts"] * probe["mask"], probe["mask"])
    with torch.no_grad():
        assert float((launch["ranks"][0]["whole_model_logits"] - model(probe["ids"])).abs().max()) < 1e-4
    for result in launch["ranks"]:  # every rank of every replica returns the replica's answer
        assert float((result["eval"]["logprobs"] - logprobs).abs().max()) < 1e-4
        assert torch.equal(result["eval"]["greedy"], greedy)
        assert torch.equal(result["eval"]["next"], next_tokens)
    dp = launch["layout"][2]
    batches = [b for rank in range(dp) for b in _eval_micro_batches(rank)]
    with torch.no_grad():
        want = sum(float(cross_entropy(model(x), y, reduction="sum")) for x, y in batches)
    tokens = sum(int((y != -100).sum()) for _, y in batches)
    loss_sum = sum(r["eval"]["sums"][0] for r in launch["ranks"])
    assert sum(r["eval"]["sums"][1] for r in launch["ranks"]) == tokens  # counted once per replica
    assert _relative(loss_sum, want) < FP32_TOL


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


def test_bf16_losses_track_fp32(launch: dict[str, Any], reference: dict[str, Any]) -> None:
    if not launch["options"]["bf16"]:
        pytest.skip("bf16 runs in (1,1,1), (2,2,1) and (2,2,2)")
    for result in launch["ranks"]:
        for step, (got, want) in enumerate(zip(result["bf16"]["losses"], reference["losses"], strict=True)):
            assert _relative(got, want) < BF16_TOL, (step, got, want)


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
