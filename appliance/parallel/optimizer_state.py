"""A rank's optimizer state in a form ``torch.load(weights_only=True)`` reads back, for resuming at the same layout.

DeepSpeed's bf16 and ZeRO optimizers put objects in their state dicts that are not plain data (the loss scaler,
the parameter-to-fragment maps used for universal checkpoints). Those are rebuilt from the live optimizer when
loading, so the saved state keeps only tensors, numbers, strings and containers of them: what weights_only
accepts, and nothing that runs code when read. The fp32 master weights are kept (``load_from_fp32_weights``),
so a resumed bf16 run continues from the exact fp32 numbers, not from their bf16 rounding.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

_DROP = object()
_KEPT = (torch.Tensor, torch.Size, torch.dtype, type(None))


def _plain(value: Any) -> Any:
    """``value`` with every mapping entry that holds a non-plain object removed; _DROP if it is one itself."""
    if isinstance(value, _KEPT):
        return value
    # Subclasses (DeepSpeed's ZeroStageEnum is an int enum) become the base type weights_only knows.
    for base in (bool, int, float, str):
        if isinstance(value, base):
            return base(value)
    if isinstance(value, Mapping):
        out = {}
        for key, item in value.items():
            kept = _plain(item)
            if kept is not _DROP and isinstance(key, int | str):
                out[key] = kept
        return out
    if isinstance(value, list | tuple):
        items = [_plain(item) for item in value]
        if any(item is _DROP for item in items):
            return _DROP
        return items if isinstance(value, list) else tuple(items)
    return _DROP


def optimizer_state(optimizer: Any) -> dict[str, Any]:
    state = _plain(optimizer.state_dict())
    assert isinstance(state, dict)
    return state


def _is_deepspeed_wrapper(optimizer: Any) -> bool:
    from deepspeed.runtime.bf16_optimizer import BF16_Optimizer
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    return isinstance(optimizer, BF16_Optimizer | DeepSpeedZeroOptimizer)


def load_optimizer_state(optimizer: Any, state: Mapping[str, Any], *, dp_size: int) -> None:
    """Load a state saved by ``optimizer_state`` from the same rank at the same layout."""
    # Entries left out when saving come back from the live optimizer (same class, same layout).
    merged = {**optimizer.state_dict(), **state}
    if _is_deepspeed_wrapper(optimizer):
        # DeepSpeed's loaders take every DP rank's state and pick their own by DP rank.
        optimizer.load_state_dict([merged] * dp_size, load_optimizer_states=True, load_from_fp32_weights=True)
    else:
        optimizer.load_state_dict(merged)
