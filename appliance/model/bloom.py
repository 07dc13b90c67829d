"""BLOOM as published (BigScience 2022), as a plain nn.Module.

word embeddings -> embedding LayerNorm -> n_layer pre-LN blocks (ALiBi attention, GeLU MLP) -> final LayerNorm
-> logits through the word-embedding matrix (tied head). Parameter names are those of transformers'
BloomForCausalLM, so a state_dict moves between the two unchanged.

The model is built from three kinds of pieces, BloomEmbedding, BloomBlock and BloomFinal, that also stand alone:
the parallel layer turns them into pipeline stages. Linear layers come from a factory (model/linear.py), so
tensor-parallel linears can be put in place of nn.Linear without changing this file; the MLP, which an MoE expert
reuses, is model/mlp.py. A factory module may set `skip_bias_add = True` (the Megatron convention): its forward
then returns x @ W^T only, and the model adds `module.bias` inside the next fused op (bias+GeLU,
bias+dropout+residual).

In a BLOOM-MoE model (config.moe_num_experts > 0) every moe_every-th block's MLP is a mixture of experts
(model/moe.py); ``loss`` adds their load-balancing loss.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from appliance.model import ops
from appliance.model.alibi import RankAlibi
from appliance.model.config import BloomConfig
from appliance.model.initial_weights import Seed, empty_module, init_parameter_
from appliance.model.linear import LinearFactory, default_linear_factory, project
from appliance.model.mlp import BloomMLP


def _norm(norm: nn.LayerNorm, x: torch.Tensor) -> torch.Tensor:
    if (
        type(norm) is not nn.LayerNorm
    ):  # a parallel LayerNorm (parallel/tensor2d/layers2d.py) reduces its own statistics
        return norm(x)
    return ops.layer_norm(x, norm.weight, norm.bias, norm.eps)


class BloomAttention(nn.Module):
    """Self-attention with a fused QKV projection laid out per head as [q, k, v] (so a split of the output rows
    at head boundaries gives each tensor-parallel rank whole heads)."""

    def __init__(self, config: BloomConfig, linear_factory: LinearFactory, tp_size: int = 1) -> None:
        super().__init__()
        if config.n_head % tp_size != 0:
            raise ValueError(f"n_head({config.n_head}) % tp_size({tp_size}) = {config.n_head % tp_size}, must be 0")
        self.local_heads = config.n_head // tp_size
        self.head_dim = config.head_dim
        self.inv_norm_factor = 1.0 / math.sqrt(self.head_dim)
        self.attention_dropout = config.attention_dropout
        # Selective recompute (Korthikanti et al. 2022): keep only the core's inputs and recompute the scores
        # and softmax, the largest activations, in the backward pass. The parallel layer switches it on.
        self.recompute_core = False
        # Context parallelism: a core over a sequence split across ranks, (q, k, v, slopes, scale) -> context, in
        # place of the local one; the parallel layer sets it (parallel/parallelize.py).
        self.context_parallel: Callable[..., torch.Tensor] | None = None
        h = config.hidden_size
        self.query_key_value = linear_factory(h, 3 * h, True, "qkv")
        self.dense = linear_factory(h, h, True, "attn_out")

    def forward(
        self,
        x: torch.Tensor,
        alibi: RankAlibi,
        attention_mask: torch.Tensor | None = None,
        doc_ids: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Without padding (attention_mask None) the causal mask, and the document mask where doc_ids (int [B, S]
        over the whole sequence) are given, is all there is, so the fused flash-attention kernel takes the slopes
        alone, without [S, S] scores; only the materialized path asks `alibi` for the bias and mask."""
        fused, qkv_bias = project(self.query_key_value, x)
        if qkv_bias is not None:
            fused = fused + qkv_bias
        # Sizes from the projection, not from x: with sequence parallelism x is this rank's chunk of the
        # sequence and the column-parallel projection has gathered the whole sequence.
        batch, seq = fused.shape[:2]
        # [B, S, H*3*D] -> [B, S, H, 3, D]: per head, the rows are q then k then v.
        fused = fused.view(batch, seq, self.local_heads, 3, self.head_dim)
        q, k, v = (fused[..., i, :].transpose(1, 2) for i in range(3))  # each [B, H, S, D]
        no_dropout = not (self.training and self.attention_dropout > 0)
        if self.context_parallel is not None:
            if attention_mask is not None or not no_dropout:
                raise ValueError("context-parallel attention takes neither a padding mask nor attention dropout")
            # doc_ids here are this CP rank's slice of the sequence's document ids, like x.
            core = (q, k, v, alibi.slopes(q.device), self.inv_norm_factor, doc_ids)
            if self.recompute_core and torch.is_grad_enabled():
                context = checkpoint(self.context_parallel, *core, use_reentrant=False)
            else:
                context = self.context_parallel(*core)
        elif attention_mask is None and no_dropout and ops.flash_attention_available(q):
            # No [S, S] activations to keep, so selective recompute has nothing to save here. Packed documents
            # (doc_ids) are masked inside the kernel: the slopes still suffice (alibi.RankAlibi.bias_and_mask).
            context = ops.flash_attention(q, k, v, alibi.slopes(q.device), self.inv_norm_factor, doc_ids=doc_ids)
        elif attention_mask is None and no_dropout and ops.blocked_attention_pays(q):
            # Long sequences without the kernel: blocks of queries, never [S, S] at once (ops.BLOCK_SCORES_PER_HEAD).
            context = ops.blocked_attention(q, k, v, alibi.slopes(q.device), self.inv_norm_factor, doc_ids=doc_ids)
        else:
            bias, mask = alibi.bias_and_mask(attention_mask, seq, q.device, doc_ids)
            core_args = (q, k, v, bias, mask, self.inv_norm_factor, self.attention_dropout, self.training)
            if self.recompute_core and torch.is_grad_enabled():
                context = checkpoint(ops.attention_core, *core_args, use_reentrant=False)
            else:
                context = ops.attention_core(*core_args)
        context = context.transpose(1, 2).reshape(batch, seq, self.local_heads * self.head_dim)
        return project(self.dense, context)


