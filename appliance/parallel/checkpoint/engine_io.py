"""What the training engine writes into a checkpoint and reads back, at any layout: this rank's model file and its
optimizer file, as host copies (``HostFile``) or written at once, and the loads that take each parameter's slice from
the files of whatever layout wrote them (weight_shards.py for the model, optimizer_state.py for Adam's state).

``EngineCheckpointIO`` is the checkpoint half of ``step.engine.ParallelEngine``, kept apart so each file reads as one
job; it relies on the engine's rank coordinates, topology, DeepSpeed (or single-replica) engine and expert store,
declared below.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from appliance.model.config import BloomConfig
from appliance.parallel.checkpoint.optimizer_state import (
    dp_writers,
    load_optimizer_state,
    optimizer_file_name,
    optimizer_files,
    optimizer_state,
)
from appliance.parallel.checkpoint.weight_shards import (
    FULL_MODEL_FILE,
    ShardReader,
    expert_file_name,
    model_sources,
    shard_file_name,
)
from appliance.parallel.experts.store_engine import EngineExpertStore
from appliance.parallel.topology import ParallelTopology


@dataclass(frozen=True)
class HostFile:
    """One checkpoint file's contents in host memory, not written yet: its name in the step directory, the tensors
    (copies, which training no longer touches) and the safetensors metadata. What an asynchronous save hands to its
    writer thread (train/async_save.py)."""

    name: str
    tensors: dict[str, torch.Tensor]
    metadata: dict[str, str]

    def write(self, step_dir: Path) -> Path:
        save_file(self.tensors, str(step_dir / self.name), metadata=self.metadata)
        return step_dir / self.name


class EngineCheckpointIO:
    """This rank's checkpoint files: see the module docstring. Mixed into ParallelEngine, which sets these."""

    engine: Any
    topology: ParallelTopology
    config: BloomConfig
    experts: EngineExpertStore | None
    single_replica: bool
    sharded: bool
    tp_rank: int
    pp_rank: int
    dp_rank: int
    cp_rank: int
    ep_rank: int
    data_rank: int
    last_checkpoint: Path | None

    def named_parameters(self) -> list[tuple[str, torch.nn.Parameter]]:
        raise NotImplementedError  # the engine's: its parameters under their Hugging Face names

    def model_shard(self) -> dict[str, torch.Tensor]:
        """This rank's weights, Hugging Face names, fp32 on CPU (bf16 values convert exactly); on an ep rank >= 1
        of an MoE model its experts only (ep rank 0's file has the rest). Copies, never views of the live weights
        (fp32 on CPU would otherwise be the parameter itself), so a checkpoint written from them in the background
        holds this step's values while the next steps update the parameters."""
        experts_only = self.config.is_moe and self.dp_rank != 0
        shard = {
            name: p.detach().float().contiguous().to("cpu", copy=True)
            for name, p in self.named_parameters()
            if (not experts_only or ".mlp.experts." in name) and not (self.experts and self.experts.holds(p))
        }
        return shard | (self.experts.weights() if self.experts is not None else {})

    def model_file_name(self) -> str | None:
        """The model file this rank writes into a checkpoint, or None: DP rank 0 and CP rank 0 of each (tp, pp)
        position writes its shard (the other CP ranks hold the same weights); with tp = pp = 1 rank 0 writes the
        whole model as model.safetensors. An MoE model's ep ranks >= 1 of expert-data-parallel rank 0 write their
        experts beside it (checkpoint/weight_shards.py)."""
        if self.cp_rank != 0:
            return None
        if self.dp_rank != 0:
            first_edp = self.dp_rank < self.topology.ep
            return expert_file_name(self.tp_rank, self.pp_rank, self.ep_rank) if first_edp else None
        return shard_file_name(self.tp_rank, self.pp_rank) if self.sharded else FULL_MODEL_FILE

    def model_snapshot(self, metadata: Mapping[str, str]) -> HostFile | None:
        """This rank's model file (if it writes one) as host copies, ready to be written later or elsewhere."""
        name = self.model_file_name()
        if name is None:
            return None
        meta = {**metadata, "tp": str(self.topology.tp), "pp": str(self.topology.pp), "cp": str(self.topology.cp)}
        if self.topology.tp2d > 1:
            meta["tp2d"] = str(self.topology.tp2d)  # the pieces are 2D blocks (checkpoint.weight_shards.join_pieces)
        if self.config.is_moe:
            meta["ep"] = str(self.topology.ep)
        return HostFile(name, self.model_shard(), meta)

    def save_model(self, step_dir: Path, metadata: Mapping[str, str]) -> Path | None:
        """Write this rank's model file (if it writes one); returns its path."""
        self.last_checkpoint = Path(step_dir)
        snapshot = self.model_snapshot(metadata)
        return None if snapshot is None else snapshot.write(Path(step_dir))

    @torch.no_grad()
    def load_model(self, step_dir: Path) -> None:
        """Load this rank's weights from a checkpoint written at any layout (each parameter's slice read from the
        files of the layout that wrote it; at the same layout, its own shard), fp32 master weights included."""
        from deepspeed.utils import safe_set_full_fp32_param

        step_dir = Path(step_dir)
        reader = ShardReader(model_sources(step_dir), what=str(step_dir))
        if self.experts is not None:  # wherever each expert is (an evicted one's parameters are placeholders)
            self.experts.load_weights(lambda name: self._read_piece(reader, name, name))
        for name, param in self.named_parameters():
            if self.experts is not None and self.experts.holds(param):
                continue
            value = self._read_piece(reader, name, name)
            if value.shape != param.shape:
                raise ValueError(
                    f"{step_dir}: {name}: slice {tuple(value.shape)} at tp={self.topology.tp} (written at "
                    f"tp={reader.tp}), parameter {tuple(param.shape)}"
                )
            param.copy_(value)
            # ZeRO and bf16 master weights take the file's fp32 numbers (bf16 weights would round them); the
            # optimizer state's own masters, where saved, replace them in load_optimizer.
            if self.single_replica:
                self.engine.optimizer.set_master(param, value)
            else:
                safe_set_full_fp32_param(param, value)
        self.last_checkpoint = step_dir

    def _read_piece(self, reader: ShardReader, key: str, name: str) -> torch.Tensor:
        """This rank's slice (tp) or block (tp2d) of tensor ``key`` of parameter ``name``."""
        q = self.topology.tp2d
        if q > 1:
            return reader.read_block(key, name, self.tp_rank // q, self.tp_rank % q, q)
        return reader.read(key, name, self.tp_rank, self.topology.tp)

    def optimizer_state(self) -> dict[str, torch.Tensor]:
        """This rank's optimizer state: its TP slice of every parameter's Adam state, whole over DP, keyed
        ``<Hugging Face name>.<state>`` (checkpoint/optimizer_state.py). Collective over the DP group."""
        return optimizer_state(self._dense_named(), self.engine.optimizer) | self._expert_optimizer_state()

    def _dense_named(self) -> list[tuple[str, torch.nn.Parameter]]:
        """The parameters DeepSpeed's optimizer steps: all of them, but the tiered store's experts."""
        experts = self.experts
        return [(n, p) for n, p in self.named_parameters() if experts is None or not experts.holds(p)]

    def _expert_optimizer_state(self) -> dict[str, torch.Tensor]:
        return self.experts.optimizer_state() if self.experts is not None else {}

    def load_optimizer_state(self, state: Mapping[str, torch.Tensor]) -> bool:
        """Load what ``optimizer_state`` returned on a rank of the same (tp, pp) position."""
        dense = load_optimizer_state(self._dense_named(), self.engine.optimizer, state.keys(), lambda k, _: state[k])
        if self.experts is None:
            return dense
        return self.experts.load_optimizer_state(set(state.keys()), lambda k, _: state[k]) or dense

    def optimizer_shard(self) -> dict[str, torch.Tensor]:
        """The optimizer state this rank writes into a checkpoint: that of the parameters ``dp_writers`` gives
        this rank of DeepSpeed's data-parallel group (dp x cp: ZeRO partitions the state over it, and its CP ranks
        hold the same parameters, so they share the writing like DP ranks). Collective over that group: call it on
        every rank before anything that may fail on one."""
        named = self._dense_named()
        # The tiered store's experts: written, as DeepSpeed's are, by expert-data-parallel rank 0 (dp ranks < ep).
        stored = self._expert_optimizer_state() if self.dp_rank < self.topology.ep else {}
        if self.config.is_moe and self.topology.ep > 1:
            # Each ep rank holds other experts: the dense parameters are shared out over dp as usual, and each
            # ep rank's experts are written by its expert-data-parallel rank 0 (dp ranks 0 .. ep - 1) at CP rank 0
            # (the other CP ranks hold the same experts).
            dense = [(n, p) for n, p in named if ".mlp.experts." not in n]
            writers = dp_writers(dense, self.topology.dp * self.topology.cp)
            first_edp = self.dp_rank < self.topology.ep and self.cp_rank == 0
            return (
                optimizer_state(
                    named,
                    self.engine.optimizer,
                    keep=lambda name: writers[name] == self.data_rank if name in writers else first_edp,
                )
                | stored
            )
        writers = dp_writers(named, self.topology.dp * self.topology.cp)
        return optimizer_state(named, self.engine.optimizer, keep=lambda name: writers[name] == self.data_rank) | stored

    def optimizer_snapshot(self, shard: Mapping[str, torch.Tensor], metadata: Mapping[str, str]) -> HostFile | None:
        """``optimizer_shard()``'s result (host copies) as this rank's optimizer file, or None when this rank has
        nothing to write."""
        if not shard:
            return None
        topology = self.topology
        meta = {
            **metadata,
            "tp": str(topology.tp),
            "pp": str(topology.pp),
            "dp": str(topology.dp),
            "cp": str(topology.cp),
        } | ({"tp2d": str(topology.tp2d)} if topology.tp2d > 1 else {})
        return HostFile(optimizer_file_name(self.tp_rank, self.pp_rank, self.data_rank), dict(shard), meta)

    def save_optimizer(
        self, step_dir: Path, shard: Mapping[str, torch.Tensor], metadata: Mapping[str, str]
    ) -> Path | None:
        """Write ``optimizer_shard()``'s result; returns the file, or None when this rank has nothing to write."""
        snapshot = self.optimizer_snapshot(shard, metadata)
        return None if snapshot is None else snapshot.write(Path(step_dir))

    def load_optimizer(self, step_dir: Path) -> bool:
        """Load the optimizer state saved by ``save_optimizer`` at any layout (local, no collective). Returns
        False when the checkpoint holds none (written before the first step): the optimizer stays fresh."""
        files = optimizer_files(step_dir)
        if not files:
            return False
        reader = ShardReader(files, what=f"{step_dir} optimizer state")
        dense = load_optimizer_state(
            self._dense_named(),
            self.engine.optimizer,
            reader.keys(),
            lambda k, n: self._read_piece(reader, k, n),
        )
        if self.experts is None:
            return dense
        return (
            self.experts.load_optimizer_state(set(reader.keys()), lambda k, n: self._read_piece(reader, k, n)) or dense
        )
