"""Where every rank sits on the grid of named parallel axes, and the process groups along them.

The axes are data: ``ParallelTopology.axes`` is an ordered tuple of ``(name, size)``, outermost first,

    (("pp", pp), ("dp", dp), ("cp", cp), ("tp", tp))

and every coordinate, group and world size is derived from it by one row-major rule, so no axis has code of its own.
Rank order, innermost first: tensor parallel (TP), then context parallel (CP), then data parallel (DP), then
pipeline parallel (PP):

    global_rank = ((pp_rank * dp + dp_rank) * cp + cp_rank) * tp + tp_rank

With cp = 1 (the default) this is ``pp_rank * (dp * tp) + dp_rank * tp + tp_rank``, the order BLOOM-176B was trained
with (Megatron-DeepSpeed) and the one DeepSpeed's ``PipeModelDataParallelTopology(num_pp, num_mp, num_dp)`` lays
out: its axes are ``['pipe', 'data', 'model']`` in row-major order, so the last axis ('model' = TP) varies fastest.
A unit test compares both maps rank by rank, so checkpoints and shard names keep their meaning.

Why this order. TP is innermost because its all-reduces run twice per transformer layer in both passes and must stay
on the fast links inside a node (consecutive ranks share a node under every launcher). CP comes next, as in
Megatron-Core's tp-cp-dp-pp: its all-to-all or ring exchanges of keys and values run in every attention layer, more
often than anything but TP. DP follows so that one stage's gradient all-reduce spans as few nodes as possible; PP is
outermost because it only sends one activation per micro-batch to a neighbour.

Data-parallel gradient reduction runs over dp x cp. CP ranks hold the same weights and each sees a slice of every
sequence, so their gradients are partial sums exactly like DP ranks': the group that averages gradients is
``dp_cp`` (same pp and tp; dp and cp vary). Because cp sits right inside dp, that group's ranks in row-major order
are DeepSpeed's 'data' axis of size dp * cp: ``to_deepspeed()`` hands DeepSpeed ``num_dp = dp * cp`` and
``TopologyMPU`` (``step/grads.py``) answers DeepSpeed's data-parallel questions from ``dp_cp``. With cp = 1, ``dp_cp``
is the ``dp`` group itself (the same handle). The model-parallel group ``mp`` stays TP x PP: CP ranks hold
identical gradients after that reduction, so the global norm needs only one replica's shards.

Expert parallelism (ep) folds inside dp, Megatron/DeepSpeed style, and adds no rank: dp = edp * ep with
``dp_rank = edp_rank * ep + ep_rank``, so the ep ranks of one expert group are consecutive DP ranks. ``ep`` groups
(same pp, cp, tp, edp) split the experts; ``edp`` groups (expert-data-parallel, size dp / ep) reduce the experts'
gradients. ep = 1 makes ``ep`` groups single ranks and ``edp`` the ``dp`` group. Experts are replicated over cp
too (each CP rank routes its own slice of the sequences through the same experts), so their gradients are partial
sums over cp exactly like the dense ones: ``edp_cp`` groups (same pp, tp, ep; edp and cp vary, size dp / ep * cp)
reduce them, and are DeepSpeed's expert-data-parallel groups (experts.parallel.register_expert_groups). With
cp = 1, ``edp_cp`` is the ``edp`` group itself (the same handle).

2D tensor parallelism (Optimus, ``tp2d = q``) keeps the tp axis, of q * q ranks, and splits it into a mesh:
``tp_rank = mesh_row * q + mesh_col``, so the mesh's ranks stay consecutive and every group built on tp (``tp``,
``mp``, DeepSpeed's 'model' axis) means the whole mesh. ``tp_row`` groups (same mesh row, the ranks that hold the
other hidden slices of the same tokens) and ``tp_col`` groups (same mesh column, the other batch slices) are the
SUMMA broadcast groups (parallel/tensor2d/summa.py). A 1D layout is a 1 x tp mesh: ``tp_row`` is ``tp``, ``tp_col``
single.

Axes of size 1 cost nothing: a group whose ranks equal an already created group's reuses its handle, and a group of
one rank is this process's own single-member group, created locally without a collective over the world.

Adding an axis (the seam). Touch three places, not the modules that only use tp, pp and dp:
1. the planner, which chooses its degree (``planner/layout.py``; a layout key only once the axis works end to end);
2. this object: a field with default 1, its place in ``axes`` (or ``_grid`` for an axis folded inside another,
   like ep), and the groups that vary it in ``GROUPS``; ``init_process_groups`` then creates them;
3. the code that uses the new axis, which asks ``group(name)``, ``coordinate(name, rank)`` and ``size(name)``.
Code written against ``tp``/``pp``/``dp`` keeps working, because an axis of size 1 changes no rank and no group.
With cp > 1 the batch arithmetic still counts sequences over dp (the sampler deals by the dp coordinate, so every
CP rank of a DP rank gets the same sequences, and the engine keeps each one's slice: parallel/context/training.py);
DeepSpeed, whose data axis is dp x cp, is told a batch of global batch x cp slices, and the reported loss is the mean
over ``dp_cp``.

Only the planner chooses the degrees; this object only checks them and answers questions about them.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple

import torch.distributed as dist

from appliance.errors import BadInput
from appliance.planner.layout import Layout

if TYPE_CHECKING:
    from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology

# Each named group and the grid axes that vary inside it (the others are fixed). Creation order is this order, and
# ``dist.new_group`` is collective over the world, so the order must be the same on every rank; "dp" stands for
# the two grid axes edp and ep it is made of.
GROUPS: dict[str, tuple[str, ...]] = {
    "tp": ("tp",),
    "dp": ("dp",),
    "pp": ("pp",),
    "mp": ("pp", "tp"),  # one model replica: the global gradient norm is summed over it
    "cp": ("cp",),
    "dp_cp": ("dp", "cp"),  # data-parallel gradient reduction, DeepSpeed's data axis
    "ep": ("ep",),
    "edp": ("edp",),  # expert-data-parallel: the ranks holding the same experts at one cp coordinate
    "edp_cp": ("edp", "cp"),  # expert gradient reduction: the experts' replicas over edp and cp
    # 2D tensor parallel (tp2d = q): the tp axis is a q x q mesh, tp_rank = mesh_row * q + mesh_col.
    "tp_row": ("mesh_col",),  # one mesh row: the ranks holding the other hidden slices of the same tokens
    "tp_col": ("mesh_row",),  # one mesh column: the ranks holding the other batch slices of the same hidden slice
}


class RankCoords(NamedTuple):
    """Coordinates of one global rank on DeepSpeed's axes, outermost first (pipe, data, model).

    ``dp`` is the data-parallel coordinate proper; the cp coordinate and the expert coordinates are in
    ``ParallelTopology.coordinates()``.
    """

    pp: int
    dp: int
    tp: int


@dataclass
class ParallelTopology:
    """A validated layout over ``world_size`` ranks; process groups once ``init_process_groups()`` ran."""

    tp: int
    pp: int
    dp: int
    world_size: int
    cp: int = 1
    ep: int = 1
    tp2d: int = 1  # q > 1: the tp ranks form a q x q mesh (Optimus 2D tensor parallelism), tp = q * q
    _groups: dict[str, dist.ProcessGroup] | None = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        for name, value in (*self._named_degrees(), ("world size", self.world_size)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise BadInput(f"parallel layout: {name} must be a positive integer, got {value!r}")
        if self.dp % self.ep != 0:
            raise BadInput(f"parallel layout: dp({self.dp}) % ep({self.ep}) != 0 (expert parallelism folds inside dp)")
        if self.tp2d > 1 and self.tp != self.tp2d * self.tp2d:
            raise BadInput(
                f"parallel layout: tp2d({self.tp2d}) makes a {self.tp2d} x {self.tp2d} mesh of tp ranks, so tp must be "
                f"{self.tp2d * self.tp2d}, got tp({self.tp})"
            )
        if self.product != self.world_size:
            raise BadInput(f"parallel layout: {self.factors} = {self.product} != world size {self.world_size}")

    def _named_degrees(self) -> tuple[tuple[str, int], ...]:
        return (
            ("tp", self.tp), ("pp", self.pp), ("dp", self.dp), ("cp", self.cp), ("ep", self.ep), ("tp2d", self.tp2d)
        )  # fmt: skip

    @classmethod
    def from_layout(cls, layout: Layout, *, world_size: int) -> ParallelTopology:
        """The rank grid of the planner's layout over ``world_size`` ranks: the one way a layout becomes a topology.
        The tp axis is the layout's tensor-parallel ranks (``tp_ranks``: tp, or the tp2d x tp2d mesh)."""
        return cls(
            tp=layout.tp_ranks,
            pp=layout.pp,
            dp=layout.dp,
            cp=layout.cp,
            tp2d=layout.tp2d,
            ep=layout.ep,
            world_size=world_size,
        )

    @classmethod
    def from_process_group(
        cls, *, tp: int, pp: int, dp: int, cp: int = 1, ep: int = 1, tp2d: int = 1
    ) -> ParallelTopology:
        """The layout over the already initialized default process group, with its groups created."""
        if not dist.is_initialized():
            raise RuntimeError("torch.distributed is not initialized: call init_process_group first")
        topology = cls(tp=tp, pp=pp, dp=dp, cp=cp, ep=ep, tp2d=tp2d, world_size=dist.get_world_size())
        topology.init_process_groups()
        return topology

    def validate_heads(self, heads: int) -> None:
        """Each TP rank owns heads / tp whole attention heads (and the matching ALiBi slopes); with tp2d = q each
        mesh column owns heads / q of them."""
        if self.tp2d > 1:
            if heads % self.tp2d != 0:
                raise BadInput(
                    f"parallel layout: heads({heads}) % tp2d({self.tp2d}) != 0 (heads split over mesh columns)"
                )
            return
        if heads % self.tp != 0:
            raise BadInput(f"parallel layout: heads({heads}) % tp({self.tp}) != 0")

    # ---- the axes ----

    @property
    def axes(self) -> tuple[tuple[str, int], ...]:
        """The axes that multiply to the world size, ``(name, size)`` outermost first: the rank order."""
        return (("pp", self.pp), ("dp", self.dp), ("cp", self.cp), ("tp", self.tp))

    def _grid(self) -> tuple[tuple[str, int], ...]:
        """``axes`` with dp split into (edp, ep), ep innermost, and tp into the mesh (mesh_row, mesh_col): the
        finest grid, same rank order. A 1D layout is a 1 x tp mesh (mesh_row of size 1 costs nothing)."""
        rows = self.tp2d if self.tp2d > 1 else 1
        return (
            ("pp", self.pp), ("edp", self.dp // self.ep), ("ep", self.ep), ("cp", self.cp),
            ("mesh_row", rows), ("mesh_col", self.tp // rows),
        )  # fmt: skip

    @property
    def product(self) -> int:
        total = 1
        for _, size in self.axes:
            total *= size
        return total

    @property
    def factors(self) -> str:
        """The world size's factors for messages, e.g. ``tp(4) * pp(12) * dp(8)``; cp appears once it is above 1."""
        shown = [("tp", self.tp), ("pp", self.pp), ("dp", self.dp)] + ([("cp", self.cp)] if self.cp > 1 else [])
        text = " * ".join(f"{name}({size})" for name, size in shown)
        return text.replace(f"tp({self.tp})", f"tp2d({self.tp2d})^2", 1) if self.tp2d > 1 else text

    def size(self, name: str) -> int:
        """The number of ranks in one group ``name`` (an axis or a key of ``GROUPS``)."""
        if name not in GROUPS:
            raise ValueError(f"unknown group {name!r}: expected one of {list(GROUPS)}")
        sizes = dict(self._grid())
        total = 1
        for axis in self._varying(name):
            total *= sizes[axis]
        return total

    # ---- rank arithmetic (no process group needed) ----

    def coordinates(self, rank: int) -> dict[str, int]:
        """Every coordinate of ``rank``: pp, dp, cp, tp, the expert split of dp (edp, ep) and, with tp2d > 1, the
        mesh position of tp (mesh_row, mesh_col)."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside world size {self.world_size}")
        found: dict[str, int] = {}
        for name, size in reversed(self._grid()):  # innermost first: peel the fastest-varying coordinate off
            rank, found[name] = divmod(rank, size)
        found["dp"] = found["edp"] * self.ep + found["ep"]
        found["tp"] = found["mesh_row"] * dict(self._grid())["mesh_col"] + found["mesh_col"]
        if self.tp2d == 1:  # a 1 x tp mesh: its coordinates are tp's own
            del found["mesh_row"], found["mesh_col"]
        return found

    def coordinate(self, name: str, rank: int) -> int:
        coordinates = self.coordinates(rank)
        if name not in coordinates:
            raise ValueError(f"unknown axis {name!r}: expected one of {sorted(coordinates)}")
        return coordinates[name]

    def coords(self, rank: int) -> RankCoords:
        found = self.coordinates(rank)
        return RankCoords(pp=found["pp"], dp=found["dp"], tp=found["tp"])

    def global_rank(self, **coordinates: int) -> int:
        """The rank at ``coordinates`` (keywords pp, dp, cp, tp); an axis of size 1 may be left out (it is 0)."""
        sizes = dict(self.axes)
        unknown = sorted(set(coordinates) - set(sizes))
        missing = [name for name, size in self.axes if size > 1 and name not in coordinates]
        if unknown or missing:
            raise ValueError(f"coordinates {coordinates}: unknown axes {unknown}, missing axes {missing}")
        rank = 0
        for name, size in self.axes:
            value = coordinates.get(name, 0)
            if not 0 <= value < size:
                shown = " ".join(f"{n}={v}" for n, v in coordinates.items())
                raise ValueError(f"coordinates {shown} are outside {self.factors}")
            rank = rank * size + value
        return rank

    def rank_with(self, rank: int, **changes: int) -> int:
        """The rank that sits where ``rank`` does except on the axes in ``changes`` (e.g. another pipeline stage)."""
        found = self.coordinates(rank)
        return self.global_rank(**{name: changes.get(name, found[name]) for name, _ in self.axes})

    def tp_rank(self, rank: int) -> int:
        return self.coordinate("tp", rank)

    def dp_rank(self, rank: int) -> int:
        return self.coordinate("dp", rank)

    def pp_rank(self, rank: int) -> int:
        return self.coordinate("pp", rank)

    def cp_rank(self, rank: int) -> int:
        return self.coordinate("cp", rank)

    def _varying(self, name: str) -> tuple[str, ...]:
        split = {"dp": ("edp", "ep"), "tp": ("mesh_row", "mesh_col")}
        return tuple(axis for entry in GROUPS[name] for axis in split.get(entry, (entry,)))

    def groups(self, name: str) -> list[list[int]]:
        """Every group ``name`` (a key of ``GROUPS``) as ascending rank lists, ordered as DeepSpeed's
        ``get_axis_comm_lists`` orders them: row-major over the fixed axes."""
        if name not in GROUPS:
            raise ValueError(f"unknown group {name!r}: expected one of {list(GROUPS)}")
        varying = set(self._varying(name))
        grid = self._grid()
        strides: dict[str, int] = {}
        stride = 1
        for axis, size in reversed(grid):
            strides[axis] = stride
            stride *= size
        fixed = [(axis, size) for axis, size in grid if axis not in varying]
        moving = [(axis, size) for axis, size in grid if axis in varying]
        lists = []
        for base in itertools.product(*(range(size) for _, size in fixed)):
            origin = sum(value * strides[axis] for (axis, _), value in zip(fixed, base, strict=True))
            lists.append(
                [
                    origin + sum(value * strides[axis] for (axis, _), value in zip(moving, offset, strict=True))
                    for offset in itertools.product(*(range(size) for _, size in moving))
                ]
            )
        return lists

    def group_ranks(self, name: str, rank: int) -> list[int]:
        """The ranks of ``rank``'s group ``name`` (a key of ``GROUPS``)."""
        return next(ranks for ranks in self.groups(name) if rank in ranks)

    def tp_groups(self) -> list[list[int]]:
        """Ranks that split one layer's weights: consecutive global ranks."""
        return self.groups("tp")

    def dp_groups(self) -> list[list[int]]:
        """Ranks that hold the same weights and the same sequence slice: stride cp * tp."""
        return self.groups("dp")

    def pp_groups(self) -> list[list[int]]:
        """One pipeline, one rank per stage: stride dp * cp * tp."""
        return self.groups("pp")

    def mp_groups(self) -> list[list[int]]:
        """One full model replica (TP x PP) per (dp, cp) rank. After the gradient reduction over dp x cp every
        replica holds the same gradients, so the global gradient norm is the sum of squares over this group only
        (replicated parameters counted once, on tp rank 0), square-rooted: no collective over the world."""
        return self.groups("mp")

    def to_deepspeed(self) -> PipeModelDataParallelTopology:
        """The same layout as DeepSpeed's topology object, for ``PipelineModule(topology=...)``. DeepSpeed's 'data'
        axis is dp x cp (its data-parallel groups reduce gradients), which are adjacent in the rank order."""
        from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology

        return PipeModelDataParallelTopology(num_pp=self.pp, num_mp=self.tp, num_dp=self.dp * self.cp)

    # ---- process groups ----

    def init_process_groups(self) -> None:
        """Create every group of ``GROUPS``, once. Collective: every rank must call it.

        ``dist.new_group`` is itself collective over the whole world: every rank must create every group, in the
        same order, even the groups it is not a member of, or the ranks pair up the wrong groups and hang. So each
        rank walks the same lists in the same order and keeps the handle of its own group. A list of groups equal
        to one already created reuses its handles; groups of one rank (an axis of size 1) are the process's own
        single-member group, created locally (``use_local_synchronization`` needs only the members to call it).
        """
        if self._groups is not None:
            return
        if not dist.is_initialized():
            raise RuntimeError("torch.distributed is not initialized: call init_process_group first")
        if dist.get_world_size() != self.world_size:
            raise BadInput(
                f"parallel layout: {self.factors} = {self.world_size} != launched world size {dist.get_world_size()}"
            )
        me = dist.get_rank()
        created: dict[tuple[tuple[int, ...], ...], dist.ProcessGroup] = {}
        mine: dict[str, dist.ProcessGroup] = {}
        for name in GROUPS:
            lists = self.groups(name)
            key = tuple(tuple(ranks) for ranks in lists)
            if key not in created:
                if all(len(ranks) == 1 for ranks in lists):
                    created[key] = dist.new_group(ranks=[me], use_local_synchronization=True)
                else:
                    for ranks in lists:
                        group = dist.new_group(ranks=ranks)
                        if me in ranks:
                            created[key] = group
            mine[name] = created[key]
        self._groups = mine

    def group(self, name: str) -> dist.ProcessGroup:
        """This process's group ``name`` (a key of ``GROUPS``)."""
        if self._groups is None:
            raise RuntimeError(
                "process groups are not created: call ParallelTopology.init_process_groups() on every rank"
            )
        if name not in self._groups:
            raise ValueError(f"unknown group {name!r}: expected one of {list(self._groups)}")
        return self._groups[name]

    @property
    def tp_group(self) -> dist.ProcessGroup:
        return self.group("tp")

    @property
    def dp_group(self) -> dist.ProcessGroup:
        return self.group("dp")

    @property
    def pp_group(self) -> dist.ProcessGroup:
        return self.group("pp")

    @property
    def mp_group(self) -> dist.ProcessGroup:
        """Model-parallel group (TP x PP of one replica), for the global gradient norm."""
        return self.group("mp")

    @property
    def cp_group(self) -> dist.ProcessGroup:
        return self.group("cp")

    @property
    def tp_row_group(self) -> dist.ProcessGroup:
        """tp2d: this rank's mesh row (hidden slices of the same tokens); at tp2d = 1 the tp group."""
        return self.group("tp_row")

    @property
    def tp_col_group(self) -> dist.ProcessGroup:
        """tp2d: this rank's mesh column (batch slices of the same hidden slice); at tp2d = 1 this rank alone."""
        return self.group("tp_col")

    @property
    def dp_cp_group(self) -> dist.ProcessGroup:
        """The group that reduces gradients over dp x cp: DeepSpeed's data-parallel group."""
        return self.group("dp_cp")