class BloomEmbedding(nn.Module):
    """Token ids [B, S] -> hidden states [B, S, hidden]: word embeddings then BLOOM's embedding LayerNorm."""

    def __init__(self, config: BloomConfig) -> None:
        super().__init__()
        self.config = config
        self.word_embeddings = nn.Embedding(config.vocab_size, config.hidden_size)
        self.word_embeddings_layernorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_epsilon)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return _norm(self.word_embeddings_layernorm, self.word_embeddings(input_ids))

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The tied output head: [B, S, hidden] -> [B, S, vocab] through the word-embedding matrix."""
        return F.linear(hidden, self.word_embeddings.weight)


class BloomBlock(nn.Module):
    """One pre-LN transformer layer: x + attn(LN(x)), then x + mlp(LN(x)); [B, S, hidden] -> [B, S, hidden].

    tp_rank/tp_size choose which heads' ALiBi slopes this block applies when its linears are tensor-parallel;
    ep_size is how many expert-parallel ranks share an MoE block's experts.
    """

    def __init__(
        self,
        config: BloomConfig,
        layer_number: int = 0,
        linear_factory: LinearFactory | None = None,
        tp_rank: int = 0,
        tp_size: int = 1,
        ep_size: int = 1,
    ) -> None:
        super().__init__()
        factory = linear_factory or default_linear_factory
        self.config = config
        self.layer_number = layer_number
        self.hidden_dropout = config.hidden_dropout
        self.input_layernorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_epsilon)
        self.self_attention = BloomAttention(config, factory, tp_size)
        self.post_attention_layernorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_epsilon)
        self.mlp: nn.Module
        if config.is_moe_block(layer_number):
            from appliance.model.moe import BloomMoE

            self.mlp = BloomMoE(config, ep_size, factory if tp_size > 1 else None, tp_size)  # tp > 1: experts sharded
        else:
            self.mlp = BloomMLP(config, factory)
        self.alibi = RankAlibi(config.n_head, tp_rank, tp_size)

    def forward(
        self, hidden: torch.Tensor, attention_mask: torch.Tensor | None = None, doc_ids: torch.Tensor | None = None
    ) -> torch.Tensor:
        """hidden: [B, S, hidden] (with sequence parallelism, this rank's chunk of the sequence: attention runs over
        the whole sequence the QKV projection gathers); attention_mask: [B, S] with 1 for tokens and 0 for padding,
        or None; doc_ids: [B, S] document of each token of the whole sequence (appliance/data/documents.py), or
        None to attend across documents."""
        attn_out, attn_bias = self.self_attention(
            _norm(self.input_layernorm, hidden), self.alibi, attention_mask, doc_ids
        )
        hidden = ops.bias_dropout_add(attn_out, attn_bias, hidden, self.hidden_dropout, self.training)
        mlp_out, mlp_bias = self.mlp(_norm(self.post_attention_layernorm, hidden))
        return ops.bias_dropout_add(mlp_out, mlp_bias, hidden, self.hidden_dropout, self.training)


class BloomFinal(nn.Module):
    """Final LayerNorm, then logits through the (tied) word-embedding matrix: [B, S, hidden] -> [B, S, vocab]."""

    def __init__(self, config: BloomConfig) -> None:
        super().__init__()
        self.ln_f = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_epsilon)

    def forward(self, hidden: torch.Tensor, embedding_weight: torch.Tensor) -> torch.Tensor:
        return F.linear(self.norm(hidden), embedding_weight)

    def norm(self, hidden: torch.Tensor) -> torch.Tensor:
        """ln_f alone: the hidden states the chunked loss and scoring take with the head's weight."""
        return _norm(self.ln_f, hidden)


