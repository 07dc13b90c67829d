"""The trainer's model runs every fused kernel: built by build_engine (the path `train` takes), trained on gloo ranks
with BLOOM_KERNELS=triton (Triton's CPU interpreter), it calls LayerNorm, bias+GeLU, flash ALiBi attention and the
chunked vocabulary-parallel cross-entropy on the Triton backend, with tensor parallelism, with and without sequence
parallelism, and through a pipeline; and it trains and evaluates like the BLOOM_KERNELS=reference run.

One launch per layout; each rank runs the same steps three times: reference backend, Triton backend, and the
reference again as the noise floor: with one-sample micro-batches (noise_floor.py's "split" reordering: the sums
over samples taken outside the matmuls) and every initial weight rounded differently (multiplied by 1 + u * 2^-24,
u uniform in [-1, 1]: the forward pass has no sum over samples to reorder, and Adam's first step is a sign step
that rounding differences of the gradients do not reach). So the floor is how far fp32 rounding alone moves the
losses, gradients and evaluations here.
"""

from __future__ import annotations

import os
import zlib
from typing import Any

import pytest
import torch
from noise_floor import NoiseFloor, check_floor, relative, relative_norm

from appliance.model.config import BloomConfig
from appliance.parallel.testing import build_test_engine, run_distributed
from appliance.parallel.topology import ParallelTopology

pytestmark = pytest.mark.distributed

CONFIG = BloomConfig(vocab_size=256, hidden_size=64, n_layer=2, n_head=4)  # head dim 16; 128 vocab rows per TP rank
SEQ, STEPS, BATCH = 16, 2, 4
FUSED_OPS = ("layer_norm", "bias_gelu", "flash_alibi_attention", "vocab_cross_entropy")
# The Triton kernels and their torch twins do the same fp32 arithmetic in another order (blocked reductions, an
# online softmax), as the floor run does; measured at 0-1.4 x that floor over the layouts below, so 10 x leaves
# room for other CPUs.
FACTOR = 10.0

# (tp, pp, sequence parallel, recompute)
LAYOUTS = [(2, 1, True, "selective"), (2, 2, False, "full")]


def _tokens() -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    start, stride = (
        torch.randint(0, 200, (STEPS * BATCH, 1), generator=g),
        torch.randint(1, 7, (STEPS * BATCH, 1), generator=g),
    )
    return (start + stride * torch.arange(SEQ + 1)) % 200


def _round_differently(engine: Any) -> None:
    # Seeded by name, so TP-replicated parameters (and the two stages' copies of the tied embedding) stay equal.
    with torch.no_grad():
        for name, param in engine.named_parameters():
            g = torch.Generator().manual_seed(zlib.crc32(name.encode()))
            param.mul_(1 + torch.rand(param.shape, generator=g).sub_(0.5).mul_(2 * 2**-24))


def _run(
    topology: ParallelTopology, backend: str, micro_batch: int, options: dict[str, Any], floor: bool = False
) -> dict[str, Any]:
    """Train STEPS steps under `backend`; the loss per step, each parameter's gradient of the first step (summed
    over its micro-batches as it reaches the parameter: after the sequence-parallel all-reduce, before DeepSpeed's
    own reductions), the evaluation sums and log-probabilities, and which kernels ran."""
    from kernels import op_backends

    os.environ["BLOOM_KERNELS"] = backend
    engine = build_test_engine(
        CONFIG, topology, micro_batch_size=micro_batch, global_batch_size=BATCH, recompute=options["recompute"],
        sequence_parallel=options["sp"], lr=1e-2, weight_decay=0.1, seed=7,
    )  # fmt: skip
    if floor:
        _round_differently(engine)
    grads: dict[str, torch.Tensor] = {}
    recording = [True]

    def keep(name: str) -> Any:
        def hook(grad: torch.Tensor) -> None:
            if recording[0]:
                grads[name] = grads[name] + grad if name in grads else grad.detach().clone()

        return hook

    for name, param in engine.named_parameters():
        param.register_hook(keep(name))
    op_backends.reset_call_counts()
    tokens, losses = _tokens(), []
    for step in range(STEPS):
        rows = range(step * BATCH, (step + 1) * BATCH)
        micro = [(tokens[i : i + micro_batch, :-1], tokens[i : i + micro_batch, 1:]) for i in rows[::micro_batch]]
        losses.append(engine.train_batch(micro).loss)
        recording[0] = False
    # Four samples in micro-batches of the engine's size; the last one's labels ignored (a padded row): the sum
    # counts only real tokens.
    eval_batches = [
        (tokens[i : i + micro_batch, :-1], tokens[i : i + micro_batch, 1:].clone()) for i in range(0, 4, micro_batch)
    ]
    eval_batches[-1][1][-1] = -100
    eval_sum, eval_tokens = engine.eval_sums(eval_batches)
    logprobs, greedy = engine.task_model().target_logprobs(tokens[:3, :11], tokens[:3, 1:12])
    return {
        "losses": losses,
        "grads": grads,
        "eval_sum": eval_sum,
        "eval_tokens": eval_tokens,
        "logprobs": logprobs,
        "greedy": greedy,
        "calls": op_backends.call_counts(),
        "last_stage": engine.is_last_stage,
    }


