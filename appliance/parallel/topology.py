"""Where every rank sits in the (pipeline, data, tensor) grid, and the process groups along each axis.

Rank order, innermost first: tensor parallel (TP), then data parallel (DP), then pipeline parallel (PP):

    global_rank = pp_rank * (dp * tp) + dp_rank * tp + tp_rank

TP is innermost because its all-reduces run twice per transformer layer in both passes and must stay on the
fast links inside a node (consecutive ranks share a node under every launcher). DP comes next so that a DP
all-reduce of one stage spans as few nodes as possible; PP is outermost because it only sends one activation
per micro-batch to a neighbour. This is the order BLOOM-176B was trained with (Megatron-DeepSpeed) and the one
DeepSpeed's ``PipeModelDataParallelTopology(num_pp, num_mp, num_dp)`` lays out: its axes are
``['pipe', 'data', 'model']`` in row-major order, so the last axis ('model' = TP) varies fastest. Mirroring it
exactly (``to_deepspeed()`` builds the DeepSpeed object, and a unit test compares both maps rank by rank) lets
a DeepSpeed ``PipelineModule`` be given the same layout later without any rank landing somewhere else.

Only the planner chooses the degrees; this object only checks them and answers questions about them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NamedTuple

import torch.distributed as dist

from appliance.errors import BadInput

if TYPE_CHECKING:
    from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology


class RankCoords(NamedTuple):
    """Coordinates of one global rank, outermost axis first (the order of DeepSpeed's axes)."""

    pp: int
    dp: int
    tp: int


@dataclass
class _Groups:
    """This process's handles on the groups it belongs to (one per axis, plus TP x PP)."""

    tp: dist.ProcessGroup
    dp: dist.ProcessGroup
    pp: dist.ProcessGroup
    mp: dist.ProcessGroup


@dataclass
class ParallelTopology:
    """A validated (tp, pp, dp) layout over ``world_size`` ranks; process groups once ``init_process_groups()`` ran."""

    tp: int
    pp: int
    dp: int
    world_size: int
    _groups: _Groups | None = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        for name, value in (("tp", self.tp), ("pp", self.pp), ("dp", self.dp), ("world size", self.world_size)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise BadInput(f"parallel layout: {name} must be a positive integer, got {value!r}")
        product = self.tp * self.pp * self.dp
        if product != self.world_size:
            raise BadInput(
                f"parallel layout: tp({self.tp}) * pp({self.pp}) * dp({self.dp}) = {product} "
                f"!= world size {self.world_size}"
            )

    @classmethod
    def from_process_group(cls, *, tp: int, pp: int, dp: int) -> ParallelTopology:
        """The layout over the already initialized default process group, with its groups created."""
        if not dist.is_initialized():
            raise RuntimeError("torch.distributed is not initialized: call init_process_group first")
        topology = cls(tp=tp, pp=pp, dp=dp, world_size=dist.get_world_size())
        topology.init_process_groups()
        return topology

    def validate_heads(self, heads: int) -> None:
        """Each TP rank owns heads / tp whole attention heads (and the matching ALiBi slopes)."""
        if heads % self.tp != 0:
            raise BadInput(f"parallel layout: heads({heads}) % tp({self.tp}) != 0")

    # ---- rank arithmetic (no process group needed) ----

    def coords(self, rank: int) -> RankCoords:
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside world size {self.world_size}")
        pp_rank, rest = divmod(rank, self.dp * self.tp)
        dp_rank, tp_rank = divmod(rest, self.tp)
        return RankCoords(pp=pp_rank, dp=dp_rank, tp=tp_rank)

    def global_rank(self, *, pp: int, dp: int, tp: int) -> int:
        if not (0 <= pp < self.pp and 0 <= dp < self.dp and 0 <= tp < self.tp):
            raise ValueError(
                f"coordinates pp={pp} dp={dp} tp={tp} are outside tp({self.tp}) pp({self.pp}) dp({self.dp})"
            )
        return (pp * self.dp + dp) * self.tp + tp

    def tp_rank(self, rank: int) -> int:
        return self.coords(rank).tp

    def dp_rank(self, rank: int) -> int:
        return self.coords(rank).dp

    def pp_rank(self, rank: int) -> int:
        return self.coords(rank).pp

    def tp_groups(self) -> list[list[int]]:
        """Ranks that split one layer's weights: same (pp, dp), consecutive global ranks."""
        return [
            [self.global_rank(pp=p, dp=d, tp=t) for t in range(self.tp)] for p in range(self.pp) for d in range(self.dp)
        ]

    def dp_groups(self) -> list[list[int]]:
        """Ranks that hold the same weights and all-reduce their gradients: same (pp, tp), stride tp."""
        return [
            [self.global_rank(pp=p, dp=d, tp=t) for d in range(self.dp)] for p in range(self.pp) for t in range(self.tp)
        ]

    def pp_groups(self) -> list[list[int]]:
        """One pipeline: same (dp, tp), one rank per stage, stride dp * tp."""
        return [
            [self.global_rank(pp=p, dp=d, tp=t) for p in range(self.pp)] for d in range(self.dp) for t in range(self.tp)
        ]

    def mp_groups(self) -> list[list[int]]:
        """One full model replica (TP x PP) per DP rank. After the DP all-reduce every replica holds the same
        gradients, so the global gradient norm is the sum of squares over this group only (replicated
        parameters counted once, on tp rank 0), square-rooted: no collective over the whole world is needed."""
        return [
            sorted(self.global_rank(pp=p, dp=d, tp=t) for p in range(self.pp) for t in range(self.tp))
            for d in range(self.dp)
        ]

    def group_ranks(self, axis: str, rank: int) -> list[int]:
        """The ranks of ``rank``'s group along ``axis`` ('tp', 'dp', 'pp' or 'mp')."""
        lists = {"tp": self.tp_groups, "dp": self.dp_groups, "pp": self.pp_groups, "mp": self.mp_groups}
        if axis not in lists:
            raise ValueError(f"unknown axis {axis!r}: expected one of {sorted(lists)}")
        return next(ranks for ranks in lists[axis]() if rank in ranks)

    def to_deepspeed(self) -> PipeModelDataParallelTopology:
        """The same layout as DeepSpeed's topology object, for ``PipelineModule(topology=...)``."""
        from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology

        return PipeModelDataParallelTopology(num_pp=self.pp, num_mp=self.tp, num_dp=self.dp)

    # ---- process groups ----

    def init_process_groups(self) -> None:
        """Create every TP, DP, PP and TP x PP group, once. Collective: every rank must call it.

        ``dist.new_group`` is itself collective over the whole world: every rank must create every group, in
        the same order, even the groups it is not a member of, or the ranks pair up the wrong groups and hang.
        So each rank walks the same four lists in the same order and keeps the handle of its own group.
        """
        if self._groups is not None:
            return
        if not dist.is_initialized():
            raise RuntimeError("torch.distributed is not initialized: call init_process_group first")
        if dist.get_world_size() != self.world_size:
            raise BadInput(
                f"parallel layout: tp({self.tp}) * pp({self.pp}) * dp({self.dp}) = {self.world_size} "
                f"!= launched world size {dist.get_world_size()}"
            )
        me = dist.get_rank()
        mine: dict[str, Any] = {}
        for axis, lists in (
            ("tp", self.tp_groups()),
            ("dp", self.dp_groups()),
            ("pp", self.pp_groups()),
            ("mp", self.mp_groups()),
        ):
            for ranks in lists:
                group = dist.new_group(ranks=ranks)
                if me in ranks:
                    mine[axis] = group
        self._groups = _Groups(**mine)

    def _require_groups(self) -> _Groups:
        if self._groups is None:
            raise RuntimeError(
                "process groups are not created: call ParallelTopology.init_process_groups() on every rank"
            )
        return self._groups

    @property
    def tp_group(self) -> dist.ProcessGroup:
        return self._require_groups().tp

    @property
    def dp_group(self) -> dist.ProcessGroup:
        return self._require_groups().dp

    @property
    def pp_group(self) -> dist.ProcessGroup:
        return self._require_groups().pp

    @property
    def mp_group(self) -> dist.ProcessGroup:
        """Model-parallel group (TP x PP of one DP replica), for the global gradient norm."""
        return self._require_groups().mp
