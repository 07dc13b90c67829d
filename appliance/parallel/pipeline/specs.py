"""BLOOM as DeepSpeed pipeline layer specs, with tensor-parallel layers inside (Megatron-DeepSpeed's GPTModelPipe).

The sequence every pipeline runs, as BLOOM-176B ran it:

    0      TiedLayerSpec("embed", WordEmbeddingPipe)             ids -> hidden     (vocab-parallel embedding)
    1      LayerSpec(EmbedLayerNormPipe)                         BLOOM's embedding LayerNorm
    2..L+1 LayerSpec(TransformerLayerPipe) x L                   the blocks (ALiBi slopes of this TP rank's heads)
    L+2    LayerSpec(FinalLayerNormPipe)                         ln_f
    L+3    TiedLayerSpec("embed", WordEmbeddingPipe, lm_head)    hidden -> HeadInput(hidden, embedding shard)
    loss   VocabParallelLoss                                     chunked vocab-parallel cross-entropy: no logits

The first and last entries share one module under the key "embed": with pp > 1 the first and the last stage
each build a copy, DeepSpeed broadcasts the first stage's weight at start and all-reduces the two gradients
after every backward (``ReduceTiedGrads``), so the copies stay equal. The last stage's copy gets its gradient
from the loss, which takes the hidden states and that copy's weight and computes the logits chunk by chunk.
Stages are cut by ``partition_method="type:transformer|embedding"``: each class whose name matches counts one
unit, the others (the two LayerNorms, weight 0) ride along, so 70 blocks + 2 embeddings over 12 stages gives 6
units per stage, BLOOM-176B's split; the planner's ``pipeline_partition`` predicts it and
``build_pipeline_module`` checks it.

Activations between layers are [batch, seq, hidden] (the transformers layout); with sequence parallelism each
TP rank holds [batch, seq / tp, hidden] between the tensor-parallel regions (sequence dimension 1), and the blocks
still take the fused flash attention (its slopes are all the ALiBi it needs). Under reset_attention_mask the
pipeline's input is (ids, doc_ids) and every layer up to ln_f passes (hidden, doc_ids) on, as Megatron-DeepSpeed
passes (hidden, attention_mask): DeepSpeed sends each tensor of the tuple between stages and returns gradients
only for the floating-point ones. doc_ids [batch, seq] covers the whole sequence (under context parallelism, this
CP rank's slice of it, cut with the tokens); ln_f drops it.
Parameter names map to the Hugging Face ones with ``hf_parameter_name``.

BLOOM-MoE (docs/MOE.md): in training, the MoE blocks' load-balancing loss travels with the activations as one more
tensor, the last of the tuple: a float32 [1] that the word embedding starts at zero (a leaf that requires grad, so
a first stage without MoE blocks still has a gradient to send back), each MoE block adds its layer's loss to, and
the loss function adds, times moe_aux_loss_coef, to the language-model loss; DeepSpeed's pipeline sends it between
stages and returns its gradient like the hidden states'. In evaluation (module.eval()) nothing extra travels.

Every spec builds its layer on the meta device and then allocates its parameters on the rank's device, without
values (no layer draws a default init, the tensor-parallel ones a whole matrix): the engine then draws this rank's
shards in place (checkpoint.weight_shards.init_shards_).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import torch
from deepspeed.pipe import LayerSpec, PipelineModule, TiedLayerSpec
from torch import nn
from torch.utils.checkpoint import checkpoint

from appliance.model.bloom import BloomBlock
from appliance.model.config import BloomConfig
from appliance.model.initial_weights import empty_module
from appliance.model.moe import canonical_moe_name
from appliance.parallel.loss import VocabParallelLoss
from appliance.parallel.parallelize import SEQUENCE_DIM, Parallelism
from appliance.parallel.tensor.cross_entropy import HeadInput, lm_head_input
from appliance.parallel.tensor.layers import VocabParallelEmbedding
from appliance.parallel.tensor2d.layers2d import Embedding2D, apply_norm

EMBED_KEY = "embed"
BLOCK_OFFSET = 2  # pipeline index of block 0: the word embedding and its LayerNorm come first
CHECKPOINTED_LAYERS = ["TransformerLayerPipe"]
# What flows between layers: hidden states (token ids into the first), or with packed documents (hidden, doc_ids),
# and in an MoE model's training the load-balancing loss last: (hidden, aux) or (hidden, doc_ids, aux).
Activations = torch.Tensor | tuple[torch.Tensor, ...]
AUX_SHAPE = (1,)  # the travelling load-balancing loss: float32 [1] (a 0-d tensor has no shape to exchange)


def split_aux(x: Any) -> tuple[Any, torch.Tensor | None]:
    """(activations without the MoE loss, the loss or None). The loss is the tuple's last tensor, float [1]; hidden
    states are [batch, seq, hidden] and document ids integers, so nothing else looks like it."""
    if isinstance(x, tuple) and x[-1].is_floating_point() and tuple(x[-1].shape) == AUX_SHAPE:
        rest = x[:-1]
        return (rest[0] if len(rest) == 1 else rest), x[-1]
    return x, None


def with_aux(x: Any, aux: torch.Tensor | None) -> Any:
    if aux is None:
        return x
    return (*x, aux) if isinstance(x, tuple) else (x, aux)


class WordEmbeddingPipe(nn.Module):
    """The tied word embedding: token ids -> hidden states on the first stage, the LM head on the last."""

    def __init__(self, config: BloomConfig, parallelism: Parallelism) -> None:
        super().__init__()
        self.tp_group, self.sequence_parallel = parallelism.topology.tp_group, parallelism.sequence_parallel
        self.mesh = parallelism.mesh
        self.is_moe = config.is_moe
        self.word_embeddings: VocabParallelEmbedding | Embedding2D
        if self.mesh is not None:  # tp2d: the whole micro-batch in, this rank's [b/q, s, h/q] block out
            self.word_embeddings = Embedding2D(config.vocab_size, config.hidden_size, self.mesh)
        else:
            self.word_embeddings = VocabParallelEmbedding(
                config.vocab_size, config.hidden_size, **parallelism.embedding_kwargs()
            )

    def forward(self, input_ids: Activations) -> Activations:
        aux = None
        if self.is_moe and self.training:  # the MoE loss starts here (module docstring)
            device = self.word_embeddings.weight.device
            aux = torch.zeros(AUX_SHAPE, dtype=torch.float32, device=device, requires_grad=torch.is_grad_enabled())
        if isinstance(input_ids, tuple):
            ids, doc_ids = input_ids
            if self.mesh is not None:  # the blocks see this mesh row's sequences only
                doc_ids = self.mesh.batch_slice(doc_ids)
            return with_aux((self.word_embeddings(ids), doc_ids), aux)
        return with_aux(self.word_embeddings(input_ids), aux)

    def head_input(self, hidden: torch.Tensor) -> HeadInput:
        """[batch, seq(/tp), hidden] -> the whole sequence's hidden states and this rank's embedding rows (tp2d:
        the mesh row's whole hidden states and this column's vocabulary rows, layers2d.Embedding2D)."""
        if isinstance(self.word_embeddings, Embedding2D):
            return self.word_embeddings.head_input(hidden)
        return lm_head_input(
            hidden,
            self.word_embeddings.weight,
            self.tp_group,
            sequence_parallel=self.sequence_parallel,
            sequence_dim=SEQUENCE_DIM,
        )


def lm_head(embedding: WordEmbeddingPipe, hidden: Activations) -> HeadInput | tuple[HeadInput, torch.Tensor]:
    """``forward_fn`` of the last stage's tied spec: the embedding matrix as the output layer, handed to the loss
    (or to scoring) with the hidden states rather than multiplied here; the MoE loss, where it travels, beside."""
    final, aux = split_aux(hidden)
    head = embedding.head_input(final)
    return head if aux is None else (head, aux)


class EmbedLayerNormPipe(nn.Module):
    # Named "Embed", not "Embedding": the partition counts only the embedding itself as a unit.
    def __init__(self, config: BloomConfig, parallelism: Parallelism) -> None:
        super().__init__()
        self.word_embeddings_layernorm = parallelism.layer_norm(config.hidden_size, config.layer_norm_epsilon)

    def forward(self, hidden: Activations) -> Activations:
        norm = self.word_embeddings_layernorm
        hidden, aux = split_aux(hidden)
        if isinstance(hidden, tuple):
            return with_aux((apply_norm(norm, hidden[0]), hidden[1]), aux)
        return with_aux(apply_norm(norm, hidden), aux)


class FinalLayerNormPipe(nn.Module):
    def __init__(self, config: BloomConfig, parallelism: Parallelism) -> None:
        super().__init__()
        self.ln_f = parallelism.layer_norm(config.hidden_size, config.layer_norm_epsilon)

    def forward(self, hidden: Activations) -> Activations:
        hidden, aux = split_aux(hidden)
        if isinstance(hidden, tuple):
            hidden = hidden[0]  # the document ids end here: the head and the loss work per token
        return with_aux(apply_norm(self.ln_f, hidden), aux)


class TransformerLayerPipe(BloomBlock):
    """A BloomBlock that takes hidden states only (the pipeline passes one tensor between layers), parallelized as
    ``parallelism`` says (parallelize.py: TP/SP layers, the context-parallel attention core, selective recompute).

    With sequence parallelism the input is this rank's sequence chunk while attention runs over the whole
    sequence (the QKV projection gathers it); BloomBlock's forward serves both.
    """

    def __init__(self, config: BloomConfig, layer_number: int, parallelism: Parallelism) -> None:
        super().__init__(
            config, layer_number, parallelism.linear_factory(), *parallelism.head_split, parallelism.topology.ep
        )
        parallelism.parallelize_block(self)

    def forward(self, hidden: Activations, attention_mask: torch.Tensor | None = None) -> Activations:  # type: ignore[override]
        if attention_mask is not None:
            raise ValueError("pipeline blocks train on unpadded samples: attention_mask must be None")
        hidden, aux = split_aux(hidden)
        if isinstance(hidden, tuple):
            out: Activations = (super().forward(hidden[0], None, hidden[1]), hidden[1])
        else:
            out = super().forward(hidden)
        moe_loss = getattr(self.mlp, "aux_loss", None)
        if aux is not None and moe_loss is not None:
            aux = aux + moe_loss.float().reshape(AUX_SHAPE)
        return with_aux(out, aux)


class EmptyLayerSpec(LayerSpec):
    """A LayerSpec whose layer gets its parameters on ``device``, uninitialised (initial_weights.empty_module)."""

    def __init__(
        self, typename: type[nn.Module], *module_args: Any, device: torch.device, **module_kwargs: Any
    ) -> None:
        super().__init__(typename, *module_args, **module_kwargs)
        self.device = device

    def build(self, log: bool = False) -> nn.Module:
        return empty_module(lambda: LayerSpec.build(self, log), self.device)


class EmptyTiedLayerSpec(TiedLayerSpec):
    """The TiedLayerSpec counterpart of EmptyLayerSpec."""

    def __init__(
        self, key: str, typename: type[nn.Module], *module_args: Any, device: torch.device, **module_kwargs: Any
    ) -> None:
        super().__init__(key, typename, *module_args, **module_kwargs)
        self.device = device

    def build(self, log: bool = False) -> nn.Module:
        return empty_module(lambda: TiedLayerSpec.build(self, log), self.device)


def bloom_layer_specs(config: BloomConfig, parallelism: Parallelism, *, device: torch.device) -> list[LayerSpec]:
    """The pipeline's layer specs (see the module docstring); every rank builds the same list. The layers they
    build hold uninitialised parameters on ``device``, parallelized by ``parallelism`` (parallelize.py)."""
    embed = partial(
        EmptyTiedLayerSpec,
        EMBED_KEY,
        WordEmbeddingPipe,
        config,
        parallelism,
        device=device,
        tied_weight_attr=["word_embeddings.weight"],
    )
    blocks = [
        EmptyLayerSpec(TransformerLayerPipe, config, i, parallelism, device=device) for i in range(config.n_layer)
    ]
    norm = partial(EmptyLayerSpec, config=config, parallelism=parallelism, device=device)
    return [embed(), norm(EmbedLayerNormPipe), *blocks, norm(FinalLayerNormPipe), embed(forward_fn=lm_head)]


def hf_parameter_name(pipe_name: str, n_layer: int, expert_offset: int = 0) -> str:
    """The Hugging Face name of a parameter of a PipelineModule or BloomStack built from ``bloom_layer_specs``:
    ``tied_modules.embed.word_embeddings.weight`` -> ``transformer.word_embeddings.weight``,
    ``3.self_attention.dense.bias`` -> ``transformer.h.1.self_attention.dense.bias``; an MoE block's parameters by
    their layout-free names (model/moe.py), this rank's experts numbered from ``expert_offset``."""
    head, _, rest = pipe_name.partition(".")
    if head == "tied_modules":
        return "transformer." + rest.partition(".")[2]
    block = int(head) - BLOCK_OFFSET
    rest = canonical_moe_name(rest, expert_offset)
    return f"transformer.h.{block}.{rest}" if 0 <= block < n_layer else "transformer." + rest