def layout_run(topology: ParallelTopology, options: dict[str, Any]) -> dict[str, Any]:
    os.environ.setdefault("LOCAL_RANK", "0")  # read by DeepSpeed's PipelineModule
    return {
        "reference": _run(topology, "reference", 2, options),
        "triton": _run(topology, "triton", 2, options),
        "floor": _run(topology, "reference", 1, options, floor=True),
    }


@pytest.fixture(
    scope="module", params=LAYOUTS, ids=lambda p: "tp{}-pp{}-{}-{}".format(p[0], p[1], "sp" if p[2] else "nosp", p[3])
)
def launch(request: pytest.FixtureRequest) -> list[dict[str, Any]]:
    tp, pp, sp, recompute = request.param
    # Read when triton is first imported in a rank, so it must be in the environment the ranks are spawned with.
    with pytest.MonkeyPatch.context() as env:
        env.setenv("TRITON_INTERPRET", "1")
        return run_distributed(layout_run, tp * pp, {"sp": sp, "recompute": recompute}, tp=tp, pp=pp, timeout_s=400)


def _differences(got: dict[str, Any], want: dict[str, Any]) -> dict[str, float]:
    out = {"losses": max(relative(g, w) for g, w in zip(got["losses"], want["losses"], strict=True))}
    assert got["grads"].keys() == want["grads"].keys()
    out["grads"] = max(relative_norm(got["grads"][n], w) for n, w in want["grads"].items())
    if want["eval_tokens"]:  # counted on one rank per replica
        out["eval_sum"] = relative(got["eval_sum"], want["eval_sum"])
    out["logprobs"] = relative_norm(got["logprobs"], want["logprobs"])
    return out


def test_every_fused_op_runs_on_triton_in_the_trainers_model(launch: list[dict[str, Any]]) -> None:
    """Pass: under BLOOM_KERNELS=triton each fused op ran on the Triton backend (the loss on the last stage), none
    fell back to its torch twin; under reference, nothing ran on Triton."""
    ran: set[str] = set()
    for rank, result in enumerate(launch):
        triton_calls = result["triton"]["calls"]
        fallbacks = {op: n for (op, backend), n in triton_calls.items() if backend != "triton"}
        assert not fallbacks, f"rank {rank}: fell back under BLOOM_KERNELS=triton: {fallbacks}"
        ran |= {op for op, _ in triton_calls}
        if result["triton"]["last_stage"]:
            assert triton_calls[("vocab_cross_entropy", "triton")] > 0, rank
            assert triton_calls[("vocab_scores", "triton")] > 0, rank
        assert all(backend == "reference" for _, backend in result["reference"]["calls"]), rank
    assert set(FUSED_OPS) <= ran, sorted(ran)


def test_triton_training_and_evaluation_equal_the_reference(launch: list[dict[str, Any]]) -> None:
    for rank, result in enumerate(launch):
        floor = _differences(result["floor"], result["reference"])
        # One fp32 loss (or sum of losses) resolves 2^-23 of itself, its last bit, which is coarser than the
        # weights' rounding moves it: such a number cannot be compared closer than that.
        for scalar in ("losses", "eval_sum"):
            if scalar in floor:
                floor[scalar] = max(floor[scalar], 2.0**-23)
        # Evaluation runs after the two steps, so the floor run's weights, and its evaluation, carry the floor too.
        check_floor(NoiseFloor(floor, dict.fromkeys(floor, "one-sample micro-batches")), list(floor))
        for key, value in _differences(result["triton"], result["reference"]).items():
            assert value <= FACTOR * floor[key], f"rank {rank} {key}: {value:.3e} > {FACTOR:g} x floor {floor[key]:.3e}"
        assert torch.equal(result["triton"]["greedy"], result["reference"]["greedy"]), rank
