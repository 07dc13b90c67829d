"""Packed documents through the parallel engine: document ids ride along with each micro-batch (inputs, labels,
doc_ids) into every block of a tensor-parallel, sequence-parallel, fully recomputed BloomStack, and the engine's
loss, in evaluation and in a training step, is the single-process model's loss with the same document ids. Two gloo
ranks, one launch per layout: tp=2 with sequence parallelism (the plain engine), pp=2 (the pipeline engine), cp=2
(Ulysses and ring context parallelism).

Tolerance: the engine's fp32 loss against the single-process fp32 loss differs by summation order only (the
row-parallel all-reduce, the vocabulary-parallel cross-entropy); both are within fp32's rounding of the float64
run, so the bound is a multiple of that rounding, measured here (|fp32 - fp64| of the single-process loss, at least
1e-7 relative; measured on a 2-core AMD EPYC: the engine 0.08 floors from the model in evaluation, 0.3 in the
training step; bound 20). Without document ids the summed evaluation loss moves 13.9, about 8,800 bounds
(asserted: over 1,000, so the test has teeth).
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch

from appliance.data.documents import document_ids
from appliance.model.bloom import BloomForCausalLM
from appliance.model.config import BloomConfig
from appliance.parallel.testing import build_test_engine, run_distributed
from appliance.parallel.topology import ParallelTopology

pytestmark = pytest.mark.distributed

EOD = 2
# A wide init (std 0.2) so that attention patterns, and with them the document mask, move the loss visibly.
CONFIG = BloomConfig(vocab_size=256, hidden_size=32, n_layer=2, n_head=4, initializer_range=0.2)
SEQ, MBS, GBS, SEED = 32, 2, 4, 7


def packed_batch(seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """MBS rows of SEQ tokens, each several documents of different lengths ended by EOD."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(4, CONFIG.vocab_size, (MBS, SEQ + 1), generator=gen)
    for row, ends in enumerate(([4, 13, 15, 27], [9, 10, 22])):
        ids[row, ends] = EOD
    inputs, labels = ids[:, :-1].contiguous(), ids[:, 1:].contiguous()
    return inputs, labels, document_ids(inputs, EOD)


def engine_losses(launched: ParallelTopology, layout: tuple[int, int, int, str, bool]) -> dict[str, Any]:
    import torch.distributed as dist

    os.environ.setdefault("LOCAL_RANK", "0")
    tp, pp, cp, cp_mode, sequence_parallel = layout
    topology = ParallelTopology(tp=tp, pp=pp, dp=1, cp=cp, world_size=dist.get_world_size())
    engine = build_test_engine(
        CONFIG, topology, micro_batch_size=MBS, global_batch_size=GBS, recompute="full",
        sequence_parallel=sequence_parallel, seed=SEED, cp_mode=cp_mode,
    )  # fmt: skip
    batches = [packed_batch(1), packed_batch(2)]
    with_ids = engine.eval_sums(batches)
    without_ids = engine.eval_sums([b[:2] for b in batches])
    step = engine.train_batch(batches)  # the loss of the weights before the update
    return {"eval": with_ids, "eval_without": without_ids, "train": step.loss}


def reference_losses(dtype: torch.dtype) -> dict[str, float]:
    model = BloomForCausalLM(CONFIG, seed=SEED).to(dtype)
    batches = [packed_batch(1), packed_batch(2)]

    def mean_loss(inputs: torch.Tensor, labels: torch.Tensor, doc_ids: torch.Tensor | None) -> float:
        # The engine's labels are already the next tokens (trainer.to_batch); model.loss would shift them again.
        with torch.no_grad():
            logits = model(inputs, doc_ids=doc_ids).double()
        return float(torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten()))

    means = [mean_loss(i, y, d) for i, y, d in batches]
    means_without = [mean_loss(i, y, None) for i, y, _ in batches]
    tokens = [y.numel() for _, y, _ in batches]
    return {
        "eval": sum(m * t for m, t in zip(means, tokens, strict=True)),
        "eval_without": sum(m * t for m, t in zip(means_without, tokens, strict=True)),
        "train": sum(means) / len(means),
    }


# (tp, pp, cp, cp_mode, sequence parallel) on two ranks.
LAYOUTS = {
    "tp2-sp-BloomStack": (2, 1, 1, "ulysses", True),
    "pp2-pipeline": (1, 2, 1, "ulysses", False),
    "cp2-ulysses": (1, 1, 2, "ulysses", False),
    "cp2-ring": (1, 1, 2, "ring", False),
}


@pytest.mark.parametrize("name", LAYOUTS)
def test_document_ids_reach_every_block_of_the_parallel_engine(name: str) -> None:
    """tp=2: the plain engine's BloomStack, sequence-parallel; pp=2: DeepSpeed's pipeline engine, the ids sent
    from stage to stage with the hidden states; cp=2: each rank's slice of the ids, cut with its tokens, into the
    context-parallel core. All with every block recomputed (checkpointed with the ids)."""
    ranks = run_distributed(engine_losses, 2, LAYOUTS[name], dp=2)
    want, exact = reference_losses(torch.float32), reference_losses(torch.float64)
    bounds = {key: 20 * max(abs(want[key] - exact[key]), 1e-7 * abs(exact[key])) for key in want}
    # Evaluation sums are counted on the last stage's TP rank 0 of each CP slice (zeros elsewhere): their sum over
    # the ranks is the whole batch's. Every rank reports the step's loss.
    for key in ("eval", "eval_without"):
        got = sum(r[key][0] for r in ranks)
        assert sum(r[key][1] for r in ranks) == 2 * MBS * SEQ
        assert abs(got - want[key]) < bounds[key], f"{key}: engine {got} vs model {want[key]} ({bounds[key]:.2e})"
    for r in ranks:
        assert abs(r["train"] - want["train"]) < bounds["train"], f"train: engine {r['train']} vs {want['train']}"
    moved = abs(want["eval_without"] - want["eval"])
    assert moved > 1000 * bounds["eval"], f"the document mask moves the loss only {moved:.2e}"
