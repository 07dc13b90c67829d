"""The roles of a layout: the pipeline stages whose ranks differ in what they hold. Every tp, dp, cp and ep rank of
a stage holds tensors of the same shapes (its own shard of each), so one rank stands for all of them."""

from __future__ import annotations

from dataclasses import dataclass

from appliance.parallel.topology import ParallelTopology
from appliance.planner.layout import Layout


@dataclass(frozen=True)
class Role:
    name: str  # "whole" (pp = 1), "first", "middle" or "last"
    stage: int  # the pipeline stage of the rank built for it
    stages: tuple[int, ...]  # every stage it stands for
    rank: int  # the global rank built: the lowest of its stage
    ranks: tuple[int, ...]  # every rank it stands for

    def describe(self) -> str:
        stages = f"stage {self.stages[0]}" if len(self.stages) == 1 else f"stages {self.stages[0]}-{self.stages[-1]}"
        return f"{self.name} ({stages}, {len(self.ranks)} rank(s), built as rank {self.rank})"


def roles(layout: Layout) -> list[Role]:
    """pp = 1: one role, the whole model; pp = 2: first and last; pp >= 3: first, middle and last. The middle role
    is built from stage 1: 1F1B keeps p - i micro-batches in flight on stage i, so stage 1 holds the most of the
    middle stages (planner/memory.py compares the same three)."""
    topology = ParallelTopology.from_layout(layout, world_size=layout.world_size)
    p = topology.pp
    named = [("whole", (0,))] if p == 1 else [("first", (0,)), ("middle", tuple(range(1, p - 1))), ("last", (p - 1,))]
    found = []
    for name, stages in named:
        if not stages:  # pp = 2: no middle stage
            continue
        ranks = tuple(r for r in range(topology.world_size) if topology.pp_rank(r) in stages)
        stage = stages[0]
        rank = min(r for r in ranks if topology.pp_rank(r) == stage)
        found.append(Role(name, stage, stages, rank, ranks))
    return found
