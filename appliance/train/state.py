"""What a rank saves beside the model: optimizer state and every RNG, in a form `torch.load(weights_only=True)`
accepts (tensors, numbers, strings, lists, tuples, dicts and nothing that runs code when loaded)."""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch


def rng_state() -> dict[str, Any]:
    np_kind, np_keys, np_pos, np_has_gauss, np_cached = np.random.get_state(legacy=True)
    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": [np_kind, torch.from_numpy(np.array(np_keys, dtype=np.uint32)), np_pos, np_has_gauss, np_cached],
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    np_kind, np_keys, np_pos, np_has_gauss, np_cached = state["numpy"]
    np.random.set_state((np_kind, np_keys.numpy(), np_pos, np_has_gauss, np_cached))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