class BloomTransformer(nn.Module):
    """Holds the pieces under transformers' names: word_embeddings, word_embeddings_layernorm, h, ln_f."""

    embedding: BloomEmbedding
    final: BloomFinal

    def __init__(self, embedding: BloomEmbedding, blocks: list[BloomBlock], final: BloomFinal) -> None:
        super().__init__()
        self.word_embeddings = embedding.word_embeddings
        self.word_embeddings_layernorm = embedding.word_embeddings_layernorm
        self.h = nn.ModuleList(blocks)
        self.ln_f = final.ln_f
        # The pieces share the leaf modules registered above. They are kept outside the module tree so every
        # parameter has exactly one name, the transformers one.
        object.__setattr__(self, "embedding", embedding)
        object.__setattr__(self, "final", final)


class BloomForCausalLM(nn.Module):
    """BLOOM with its tied language-model head. forward(input_ids, attention_mask) -> logits [B, S, vocab].

    Built on the meta device and given storage on ``device`` (CPU by default), then drawn once by ``init_weights``:
    no layer draws a default init first, so building costs one model's memory and one draw.
    """

    def __init__(
        self,
        config: BloomConfig,
        linear_factory: LinearFactory | None = None,
        *,
        checkpoint_blocks: bool = False,
        seed: Seed = 0,
        device: torch.device | str = "cpu",
    ) -> None:
        super().__init__()
        self.config = config
        # Recompute each block's activations in the backward pass instead of keeping them (full recompute).
        self.checkpoint_blocks = checkpoint_blocks

        def build() -> BloomTransformer:
            blocks = [BloomBlock(config, i, linear_factory) for i in range(config.n_layer)]
            return BloomTransformer(BloomEmbedding(config), blocks, BloomFinal(config))

        self.transformer = empty_module(build, device)
        # The head owns no storage: its weight is the word-embedding parameter (built on meta so the
        # [vocab, hidden] matrix is not allocated twice).
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False, device="meta")
        self.lm_head.weight = self.transformer.word_embeddings.weight
        self.init_weights(seed)

    @torch.no_grad()
    def init_weights(self, seed: Seed = 0) -> None:
        """transformers' Bloom init: weights ~ N(0, initializer_range), biases 0, LayerNorms 1/0. initializer_range is
        the plan's model.init_std (BLOOM: 0.0048). Megatron-DeepSpeed also drew the attention and MLP output
        projections at init_std / sqrt(2 x layers); like transformers, this draws every matrix at init_std.

        Each element is a function of (seed, parameter name, its index) (initial_weights.py), so every parallel
        layout's shards, drawn from the same seed, are slices of this model. A torch.Generator stands for its initial
        seed: ``init_weights(torch.Generator().manual_seed(s))`` equals ``init_weights(s)``.
        """
        from appliance.model.moe import canonical_moe_name

        for name, param in self.named_parameters():
            name = canonical_moe_name(name)  # an expert draws by its global index (model/moe.py)
            if getattr(param, "tensor_model_parallel", False):
                raise ValueError(
                    f"{name} is a tensor-parallel shard: a split model draws its shards through "
                    "appliance.parallel.checkpoint.weight_shards.init_shards_"
                )
            init_parameter_(param, name, seed=seed, std=self.config.initializer_range)

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        doc_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """input_ids: [B, S] int64; attention_mask: [B, S] of 1 (token) / 0 (padding) or None; doc_ids: [B, S]
        document index per token (packed documents attend only within themselves) or None. -> [B, S, vocab]."""
        return F.linear(self.final_hidden(input_ids, attention_mask, doc_ids), self.lm_head.weight)

    def final_hidden(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        doc_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The hidden states after ln_f, [B, S, hidden]: what the tied head (lm_head.weight) turns into logits."""
        for name, given in (("attention_mask", attention_mask), ("doc_ids", doc_ids)):
            if given is not None and given.shape != input_ids.shape:
                raise ValueError(f"{name} shape {tuple(given.shape)} != input_ids shape {tuple(input_ids.shape)}")
        hidden = self.transformer.embedding(input_ids)
        recompute = self.checkpoint_blocks and torch.is_grad_enabled()
        for block in self.transformer.h:
            if recompute:
                hidden = checkpoint(block, hidden, attention_mask, doc_ids, use_reentrant=False)
            else:
                hidden = block(hidden, attention_mask, doc_ids)
        return self.transformer.final.norm(hidden)

    def loss(
        self,
        input_ids: torch.Tensor,
        labels: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        doc_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Mean next-token cross-entropy; labels as input_ids (shifted inside), -100 where no loss is wanted (all
        ignored: 0). Chunked over tokens against the head's weight: the [B, S, vocab] logits are never formed.
        An MoE model adds moe_aux_loss_coef x the MoE blocks' summed load-balancing loss (``moe_aux_loss``)."""
        hidden = self.final_hidden(input_ids, attention_mask, doc_ids)
        loss = ops.vocab_cross_entropy(hidden[:, :-1], self.lm_head.weight, labels[:, 1:])
        if self.config.is_moe:
            loss = loss + self.config.moe_aux_loss_coef * self.moe_aux_loss().to(loss.dtype)
        return loss

    def moe_aux_loss(self) -> torch.Tensor:
        """The MoE blocks' load-balancing losses of the last forward, summed (unweighted; 0 for a dense model)."""
        from appliance.model.moe import aux_loss_sum, moe_layers

        return aux_loss_sum(moe_layers(self), self.lm_head.weight)


def causal_lm_loss(logits: torch.Tensor, labels: torch.Tensor, ignore_index: int = -100) -> torch.Tensor:
    """transformers' convention: logits [B, S, V] at position t predict labels[:, t + 1]; labels [B, S].

    Float32 mean over the predicted positions whose label is not ignore_index.
    """
    return ops.cross_entropy(logits[:, :-1, :], labels[:, 1:], ignore_index=ignore_index)
