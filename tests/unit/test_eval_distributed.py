"""Evaluation over 2 gloo ranks with uneven shares cannot hang, and gives the single-process numbers (the
validation loss and bits per byte included).

Every forward pass below makes a collective call, as a ZeRO-3 or tensor-parallel forward does: a rank that ran
one forward fewer than the other would leave its peer waiting (run_distributed reports that as a timeout).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from appliance.eval.scoring import ModelScorer, even_shard, generate_greedy, score_log_likelihoods
from appliance.model.bloom import BloomForCausalLM
from appliance.model.config import BloomConfig
from appliance.model.ops import cross_entropy
from appliance.parallel.testing import run_distributed
from appliance.parallel.topology import ParallelTopology
from appliance.train.validation import Validation

pytestmark = pytest.mark.distributed

CONFIG = BloomConfig(vocab_size=64, hidden_size=32, n_layer=2, n_head=4)
REQUESTS = [([5 + i, 6 + i, 7], [8 + i] * (1 + i % 3)) for i in range(7)]  # 7 requests over 2 ranks
PROMPTS = [[10 + i, 11, 12 + i][: 1 + i % 3] for i in range(5)]


def model() -> BloomForCausalLM:
    return BloomForCausalLM(CONFIG, seed=0).eval()


class CollectiveScorer(ModelScorer):
    """A scorer whose every forward joins a collective, and which counts its forwards."""

    def __init__(self) -> None:
        super().__init__(model())
        self.forwards = 0

    def _collective(self) -> None:
        self.forwards += 1
        if dist.is_initialized():
            dist.all_reduce(torch.ones(1))

    def target_logprobs(self, input_ids: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        self._collective()
        return super().target_logprobs(input_ids, targets)

    def next_tokens(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        self._collective()
        return super().next_tokens(input_ids, attention_mask)


def stop_rule(tokens: list[int]) -> bool:
    return len(tokens) >= 1 + tokens[0] % 4  # rows stop after different numbers of steps


def score_on_rank(topology: ParallelTopology, requests: list, prompts: list) -> tuple[list, list, int]:
    scorer = CollectiveScorer()
    group = topology.dp_group
    scores = score_log_likelihoods(scorer.target_logprobs, requests, max_length=16, batch_size=2, group=group)
    generated = generate_greedy(
        scorer.next_tokens, prompts, max_new_tokens=5, max_length=16, is_done=stop_rule, batch_size=2, group=group
    )
    return scores, generated, scorer.forwards


def score_cases_on_rank(topology: ParallelTopology, cases: list) -> list[tuple[list, list, int]]:
    return [score_on_rank(topology, requests, prompts) for requests, prompts in cases]


def test_even_shard_pads_every_rank_to_the_same_length():
    assert even_shard(7, 0, 2) == ([0, 2, 4, 6], 4) and even_shard(7, 1, 2) == ([1, 3, 5, 0], 3)
    assert even_shard(1, 1, 4) == ([0], 0) and even_shard(0, 0, 2) == ([], 0)


def single_process_scores(requests: list) -> list:
    return score_log_likelihoods(CollectiveScorer().target_logprobs, requests, max_length=16, batch_size=2)


def test_uneven_shards_score_as_one_process_and_never_hang():
    # 7 requests and 5 prompts over 2 ranks (4 + 3 and 3 + 2), then 1 of each (rank 1 holds only padding).
    cases = [(REQUESTS, PROMPTS), (REQUESTS[:1], PROMPTS[:1])]
    results = run_distributed(score_cases_on_rank, 2, cases, dp=2, timeout_s=90)
    for case, (requests, prompts) in enumerate(cases):
        (scores0, tokens0, forwards0), (scores1, tokens1, forwards1) = results[0][case], results[1][case]
        expected_scores = single_process_scores(requests)
        assert forwards0 == forwards1  # the same number of collective forwards on both ranks
        assert scores0 == scores1 and tokens0 == tokens1  # every rank ends with every result
        assert [g for _, g in scores0] == [g for _, g in expected_scores]
        # A forward at another batch composition (other rows, other padding) runs other BLAS blocking: each logit
        # moves by a few ulps, a sum of up to 3 log-probabilities (about -4 each) by ~1e-7 of itself. 1e-5 relative
        # is a hundred times that, and far below what scoring a wrong row or position changes (over 1e-3).
        assert np.allclose([s for s, _ in scores0], [s for s, _ in expected_scores], rtol=1e-5, atol=0.0)
        assert_greedy(tokens0, prompts)
        assert all(1 <= len(t) <= 5 for t in tokens0)


# Greedy decoding may pick another token than one process only where two logits lie within the forward noise
# above. Measured on this model: logits of 0.5-0.9 move by at most 6e-8 when the row shares its batch with another;
# the top-2 gap at the prompts' first step is 0.16-0.59. TIE is over a thousand times the noise and far below
# those gaps, so a token from a wrong prompt or position fails while a true near tie passes.
TIE = 1e-4


def assert_greedy(generated: list[list[int]], prompts: list[list[int]]) -> None:
    """Every generated token is one process's argmax at its position, up to TIE: equality of the token lists
    would flip on a near tie, which depends on the CPU's summation order, not on the sharding."""
    net = model()
    for prompt, tokens in zip(prompts, generated, strict=True):
        sequence = list(prompt)
        for position, token in enumerate(tokens):
            with torch.no_grad():
                logits = net(torch.tensor([sequence]))[0, -1]
            gap = float(logits.max() - logits[token])
            assert gap <= TIE, f"prompt {prompt}, token {position}: {token} is {gap:.2e} below the argmax"
            sequence.append(token)


