"""BLOOM on a q x q tensor-parallel mesh (tp2d = q) in one pipeline stage: the plain model's pieces with the 2D
layers of tensor2d/layers2d.py put in, under the Hugging Face parameter names.

    ids [b, s] (whole micro-batch) -> Embedding2D -> LayerNorm2D -> BloomBlock x L -> LayerNorm2D -> head + loss

The blocks are model/bloom.py's own BloomBlock, built with the SUMMA linear factory, the heads of this rank's mesh
column (tp_rank = mesh column, tp_size = q: its ALiBi slopes follow) and its two LayerNorms replaced by LayerNorm2D.
Activations between the pieces are [b/q, s, h/q] blocks. ``build_tp2d_model`` is the helper a 4-rank gloo run
(q = 2) calls to get this rank's part of a model whose weights are a single-process model's.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn

from appliance.model.bloom import BloomBlock
from appliance.model.config import BloomConfig
from appliance.parallel.tensor.cross_entropy import HeadInput
from appliance.parallel.tensor2d.layers2d import (
    Embedding2D,
    Mesh2D,
    apply_norm,
    layer_norm_2d,
    loss_2d,
    sum_over_rows,
    tp2d_linear_factory,
)
from appliance.parallel.topology import ParallelTopology


def block_2d(config: BloomConfig, layer_number: int, mesh: Mesh2D, **tensor_kwargs: object) -> BloomBlock:
    """A BloomBlock on the mesh: SUMMA linears, this column's heads and slopes, row-reduced LayerNorms."""
    factory = tp2d_linear_factory(mesh, **tensor_kwargs)
    block = BloomBlock(config, layer_number, factory, tp_rank=mesh.col, tp_size=mesh.q)
    eps = config.layer_norm_epsilon
    block.input_layernorm = layer_norm_2d(config.hidden_size, eps, mesh, **tensor_kwargs)
    block.post_attention_layernorm = layer_norm_2d(config.hidden_size, eps, mesh, **tensor_kwargs)
    return block


class _Transformer(nn.Module):
    def __init__(self, config: BloomConfig, mesh: Mesh2D, dtype: torch.dtype | None) -> None:
        super().__init__()
        h, eps = config.hidden_size, config.layer_norm_epsilon
        self.word_embeddings = Embedding2D(config.vocab_size, h, mesh, dtype=dtype)
        self.word_embeddings_layernorm = layer_norm_2d(h, eps, mesh, dtype=dtype)
        self.h = nn.ModuleList(block_2d(config, i, mesh, dtype=dtype) for i in range(config.n_layer))
        self.ln_f = layer_norm_2d(h, eps, mesh, dtype=dtype)


class Bloom2D(nn.Module):
    """This mesh rank's part of BLOOM (one stage). ``head(ids)`` -> the loss's input; ``loss(ids, labels)`` ->
    this mesh row's share of the micro-batch mean (``reported_loss`` sums the rows)."""

    def __init__(self, config: BloomConfig, mesh: Mesh2D, *, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        if config.n_head % mesh.q != 0:
            raise ValueError(f"tp2d: heads({config.n_head}) % tp2d({mesh.q}) != 0 (heads split over mesh columns)")
        self.config, self.mesh = config, mesh
        self.transformer = _Transformer(config, mesh, dtype)

    def final_hidden(self, ids: torch.Tensor) -> torch.Tensor:
        """ids [b, s] of the whole micro-batch -> the final LayerNorm's [b/q, s, h/q] block."""
        t = self.transformer
        hidden = apply_norm(t.word_embeddings_layernorm, t.word_embeddings(ids))
        for block in t.h:
            hidden = block(hidden)
        return apply_norm(t.ln_f, hidden)

    def head(self, ids: torch.Tensor) -> HeadInput:
        return self.transformer.word_embeddings.head_input(self.final_hidden(ids))

    def loss(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Next-token loss as BloomForCausalLM.loss (labels are ids, shifted here), this row's share."""
        head = self.head(ids)
        shifted = HeadInput(head.hidden[:, :-1], head.weight)
        return loss_2d(shifted, labels[:, 1:], self.mesh)

    def reported_loss(self, loss: torch.Tensor) -> float:
        return float(sum_over_rows(loss, self.mesh))

    @torch.no_grad()
    def load_full(self, state: Mapping[str, torch.Tensor]) -> None:
        """Take this rank's blocks of a single-process (Hugging Face-named) state dict (tensor/param_splits.py's 2D
        cut)."""
        missing = [name for name, _ in self.named_parameters() if name not in state]
        if missing:
            raise ValueError(f"the state dict lacks {missing}")
        for name, param in self.named_parameters():
            param.copy_(self.mesh.block(state[name]))


def build_tp2d_model(
    config: BloomConfig, topology: ParallelTopology, full_state: Mapping[str, torch.Tensor], dtype: torch.dtype
) -> Bloom2D:
    """This rank's Bloom2D at the topology's tp2d, holding its blocks of ``full_state`` (a BloomForCausalLM's
    state dict), in ``dtype``. Every rank of a ``run_distributed(..., tp=q * q, tp2d=q)`` run calls it; with pp > 1
    each stage's mesh holds a whole model of its own (only the mesh's groups are used)."""
    model = Bloom2D(config, Mesh2D.of(topology), dtype=dtype)
    model.load_full({k: v.to(dtype) for k, v in full_state.items()})
    return model
