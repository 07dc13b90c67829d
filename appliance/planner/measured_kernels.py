"""Fused-op times measured on a run's GPU, as the time model's input, and plan.json's estimate priced with them.

At each launch on CUDA the ranks choose their kernels by measurement (parallel/step/kernel_choice.py): each selectable
op's chosen implementation has a time in ms for one forward + backward at one rank's micro-batch. `MeasuredKernels`
holds those; `timing.block_seconds` uses them in place of its estimates where they were measured at the plan's
micro-batch and sequence:
- attention: the block's attention forward + backward is the measured flash_alibi_attention time (forward and
  backward keep the estimate's proportion, which recompute repeats); not under cp > 1 (the exchange's chunks);
- LayerNorm: the two LayerNorms of a block are 2 x the measured layer_norm time, in place of the LAYER_NORM_ELEMENTS
  of the elementwise estimate's ELEMENTWISE_FULL_WIDTH (calibration.py); over tp under sequence parallelism;
- bias+GeLU: the measured bias_gelu time, in place of the estimate's ELEMENTWISE_SPLIT_FFN;
- loss: the measured vocab_cross_entropy time, which includes the LM head's products, in place of the last
  stage's LM head GEMMs and cross-entropy traffic (counted under "elementwise").
The embedding's and the final LayerNorm stay estimated (one each per run, beside 2 x layers in the blocks).

`reprice` (planner/reprice.py) turns a run spec's estimate into the one these times give.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from appliance.planner.layout import Layout

LAYER_NORMS_PER_BLOCK = 2  # input_layernorm and post_attention_layernorm
# Of calibration.ELEMENTWISE_FULL_WIDTH's 16 elements per s b h: each LayerNorm reads its input and writes its
# output, 2 elements, so the block's two count 4.
LAYER_NORM_ELEMENTS = 4.0


@dataclass(frozen=True)
class MeasuredKernels:
    """op -> seconds of one forward + backward of its chosen implementation, at one rank's micro-batch of
    micro_batch_size sequences seq_len tokens long (the rank's share under cp)."""

    micro_batch_size: int
    seq_len: int
    seconds_by_op: dict[str, float]

    @classmethod
    def from_record(cls, record: dict[str, Any]) -> MeasuredKernels | None:
        """From a `kernels` record (parallel/step/kernel_choice.py kernel_record); None when nothing was measured."""
        choices, times, shapes = record.get("choices") or {}, record.get("times_ms") or {}, record.get("shapes")
        seconds = {op: times[op][b] / 1e3 for op, b in choices.items() if b in times.get(op, {})}
        if not seconds or not isinstance(shapes, dict):
            return None
        return cls(int(shapes["micro_batch_size"]), int(shapes["seq_len"]), seconds)

    def applies(self, layout: Layout, seq_len: int) -> bool:
        """Whether these were measured at the micro-batch a rank of `layout` runs for sequences seq_len long."""
        return self.micro_batch_size == layout.micro_batch_size and self.seq_len == seq_len // layout.cp

    def seconds(self, op: str) -> float | None:
        return self.seconds_by_op.get(op)