# ---- validation perplexity in the trainer -------------------------------------------------------------------
class CollectiveEngine:
    """The slice of ParallelEngine that Trainer.evaluate uses, with a collective in every forward."""

    def __init__(self, topology: ParallelTopology) -> None:
        self.topology = topology
        self.module = model()
        self.forwards = 0

    def eval_sums(self, micro_batches: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[float, float]:
        """(summed token loss, counted tokens), counted on a replica's TP rank 0 alone as ParallelEngine does (its
        other ranks see the same samples: here each runs the whole model)."""
        total, tokens = 0.0, 0.0
        for inputs, labels in micro_batches:
            self.forwards += 1
            dist.all_reduce(torch.ones(1))
            with torch.no_grad():
                logits = self.module(inputs)
            total += cross_entropy(logits, labels, reduction="sum").item()
            tokens += float((labels != -100).sum())
        return (total, tokens) if self.topology.tp_rank(dist.get_rank()) == 0 else (0.0, 0.0)


SEQ_LEN = 8
SAMPLES = {"en": 5, "fr": 3}  # 5 samples over 2 ranks: 3 and 2


def validation_data() -> dict[str, list[np.ndarray]]:
    rng = np.random.default_rng(0)
    return {lang: [rng.integers(4, 64, SEQ_LEN + 1) for _ in range(n)] for lang, n in SAMPLES.items()}


# Bytes per token id: 0 to 3 in turn, so the samples' byte counts differ from their token counts and ids of no
# bytes (as special tokens) occur too.
TOKEN_BYTES = np.arange(64, dtype=np.int64) % 4


def evaluate_on_rank(topology: ParallelTopology, root: str) -> tuple[Validation, int]:
    from pathlib import Path

    from appliance.rundir import RunDir
    from appliance.train.metrics import StepFlops
    from appliance.train.settings import TrainSettings
    from appliance.train.trainer import Trainer

    settings = TrainSettings(
        seq_len=SEQ_LEN, global_batch_size=2, micro_batch_size=1, train_samples=2, lr=1e-3, min_lr=1e-4,
        warmup_samples=0, decay_samples=2, weight_decay=0.0, grad_clip=1.0, adam_beta1=0.9, adam_beta2=0.95,
        adam_eps=1e-8, eval_interval=1, eval_samples=10, save_interval=1, dtype="fp32", seed=0,
    )  # fmt: skip
    engine = CollectiveEngine(topology)
    rank = dist.get_rank()
    trainer = Trainer(
        engine=engine, settings=settings, train_data=[], valid_data=validation_data(),
        micro_batches=lambda consumed: iter([]), run_dir=RunDir(Path(root) / f"rank{rank}").make(), rank=rank,
        dp_rank=topology.dp_rank(rank), dp_size=topology.dp, world_size=2, events=None,
        flops=StepFlops(model=1.0, hardware=1.0), peak_flops_per_device=None, layout={}, versions={},
        device=torch.device("cpu"), token_bytes=TOKEN_BYTES,
    )  # fmt: skip
    return trainer.evaluate(), engine.forwards


def single_process_sums() -> tuple[dict[str, float], dict[str, int], dict[str, int]]:
    """(loss in nats, tokens, bytes) per language, every sample in one forward."""
    net = model()
    loss_nats, tokens, text_bytes = {}, {}, {}
    with torch.no_grad():
        for lang, samples in validation_data().items():
            batch = torch.tensor(np.stack(samples))
            logits = net(batch[:, :-1])
            labels = batch[:, 1:].reshape(-1)
            loss_nats[lang] = F.cross_entropy(logits.reshape(-1, 64), labels, reduction="sum").item()
            tokens[lang] = labels.numel()
            text_bytes[lang] = int(TOKEN_BYTES[labels.numpy()].sum())
    return loss_nats, tokens, text_bytes


@pytest.mark.parametrize("layout", [{"dp": 2}, {"tp": 2}])
def test_validation_loss_and_bits_per_byte_as_one_process(tmp_path, layout):
    """dp=2: each rank sums its own samples' loss and bytes (3 and 2 of en's 5), and the one all-reduce makes them
    one process's figures. tp=2: both ranks see every sample, and each count is made on one of them only."""
    (valid0, forwards0), (valid1, forwards1) = run_distributed(
        evaluate_on_rank, 2, str(tmp_path), **layout, timeout_s=90
    )
    # ceil(5 / 2) + ceil(3 / 2) micro-batches of one sample per DP rank, or all 5 + 3 on the one DP rank
    assert forwards0 == forwards1 == (3 + 2 if layout.get("dp") == 2 else 5 + 3)
    assert valid0 == valid1
    loss_nats, tokens, text_bytes = single_process_sums()
    # One forward per sample against one per language batch: the same few-ulp noise as above, on a mean loss of ~4.
    for lang in SAMPLES:
        assert valid0.loss[lang] == pytest.approx(loss_nats[lang] / tokens[lang], rel=1e-5)
        assert valid0.bits_per_byte[lang] == pytest.approx(loss_nats[lang] / math.log(2) / text_bytes[lang], rel=1e-5)
    assert valid0.overall_loss == pytest.approx(sum(loss_nats.values()) / sum(tokens.values()), rel=1e-5)
    overall_bpb = sum(loss_nats.values()) / math.log(2) / sum(text_bytes.values())
    assert valid0.overall_bits_per_byte == pytest.approx(overall_bpb, rel=1e-5)
