"""One replica on one pipeline stage (dp x cp = 1, pp = 1) steps without DeepSpeed's engine
(parallel/step/single_replica.py, parallel/step/flat_optimizer.py): the same updates as DeepSpeed's bf16 optimizer and
fp32 path, no host read inside a step and one after it, an optimizer step whose work does not grow with the layers, and
checkpoints that move between the two engines.

Layouts: one rank, and tp = 2 with sequence parallelism (the gradient norm then sums over the model-parallel group and
counts the replicated LayerNorms once). Each is launched once; its ranks train the same steps through both engines.
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any

import pytest
import torch

from appliance.model.config import BloomConfig
from appliance.parallel.step.flat_optimizer import FlatAdamW
from appliance.parallel.step.host_reads import counting_host_reads
from appliance.parallel.testing import build_test_engine, run_distributed
from appliance.parallel.topology import ParallelTopology

pytestmark = pytest.mark.distributed

CONFIG = BloomConfig(vocab_size=256, hidden_size=64, n_layer=2, n_head=4)
MBS, MICRO_BATCHES, SEQ, STEPS = 2, 2, 16, 4
LAYOUTS = {"tp1": dict(world=1, tp=1, sp=False), "tp2-sp": dict(world=2, tp=2, sp=True)}


def _steps(count: int, seed: int) -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
    generator = torch.Generator().manual_seed(seed)
    steps = []
    for _ in range(count):
        shape = (MBS, SEQ + 1)
        tokens = [torch.randint(0, CONFIG.vocab_size, shape, generator=generator) for _ in range(MICRO_BATCHES)]
        steps.append([(t[:, :-1].contiguous(), t[:, 1:].contiguous()) for t in tokens])
    return steps


def _engine(topology: ParallelTopology, dtype: str, step_engine: str, sp: bool) -> Any:
    return build_test_engine(
        CONFIG, topology, micro_batch_size=MBS, global_batch_size=MBS * MICRO_BATCHES, dtype=dtype,
        sequence_parallel=sp, weight_decay=0.1, step_engine=step_engine,
    )  # fmt: skip


def _weights(engine: Any) -> dict[str, torch.Tensor]:
    return {name: p.detach().float().clone() for name, p in engine.named_parameters()}


def _rank(topology: ParallelTopology, sp: bool, root: str) -> dict[str, Any]:
    os.environ.setdefault("LOCAL_RANK", "0")  # read by DeepSpeed's engine
    out: dict[str, Any] = {}
    steps = _steps(STEPS + 2, seed=7)
    for dtype in ("fp32", "bf16"):
        runs = {}
        for step_engine in ("auto", "deepspeed"):
            engine = _engine(topology, dtype, step_engine, sp)
            results = [engine.train_batch(micro) for micro in steps[:STEPS]]
            runs[step_engine] = {
                "class": type(engine.engine.optimizer).__name__,
                "losses": [r.loss for r in results],
                "norms": [r.grad_norm for r in results],
                "weights": _weights(engine),
                "state": engine.optimizer_state(),
            }
            if step_engine == "auto":
                step_dir = Path(root) / dtype
                step_dir.mkdir(parents=True, exist_ok=True)
                engine.save_model(step_dir, {"step": str(STEPS)})
                torch.save(engine.optimizer_state(), step_dir / f"optim{engine.rank}.pt")
                runs["auto"]["continued"] = [engine.train_batch(m).loss for m in steps[STEPS:]]
            else:
                # The flat engine's checkpoint, loaded into DeepSpeed's, continues as the flat engine did.
                engine.load_model(Path(root) / dtype)
                state = torch.load(Path(root) / dtype / f"optim{engine.rank}.pt", weights_only=True)
                engine.load_optimizer_state(state)
                runs["deepspeed"]["continued"] = [engine.train_batch(m).loss for m in steps[STEPS:]]
        out[dtype] = runs
    # Host reads: none while a step is issued, one (the figures) when it is read; three steps, late reads.
    engine = _engine(topology, "bf16", "auto", sp)
    engine.train_batch(steps[0])  # warm-up: first-call work (allocations) is not what a step costs
    with counting_host_reads() as issuing:
        pending = [engine.train_batch_async(micro) for micro in steps[1:4]]
    with counting_host_reads() as reading:
        figures = [p.result() for p in pending]
    out["reads"] = {"issuing": dict(issuing.counts), "reading": dict(reading.counts), "finite": all(
        math.isfinite(f.loss) and math.isfinite(f.grad_norm) for f in figures)}  # fmt: skip
    # A NaN loss skips the update on the device: weights, masters, moments and the step count unchanged.
    before = _weights(engine), engine.optimizer_state()
    engine.loss_fn.inject_nan = True
    try:
        skipped = engine.train_batch(steps[4])
    finally:
        engine.loss_fn.inject_nan = False
    after = _weights(engine), engine.optimizer_state()
    out["nan"] = {
        "loss": skipped.loss,
        "norm": skipped.grad_norm,
        "unchanged": all(torch.equal(before[0][k], after[0][k]) for k in before[0])
        and all(torch.equal(before[1][k], after[1][k]) for k in before[1]),
        "next": engine.train_batch(steps[5]).loss,
    }
    return out


@pytest.fixture(scope="module", params=list(LAYOUTS))
def launch(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    layout = LAYOUTS[request.param]
    root = tmp_path_factory.mktemp(request.param)
    ranks = run_distributed(_rank, layout["world"], layout["sp"], str(root), tp=layout["tp"], timeout_s=600)
    return {"layout": request.param, "ranks": ranks}


def test_the_single_replica_engine_runs_the_flat_optimizer(launch: dict[str, Any]) -> None:
    for result in launch["ranks"]:
        assert result["fp32"]["auto"]["class"] == result["bf16"]["auto"]["class"] == "FlatAdamW"
        assert result["bf16"]["deepspeed"]["class"] == "BF16_Optimizer"


def test_fp32_steps_equal_deepspeeds(launch: dict[str, Any]) -> None:
    """fp32: the same arithmetic but for the clipping (the fused kernel divides by 1 / factor where DeepSpeed
    multiplies by the factor) and the order the squares of the norm are summed in: measured 1.2e-7 on the weights
    and equal losses to 1e-6 after four steps at tp1; the bounds leave two orders for other CPUs."""
    for result in launch["ranks"]:
        flat, deep = result["fp32"]["auto"], result["fp32"]["deepspeed"]
        torch.testing.assert_close(flat["losses"], deep["losses"], rtol=0, atol=1e-5)
        torch.testing.assert_close(flat["norms"], deep["norms"], rtol=1e-5, atol=0)
        for name in flat["weights"]:
            torch.testing.assert_close(flat["weights"][name], deep["weights"][name], rtol=0, atol=1e-5, msg=name)
        assert flat["state"].keys() == deep["state"].keys()


def test_bf16_steps_track_deepspeeds(launch: dict[str, Any]) -> None:
    """bf16: the fp32 masters differ by the fp32 rounding above, and where one lands on the other side of a bf16
    rounding boundary the forward passes differ from then on, so the two runs separate at bf16's noise level.
    Measured at tp1 after four steps (lr 1e-3): losses 2.3e-5 apart, norms 1.2e-5 relative, weights and masters
    at most 4.9e-4 (one bf16 step of a weight near 0.1; near zero, a sign's worth of an Adam step). Bounds: ten
    times the losses' and norms', and one Adam step (lr) on weights and masters, which an update of the wrong size
    (a lost clip, a doubled step) exceeds within the four steps."""
    for result in launch["ranks"]:
        flat, deep = result["bf16"]["auto"], result["bf16"]["deepspeed"]
        torch.testing.assert_close(flat["losses"], deep["losses"], rtol=0, atol=2e-4)
        torch.testing.assert_close(flat["norms"], deep["norms"], rtol=1e-4, atol=0)
        for name in flat["weights"]:
            torch.testing.assert_close(flat["weights"][name], deep["weights"][name], rtol=0, atol=1e-3, msg=name)
        assert flat["state"].keys() == deep["state"].keys()
        for key in flat["state"]:
            if key.endswith(".master"):
                torch.testing.assert_close(flat["state"][key], deep["state"][key], rtol=0, atol=1e-3, msg=key)


def test_a_checkpoint_of_the_flat_engine_continues_in_deepspeeds(launch: dict[str, Any]) -> None:
    """Model and optimizer state (moments, masters, step) saved by the flat engine load into DeepSpeed's, which then
    takes the next two steps as the flat engine took them (within the two engines' fp32 rounding above)."""
    for result in launch["ranks"]:
        for dtype, atol in (("fp32", 1e-5), ("bf16", 1e-4)):
            runs = result[dtype]
            torch.testing.assert_close(runs["auto"]["continued"], runs["deepspeed"]["continued"], rtol=0, atol=atol)


def test_a_step_reads_nothing_on_the_host_until_its_figures_are_asked_for(launch: dict[str, Any]) -> None:
    """No scalar read, nonzero or device-to-host copy while three steps are issued; reading their figures takes one
    read per step (the [loss, grad norm] tensor)."""
    for result in launch["ranks"]:
        reads = result["reads"]
        assert reads["issuing"] == {}, reads["issuing"]
        assert reads["reading"] == {"tolist": 3} and reads["finite"]


def test_a_non_finite_loss_skips_the_update_on_the_device(launch: dict[str, Any]) -> None:
    for result in launch["ranks"]:
        nan = result["nan"]
        assert math.isnan(nan["loss"]) and not math.isfinite(nan["norm"])
        assert nan["unchanged"] and math.isfinite(nan["next"])


# ---- the optimizer alone, in this process ---------------------------------------------------------------------
def _count_ops(fn: Any) -> int:
    """The ops `fn` dispatches that do work (views only relabel memory)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        ops = 0

        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            Count.ops += 0 if func.is_view else 1
            return func(*args, **(kwargs or {}))

    with Count():
        fn()
    return Count.ops


def _model_optimizer(layers: int, dtype: torch.dtype) -> tuple[torch.nn.Module, FlatAdamW]:
    from appliance.model.bloom import BloomForCausalLM

    model = BloomForCausalLM(BloomConfig(vocab_size=256, hidden_size=64, n_layer=layers, n_head=4)).to(dtype)
    named = [(n, p) for n, p in model.named_parameters()]
    optimizer = FlatAdamW(named, lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, max_grad_norm=1.0)
    return model, optimizer


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_optimizer_work_does_not_grow_with_layers(dtype: torch.dtype) -> None:
    """The ops of a fold (a micro-batch before the step's last) and of a step (reading the last micro-batch's
    gradients in place), after a first step made the buffers, are the same at 2 and 8 layers (DeepSpeed's bf16
    optimizer runs a few per parameter: 16 parameters per block). Here the torch twins, the CPU's path; the GPU's
    issues three launches a step whatever the depth (test_capturable_step.py)."""
    counts = {}
    for layers in (2, 8):
        model, optimizer = _model_optimizer(layers, dtype)
        ids = torch.randint(0, 256, (2, 9))
        for _ in range(2):  # a first step makes the buffers (views per parameter, once), a second is counted
            model.loss(ids, ids).backward()
            fold = _count_ops(optimizer.fold_micro_batch)
            model.loss(ids, ids).backward()
            step = _count_ops(optimizer.step)
        counts[layers] = (fold, step)
    assert counts[2] == counts[8], counts
    # A fixed handful: the gradients gathered, the norm by blocks, the verdicts, two fused updates, the cast.
    assert sum(counts[8]) < 40, counts


def test_flat_adamw_is_torch_adamw_with_deepspeeds_clipping() -> None:
    """fp32 weights: three steps of FlatAdamW, reading the gradients where they were left, equal torch's fused AdamW
    after clipping by min(1, 1 / (norm + 1e-6)) (the same kernel and the same multiplier, computed here from the
    float norm and there in fp32 on the device: one rounding)."""
    model, optimizer = _model_optimizer(2, torch.float32)
    twin = {n: p.detach().clone().requires_grad_() for n, p in model.named_parameters()}
    decay = [p for n, p in twin.items() if p.ndim >= 2]
    no_decay = [p for n, p in twin.items() if p.ndim < 2]
    reference = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                                  lr=1e-3, betas=(0.9, 0.95), eps=1e-8, fused=True)  # fmt: skip
    generator = torch.Generator().manual_seed(3)
    for _ in range(3):
        grads = {n: torch.randn(p.shape, generator=generator) for n, p in model.named_parameters()}
        for n, p in model.named_parameters():
            p.grad = grads[n].clone()
            twin[n].grad = grads[n].clone()
        norm = torch.linalg.vector_norm(torch.cat([g.reshape(-1) for g in grads.values()]))
        factor = 1.0 / (float(norm) + 1e-6)
        for p in twin.values():
            p.grad.mul_(min(factor, 1.0))
        reference.step()
        got_norm, skipped = optimizer.step()
        assert float(skipped) == 0.0
        torch.testing.assert_close(got_norm, norm, rtol=1e-6, atol=0)
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.detach(), twin[n].detach(), rtol=0, atol=1e-6, msg=n)
    assert float(optimizer.step_count) == 3.0


def test_gradients_reach_the_flat_buffer_without_a_kernel_per_parameter() -> None:
    """The backward leaves each parameter a fresh gradient (autograd keeps the tensor it made: no kernel), and a
    micro-batch before the step's last is folded into the fp32 sum by one multi-tensor copy (one kernel reading them
    in place on a GPU; the step's last micro-batch is read by the step itself). A gradient defined beforehand would be
    added into in place, one `add_` per parameter (measured on an H200 at bloom-560m: 294 of a step's 1381
    launches)."""
    from collections import Counter

    from torch.utils._python_dispatch import TorchDispatchMode

    class Writes(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.found: Counter[str] = Counter()

        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            if func._schema.name.endswith(("add_", "copy_")):
                self.found[func._schema.name] += 1
            return func(*args, **(kwargs or {}))

    counts = {}
    for layers in (2, 8):
        model, optimizer = _model_optimizer(layers, torch.bfloat16)
        ids = torch.randint(0, 256, (2, 9))
        loss = model.loss(ids, ids)
        with Writes() as writes:
            loss.backward()
            optimizer.fold_micro_batch()
        counts[layers] = dict(writes.found)
        assert all(p.grad is None for p in model.parameters())  # released: the flat buffers hold them
    assert counts[2] == counts[8] == {"aten::_foreach_copy_": 1}, counts
