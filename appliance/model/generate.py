"""Greedy decoding for small models: recompute the whole sequence for every new token (no KV cache).

At the sizes this runs on (evaluation samples, tests) the recomputation costs little and keeps one code path:
the same forward that training and evaluation use.
"""

from __future__ import annotations

from pathlib import Path

import torch
from tokenizers import Tokenizer
from torch import nn

from appliance.errors import BadInput


@torch.no_grad()
def greedy_generate(
    model: nn.Module,
    input_ids: torch.Tensor,
    max_new_tokens: int,
    eos_token_id: int | None = None,
    attention_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Append up to max_new_tokens argmax tokens to input_ids [B, S]; returns [B, S + n], n <= max_new_tokens.

    model(input_ids, attention_mask) must return logits [B, S, vocab]. For a left-padded batch pass its
    attention_mask [B, S]; new tokens count as real tokens. A row that has produced eos_token_id keeps
    receiving eos_token_id; generation stops early once every row has.
    """
    if input_ids.dim() != 2 or input_ids.shape[1] == 0:
        raise ValueError(f"input_ids must be [batch, seq] with seq >= 1 (got shape {tuple(input_ids.shape)})")
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be >= 0 (got {max_new_tokens})")
    was_training = model.training
    model.eval()
    try:
        tokens = input_ids
        mask = attention_mask
        finished = torch.zeros(tokens.shape[0], dtype=torch.bool, device=tokens.device)
        for _ in range(max_new_tokens):
            logits = model(tokens, mask)
            next_token = logits[:, -1, :].argmax(dim=-1)
            if eos_token_id is not None:
                next_token = torch.where(finished, torch.full_like(next_token, eos_token_id), next_token)
                finished |= next_token == eos_token_id
            tokens = torch.cat([tokens, next_token[:, None]], dim=1)
            if mask is not None:
                mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
            if eos_token_id is not None and bool(finished.all()):
                break
        return tokens
    finally:
        model.train(was_training)


def sample_text(model: nn.Module, tokenizer_json_path: Path, prompt: str, max_new_tokens: int) -> str:
    """The greedy continuation of prompt (without the prompt), decoded with the tokenizer at tokenizer_json_path.

    Stops at the tokenizer's </s> when it has one.
    """
    path = Path(tokenizer_json_path)
    try:
        tokenizer = Tokenizer.from_file(str(path))
    except Exception as exc:  # tokenizers raises a bare Exception for unreadable or malformed files
        raise BadInput(f"{path}: not a readable tokenizer.json ({exc})") from exc
    prompt_ids = tokenizer.encode(prompt).ids
    if not prompt_ids:
        raise BadInput(f"prompt {prompt!r} encodes to no tokens with {path}")
    vocab_size = getattr(getattr(model, "config", None), "vocab_size", None)
    if vocab_size is not None and max(prompt_ids) >= vocab_size:
        raise BadInput(f"{path}: token id {max(prompt_ids)} is outside the model's vocabulary of {vocab_size}")
    device = next(model.parameters()).device
    input_ids = torch.tensor([prompt_ids], dtype=torch.int64, device=device)
    output = greedy_generate(model, input_ids, max_new_tokens, eos_token_id=tokenizer.token_to_id("</s>"))
    new_ids = output[0, len(prompt_ids) :].tolist()
    return tokenizer.decode(new_ids, skip_special_tokens=True)
