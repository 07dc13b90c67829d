"""Log-likelihoods and greedy continuations of token requests, spread over the data-parallel ranks.

The model is reached only through two functions, so any parallel layout can serve them without gathering the
model on one rank:

    target_logprobs(input_ids [B, S], targets [B, S]) -> (log p(targets) [B, S] float, targets == argmax [B, S] bool)
    next_tokens(input_ids [B, S], attention_mask [B, S]) -> argmax next token [B]      (left-padded rows)

`ModelScorer` provides both over a whole model held by this rank (one process, or data parallelism). A tensor-
or pipeline-parallel engine provides its own (parallel/step/scoring.py: the same chunked vocabulary-parallel pass, the
last stage broadcasting its result), and every rank of one data-parallel replica passes the same requests.

Requests are split across the ranks of `group` (the data-parallel group; None = the default group): rank r takes
requests r, r + size, ... Every rank is padded to the same number of requests (copies of a real one, whose
results are dropped), so every rank makes the same calls in the same order: the same number of forward passes,
the same per-step agreement while generating, one all_gather at the end. No rank waits in a collective that
another rank never reaches, whatever the number of requests.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from appliance.model import ops
from appliance.model.bloom import BloomForCausalLM
from appliance.parallel.tensor.mappings import collective_device

TargetLogprobs = Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
NextTokens = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


class ModelScorer:
    """target_logprobs and next_tokens over a model that returns logits [B, S, V] (transformers', say), or over our
    BloomForCausalLM, whose final hidden states go through the chunked scoring pass (ops.vocab_scores, the loss's
    own) so its [B, S, V] logits are never formed."""

    def __init__(self, model: nn.Module, device: torch.device | None = None) -> None:
        self.model = model
        self.device = device or next(model.parameters()).device

    def _run(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None) -> torch.Tensor:
        """Our model: its final hidden states [B, S, H]; another: its logits [B, S, V] in float32."""
        was_training = self.model.training
        self.model.eval()
        try:
            ids = input_ids.to(self.device)
            if isinstance(self.model, BloomForCausalLM):
                return self.model.final_hidden(ids, attention_mask)
            out = self.model(ids, attention_mask=attention_mask)
            logits = out.logits if hasattr(out, "logits") else out
            return logits.float()  # scores in float32 whatever the training precision
        finally:
            self.model.train(was_training)

    @torch.no_grad()
    def target_logprobs(self, input_ids: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        out = self._run(input_ids, None)
        targets = targets.to(out.device)
        if isinstance(self.model, BloomForCausalLM):
            logprobs, argmax = ops.vocab_scores(out, self.model.lm_head.weight, targets)
            assert logprobs is not None
        else:
            logprobs = F.log_softmax(out, dim=-1).gather(-1, targets[..., None]).squeeze(-1)
            argmax = out.argmax(dim=-1)
        return logprobs.cpu(), (argmax == targets).cpu()

    @torch.no_grad()
    def next_tokens(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        out = self._run(input_ids, attention_mask.to(self.device))
        if isinstance(self.model, BloomForCausalLM):
            return ops.vocab_scores(out[:, -1], self.model.lm_head.weight, None)[1].cpu()
        return out[:, -1, :].argmax(dim=-1).cpu()


# ---- splitting and gathering ---------------------------------------------------------------------------------
def group_rank_size(group: Any = None) -> tuple[int, int]:
    if not (dist.is_available() and dist.is_initialized()):
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


def even_shard(count: int, rank: int, size: int) -> tuple[list[int], int]:
    """Request indices rank, rank + size, ... padded with index 0 to ceil(count / size) entries, and how many
    of them are real. Every rank gets the same length, so every rank runs the same batches."""
    mine = list(range(rank, count, size))
    per_rank = -(-count // size)
    return mine + [0] * (per_rank - len(mine)), len(mine)


def gather_shards(local: torch.Tensor, count: int, group: Any = None) -> torch.Tensor:
    """Inverse of even_shard: each rank's [per_rank, ...] results -> all `count` results in request order.

    Request i sits on rank i % size in slot i // size, so stacking the ranks' tensors as [per_rank, size, ...]
    puts it at row-major position slot * size + rank = i.
    """
    _, size = group_rank_size(group)
    if size == 1:
        return local[:count]
    device = collective_device(group)
    parts = [torch.empty_like(local, device=device) for _ in range(size)]
    dist.all_gather(parts, local.to(device), group=group)
    stacked = torch.stack([p.cpu() for p in parts], dim=1)
    return stacked.reshape(-1, *local.shape[1:])[:count]


def all_ranks_agree(flag: bool, group: Any = None) -> bool:
    """True when flag is true on every rank of group (one all_reduce; every rank must call it)."""
    _, size = group_rank_size(group)
    if size == 1:
        return flag
    value = torch.tensor([1 if flag else 0], dtype=torch.int32, device=collective_device(group))
    dist.all_reduce(value, op=dist.ReduceOp.MIN, group=group)
    return bool(value.item())


# ---- log-likelihoods ---------------------------------------------------------------------------------------
def _window(context: Sequence[int], continuation: Sequence[int], max_length: int) -> tuple[list[int], list[int], int]:
    """(inputs, targets, scored) for one request, as lm-eval cuts it: the last max_length + 1 tokens of
    context + continuation, shifted by one; the last `scored` targets are the continuation's (all of it, unless
    it is longer than the window)."""
    if not context:
        raise ValueError("a request needs at least one context token (use the end-of-document token)")
    tokens = [*context, *continuation][-(max_length + 1) :]
    return tokens[:-1], tokens[1:], min(len(continuation), len(tokens) - 1)


def score_log_likelihoods(
    forward_fn: TargetLogprobs,
    requests: Sequence[tuple[Sequence[int], Sequence[int]]],
    *,
    max_length: int,
    batch_size: int = 16,
    pad_id: int = 0,
    group: Any = None,
) -> list[tuple[float, bool]]:
    """(log p(continuation | context), whether greedy decoding produces the continuation) per request.

    requests: (context ids, continuation ids). forward_fn: target_logprobs (module docstring). Rows are padded
    on the right, which a causal model never sees from earlier positions.
    """
    count = len(requests)
    if count == 0:
        return []
    rank, size = group_rank_size(group)
    indices, _ = even_shard(count, rank, size)
    rows = [_window(*requests[i], max_length) for i in indices]
    order = sorted(range(len(rows)), key=lambda j: -len(rows[j][0]))  # longest first: least padding per batch
    local = torch.zeros(len(rows), 2, dtype=torch.float64)
    for start in range(0, len(order), batch_size):
        chunk = order[start : start + batch_size]
        width = max(len(rows[j][0]) for j in chunk)
        input_ids = torch.full((len(chunk), width), pad_id, dtype=torch.int64)
        targets = torch.full((len(chunk), width), pad_id, dtype=torch.int64)
        for b, j in enumerate(chunk):
            inputs, labels, _ = rows[j]
            input_ids[b, : len(inputs)] = torch.tensor(inputs)
            targets[b, : len(labels)] = torch.tensor(labels)
        logprobs, greedy = forward_fn(input_ids, targets)
        for b, j in enumerate(chunk):
            end, scored = len(rows[j][0]), rows[j][2]
            local[j, 0] = logprobs[b, end - scored : end].double().sum()
            local[j, 1] = float(bool(greedy[b, end - scored : end].all()))
    results = gather_shards(local, count, group)
    return [(float(ll), bool(g)) for ll, g in results.tolist()]


# ---- greedy generation -------------------------------------------------------------------------------------
def generate_greedy(
    next_fn: NextTokens,
    prompts: Sequence[Sequence[int]],
    *,
    max_new_tokens: int,
    max_length: int,
    is_done: Callable[[list[int]], bool],
    batch_size: int = 16,
    pad_id: int = 0,
    group: Any = None,
) -> list[list[int]]:
    """Greedy continuation tokens per prompt, each stopped once is_done(tokens so far) is true.

    Prompts keep their last max_length - max_new_tokens tokens, so prompt and continuation fit the window. A batch
    stops early only when every rank's batch is done (one agreement per step), so ranks never fall out of step.
    """
    count = len(prompts)
    if count == 0:
        return []
    if max_new_tokens < 1 or max_new_tokens >= max_length:
        raise ValueError(f"max_new_tokens must be in [1, max_length={max_length}) (got {max_new_tokens})")
    rank, size = group_rank_size(group)
    indices, _ = even_shard(count, rank, size)
    keep = max_length - max_new_tokens
    rows = [list(prompts[i])[-keep:] for i in indices]
    if any(not row for row in rows):
        raise ValueError("every prompt needs at least one token")
    out = torch.full((len(rows), max_new_tokens), -1, dtype=torch.int64)
    order = sorted(range(len(rows)), key=lambda j: -len(rows[j]))
    for start in range(0, len(order), batch_size):
        chunk = order[start : start + batch_size]
        width = max(len(rows[j]) for j in chunk)
        input_ids = torch.full((len(chunk), width), pad_id, dtype=torch.int64)
        mask = torch.zeros((len(chunk), width), dtype=torch.int64)
        for b, j in enumerate(chunk):  # left padding: every row's last token sits in the last column
            input_ids[b, width - len(rows[j]) :] = torch.tensor(rows[j])
            mask[b, width - len(rows[j]) :] = 1
        new: list[list[int]] = [[] for _ in chunk]
        done = [False] * len(chunk)
        for _ in range(max_new_tokens):
            step = next_fn(input_ids, mask).to(torch.int64).cpu()
            input_ids = torch.cat([input_ids, step[:, None]], dim=1)
            mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
            for b in range(len(chunk)):
                if not done[b]:
                    new[b].append(int(step[b]))
                    done[b] = is_done(new[b])
            if all_ranks_agree(all(done), group):
                break
        for b, j in enumerate(chunk):
            out[j, : len(new[b])] = torch.tensor(new[b], dtype=torch.int64)
    results = gather_shards(out, count, group)
    return [[t for t in row if t >= 0] for row in results.tolist()]
