"""BloomStack: the pipeline's layers (pipeline/specs.py) in one process, for pp = 1 under DeepSpeed's plain engine."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import torch
from deepspeed.pipe import LayerSpec, TiedLayerSpec
from torch import nn

from appliance.parallel.loss import VocabParallelLoss
from appliance.parallel.pipeline.specs import TransformerLayerPipe, recompute_layers
from appliance.parallel.tensor.cross_entropy import HeadInput


class BloomStack(nn.Module):
    """The same layers in one process, for pp = 1 under DeepSpeed's plain engine (which, unlike the pipeline
    engine, supports ZeRO-2). Modules are registered under the PipelineModule's names, so ``hf_parameter_name``
    serves both. forward(ids) -> HeadInput (what scoring reads); forward(ids, labels) -> loss."""

    def __init__(self, specs: Sequence[LayerSpec], loss_fn: VocabParallelLoss, *, recompute_blocks: bool) -> None:
        super().__init__()
        self.loss_fn = loss_fn
        self.recompute_blocks = recompute_blocks
        self.tied_modules = nn.ModuleDict()
        self._layers: list[Callable[[torch.Tensor], torch.Tensor]] = []
        for index, spec in enumerate(specs):
            if isinstance(spec, TiedLayerSpec):
                if spec.key not in self.tied_modules:
                    self.tied_modules[spec.key] = spec.build()
                tied = self.tied_modules[spec.key]
                self._layers.append(partial(spec.forward_fn, tied) if spec.forward_fn else tied)
            else:
                layer = spec.build()
                self.add_module(str(index), layer)
                self._layers.append(layer)

    def forward(
        self, input_ids: torch.Tensor, labels: torch.Tensor | None = None, doc_ids: torch.Tensor | None = None
    ) -> Any:
        """doc_ids: [batch, seq] document of each token (reset_attention_mask), carried to every block as in the
        pipeline, or None."""
        # Activations between the layers, the HeadInput after the last.
        x: Any = input_ids if doc_ids is None else (input_ids, doc_ids)
        recompute = self.recompute_blocks and torch.is_grad_enabled()
        for layer in self._layers:
            x = recompute_layers(layer, x) if recompute and isinstance(layer, TransformerLayerPipe) else layer(x)
        if labels is None:
            return x if isinstance(x, HeadInput) else x[0]  # scoring reads the HeadInput (a training MoE loss aside)
        return self.loss_fn(x, labels)
