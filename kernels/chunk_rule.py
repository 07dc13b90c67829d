"""How many tokens one chunk of the chunked cross entropy takes (kernels/chunked_ce.py): the rule its callers
default to, and the one the planner prices the loss with (appliance/planner/kernel_path.py). Plain arithmetic, no
torch, so the planner imports it without loading torch."""

from __future__ import annotations

import math

# CPU: the smallest logits chunk worth a pass (16 MiB in fp32): below it each chunk's dozen small ops cost more than
# the memory saved. Measured on a 2-core CPU with bloom-tiny-cpu's head (1024 tokens, hidden 128, vocab 8192):
# Liger's rule alone gives 64 chunks of 16 tokens, 93-100 ms per forward and backward against 85-88 ms in 2 to 8
# chunks.
MIN_CHUNK_LOGITS = 1 << 22
# GPU: every chunk reads the [V_local, H] weight twice (the logits GEMM, the hidden-gradient GEMM) and rewrites its
# gradient, so chunks are as few as memory allows: the whole micro-batch when its logits fit this budget (bloom-560m
# at 2 x 2048 tokens: 4096 x 250,880 x 2 B = 2.06e9 B, one chunk), else the largest power of two of tokens that
# fits, and never fewer than GPU_MIN_CHUNK_TOKENS: a [1024, H] x [H, V] bf16 GEMM does 1024 FLOPs per byte of weight
# it reads, above an H100's ~300 FLOP/byte (989 TFLOP/s over 3.35 TB/s), so it stays compute-bound. 2 GiB is 2.5%
# of an 80 GB GPU, and the chunk replaces the chunk of 32 tokens that the CPU rule gives there.
GPU_CHUNK_LOGITS_BYTES = 2 << 30
GPU_MIN_CHUNK_TOKENS = 1024


def auto_chunk_size(tokens: int, hidden: int, vocab_local: int, *, gpu: bool = False, logit_bytes: int = 2) -> int:
    """Tokens per chunk of logits ([chunk, vocab_local], `logit_bytes` per logit), at most `tokens`.
    GPU: the whole micro-batch when its logits fit GPU_CHUNK_LOGITS_BYTES, else the largest power of two that fits
    but at least GPU_MIN_CHUNK_TOKENS. CPU: a chunk's logits hold about as many elements as the hidden states
    (Liger's rule), but at least MIN_CHUNK_LOGITS; a power of two."""
    tokens = max(1, tokens)
    if gpu:
        per_token = max(1, vocab_local * logit_bytes)
        if tokens * per_token <= GPU_CHUNK_LOGITS_BYTES:
            return tokens
        fitting = GPU_CHUNK_LOGITS_BYTES // per_token
        power = 1 << (fitting.bit_length() - 1) if fitting >= 1 else 1
        return min(tokens, max(GPU_MIN_CHUNK_TOKENS, power))
    growth = max(1, math.ceil(vocab_local / max(hidden, 1)))
    wanted = max(math.ceil(tokens / growth), math.ceil(MIN_CHUNK_LOGITS / max(vocab_local, 1)))
    chunk = 1 << max(0, math.ceil(math.log2(max(1, wanted))))
    return min(chunk, tokens)
