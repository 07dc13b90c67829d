"""A stand-in for ParallelEngine in trainer tests whose steps are scripted: everything the trainer asks of an engine
besides the step itself (parameters, checkpoint files holding one zero tensor, the fp16 loss scaler's state when
`scaler` is given). Subclasses answer the step."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from types import SimpleNamespace

import torch

from appliance.parallel.checkpoint.engine_io import HostFile


class StandInEngine:
    topology = SimpleNamespace(dp_group=None)

    def __init__(self, scaler: dict[str, float] | None = None) -> None:
        self.scaler = scaler  # the loss scaler's state (None: a bf16 or fp32 engine)
        self.loss_fn = SimpleNamespace(inject_nan=False)
        self.loaded_scaler: dict[str, float] | None = None
        self.last_checkpoint: Path | None = None

    def set_lr(self, lr: float) -> None:
        pass

    def check_drift(self) -> list[str]:
        return []

    def named_parameters(self) -> list[tuple[str, torch.nn.Parameter]]:
        return [("w", torch.nn.Parameter(torch.zeros(4)))]

    def optimizer_shard(self) -> dict[str, torch.Tensor]:
        return {}

    def model_snapshot(self, metadata: Mapping[str, str]) -> HostFile:
        return HostFile("model.safetensors", {"w": torch.zeros(4)}, dict(metadata))

    def optimizer_snapshot(self, shard: Mapping[str, torch.Tensor], metadata: Mapping[str, str]) -> None:
        return None

    def load_model(self, step_dir: Path) -> None:
        pass

    def load_optimizer(self, step_dir: Path) -> bool:
        return True

    @property
    def loss_scale(self) -> float | None:
        return None if self.scaler is None else self.scaler["scale"]

    def loss_scaler_state(self) -> dict[str, float] | None:
        return None if self.scaler is None else dict(self.scaler)

    def load_loss_scaler_state(self, state: Mapping[str, float]) -> None:
        self.loaded_scaler = dict(state)