def recompute_layers(function: Callable[..., Any], *inputs: Activations) -> Any:
    """Full activation recompute of a range of layers (torch's non-reentrant checkpoint: it keeps the RNG state,
    and the layers' tensor-parallel collectives simply run again in the backward pass)."""
    return checkpoint(function, *inputs, use_reentrant=False)


def build_pipeline_module(
    config: BloomConfig,
    parallelism: Parallelism,
    *,
    partition_method: str,
    blocks_per_stage: Sequence[int],
    loss_fn: VocabParallelLoss,
    device: torch.device,
) -> PipelineModule:
    """This rank's stage of the BLOOM pipeline, its parameters uninitialised on ``device``."""
    topology = parallelism.topology
    specs = bloom_layer_specs(config, parallelism, device=device)
    # No autograd while building: the constructor broadcasts the tied embedding in place from the first stage,
    # which autograd would otherwise record on the parameter. (It broadcasts uninitialised memory here; both
    # stages then draw the same values.)
    with torch.no_grad():
        module = PipelineModule(
            layers=specs,
            topology=topology.to_deepspeed(),
            loss_fn=loss_fn,
            partition_method=partition_method,
            # One block per checkpoint, as BLOOM (--checkpoint-activations, interval 1).
            activation_checkpoint_interval=1 if parallelism.full_recompute else 0,
            activation_checkpoint_func=recompute_layers,
            checkpointable_layers=CHECKPOINTED_LAYERS,
        )
    parts = module.parts
    counted = [
        sum(isinstance(s, LayerSpec) and s.typename is TransformerLayerPipe for s in specs[parts[i] : parts[i + 1]])
        for i in range(topology.pp)
    ]
    if counted != list(blocks_per_stage):
        raise RuntimeError(
            f"DeepSpeed split the {config.n_layer} blocks as {counted} with {partition_method!r}, "
            f"the plan expects {list(blocks_per_stage)}"
        )
    return module
