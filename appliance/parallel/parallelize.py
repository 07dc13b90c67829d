"""Applying the layout's parallelism to the plain BLOOM pieces (model/bloom.py), one function per technique.

The model is written for one process; this module is the only place that decides what each rank's pieces become.
pipeline/specs.py builds its layers through it (``Parallelism``, handed to every layer spec), so the pipeline
engine and the pp = 1 BloomStack make the same decisions. The order, and why:

1. Tensor parallel (+ sequence parallel): ``linear_factory`` and ``embedding_kwargs``. It comes first because it
   is structural: the linears are *built* column/row-parallel (the model takes a factory), which fixes the heads
   (and ALiBi slopes) this rank owns; sequence parallelism lives inside those same layers (the column-parallel
   QKV gathers the sequence chunks, the row-parallel output reduce-scatters them). With tp2d > 1 (a q x q mesh,
   tensor2d/layers2d.py) every linear is a SUMMA product, the heads split over the mesh columns (``head_split``), and
   the LayerNorms reduce their statistics along the mesh row (``layer_norm``, and in ``parallelize_block``).
2. Context parallel: ``apply_context_parallel`` replaces a block's attention core, after TP, because it works on
   this TP rank's heads and on the CP-local sequence the QKV projection returns (with sequence parallelism, after
   its gather over TP). Which tokens a CP rank holds, and the loss over them, are context/training.py's.
3. Recompute: it wraps whatever the first two produced (selective: the attention core, CP's collectives
   included, runs again in the backward pass; full: the whole block, in the pipeline's checkpoint interval or
   BloomStack's forward), so it must see the finished block.
4. Compile last (``compile_blocks``, the run setting ``compile``), as torchtitan compiles after TP and activation
   checkpointing: torch.compile traces the block as the steps before left it, so the graph holds the TP/SP
   collectives and selective recompute's checkpoint region, and what the steps before install must already be
   there. Full recompute stays outside: the pipeline's checkpoint (or BloomStack's) calls the compiled block, and
   runs it again in the backward pass. Each transformer block is compiled on its own ("regional" compile): the
   blocks are alike, so one graph serves them all and compiling costs one block's trace, not the model's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from appliance.errors import BadInput
from appliance.model.bloom import BloomBlock
from appliance.model.linear import LinearFactory
from appliance.model.mlp import BloomMLP
from appliance.parallel.context.training import ContextParallelCore
from appliance.parallel.tensor.layers import tp_linear_factory
from appliance.parallel.tensor2d.layers2d import Mesh2D, layer_norm_2d, tp2d_linear_factory
from appliance.parallel.topology import ParallelTopology
from appliance.planner.layout import CP_MODES
from appliance.planner.model_shape import RECOMPUTE_MODES

SEQUENCE_DIM = 1  # activations are [batch, seq, hidden] (the transformers layout)


@dataclass(frozen=True)
class Parallelism:
    """What this rank applies to the model's pieces: the topology's groups and the layout's switches."""

    topology: ParallelTopology
    sequence_parallel: bool = False
    recompute: str = "none"
    cp_mode: str = "ulysses"

    def __post_init__(self) -> None:
        if self.recompute not in RECOMPUTE_MODES:
            raise ValueError(f"recompute must be one of {RECOMPUTE_MODES}, got {self.recompute!r}")
        if self.cp_mode not in CP_MODES:
            raise ValueError(f"cp_mode must be one of {CP_MODES}, got {self.cp_mode!r}")

    @property
    def tp_rank(self) -> int:
        return dist.get_rank(self.topology.tp_group)

    @property
    def mesh(self) -> Mesh2D | None:
        """The q x q tp mesh with tp2d > 1, else None."""
        return Mesh2D.of(self.topology) if self.topology.tp2d > 1 else None

    @property
    def head_split(self) -> tuple[int, int]:
        """(index, parts) of the attention heads this rank runs (and their ALiBi slopes): its tp rank of tp, or
        with tp2d its mesh column of q."""
        mesh = self.mesh
        return (mesh.col, mesh.q) if mesh is not None else (self.tp_rank, self.topology.tp)

    # ---- 1. tensor parallel (+ sequence parallel) ----

    def linear_factory(self) -> LinearFactory:
        """The blocks' linears: column/row-parallel over TP (plain nn.Linear at tp = 1), SUMMA with tp2d."""
        if self.mesh is not None:
            return tp2d_linear_factory(self.mesh)
        return tp_linear_factory(self.topology, sequence_parallel=self.sequence_parallel, sequence_dim=SEQUENCE_DIM)

    def layer_norm(self, hidden: int, eps: float) -> nn.LayerNorm:
        """A LayerNorm of the pieces: the model's own, or with tp2d one reducing its statistics along the mesh row."""
        return layer_norm_2d(hidden, eps, self.mesh) if self.mesh is not None else nn.LayerNorm(hidden, eps=eps)

    def embedding_kwargs(self) -> dict[str, Any]:
        """VocabParallelEmbedding's split: vocabulary rows over TP, output reduce-scattered into sequence chunks
        with sequence parallelism."""
        return {"group": self.topology.tp_group, "sequence_parallel": self.sequence_parallel,
                "sequence_dim": SEQUENCE_DIM}  # fmt: skip

    # ---- 3. recompute ----

    @property
    def full_recompute(self) -> bool:
        """Whole blocks recomputed in the backward pass (BLOOM's --checkpoint-activations, one block per checkpoint)."""
        return self.recompute == "full"

    def parallelize_block(self, block: BloomBlock) -> None:
        """The LayerNorms of step 1 (tp2d), then steps 2 and 3 on one block built with ``linear_factory``."""
        if self.mesh is not None:
            hidden, eps = block.config.hidden_size, block.config.layer_norm_epsilon
            block.input_layernorm = self.layer_norm(hidden, eps)
            block.post_attention_layernorm = self.layer_norm(hidden, eps)
        if self.topology.cp > 1:
            apply_context_parallel(block, ContextParallelCore(self.topology.cp_group, self.cp_mode))
        apply_selective_recompute(block, self.recompute == "selective")


def apply_context_parallel(block: BloomBlock, core: ContextParallelCore) -> None:
    """The block's attention runs over the whole sequence while it holds 1/cp of the tokens: ``core`` exchanges
    keys and values over the cp group (ulysses: all-to-all to a head split; ring: passes key/value chunks). It
    takes this TP rank's heads and slopes, so it composes with TP, and with sequence parallelism, whose gather over
    TP happens inside the QKV projection before it. Padding masks and attention dropout have no CP path."""
    if block.self_attention.attention_dropout > 0:
        raise ValueError(f"context parallelism needs attention_dropout 0, got {block.self_attention.attention_dropout}")
    block.self_attention.context_parallel = core


def apply_selective_recompute(block: BloomBlock, on: bool) -> None:
    """Selective recompute (Korthikanti et al. 2022): keep the attention core's inputs only and recompute its
    scores and softmax, the largest activations, in the backward pass."""
    block.self_attention.recompute_core = on


# ---- 4. compile ----


def compiles_blocks(mode: str, device: torch.device) -> bool:
    """Whether the run setting ``compile`` (auto | on | off) compiles the blocks of a rank whose model lives on
    ``device``: auto does on CUDA, where a compiled block fuses its elementwise ops and drops Python's per-op cost
    from every step, and not on CPU, where compiling a block costs more than the steps of a CPU run win back
    (docs/PERFORMANCE.md, "compile")."""
    return mode == "on" or (mode == "auto" and device.type == "cuda")


def compile_blocks(module: nn.Module, parallelism: Parallelism, mode: str, device: torch.device) -> list[BloomBlock]:
    """Step 4: torch.compile(fullgraph=True) of each dense transformer block of ``module`` (a BloomStack or this
    rank's pipeline stage), in place; returns the blocks compiled.

    In place means the block's ``forward``, not the module: parameter names and state_dict keys do not change, and
    forward hooks (the overlapped parameter gather waits in one, zero/param_gather.py) keep running eagerly around the
    compiled graph instead of being traced into it. fullgraph=True makes any graph break an error at the first
    step rather than a silent slowdown. Shapes: training's never change, so training never recompiles;
    evaluation and scoring (no_grad, module.eval()) get graphs of their own, the first for their first shape and, if
    their shapes vary (a last partial micro-batch, scoring's lengths), one more in which torch's automatic dynamic
    shapes make the varying sizes symbolic, after which nothing recompiles.

    MoE blocks stay eager (their routing sizes are data-dependent); context parallelism and tp2d keep every block
    eager too: their exchanges are not traceable into one graph yet, so ``on`` is refused there and ``auto`` is off.
    """
    if not compiles_blocks(mode, device):
        return []
    untraceable = [
        f"{axis}({size})"
        for axis, size in (("cp", parallelism.topology.cp), ("tp2d", parallelism.topology.tp2d))
        if size > 1
    ]
    if untraceable:
        if mode == "auto":
            return []
        raise BadInput(
            f"compile=on: {' and '.join(untraceable)} > 1 is not compiled (context parallel's and 2D tensor "
            "parallel's exchanges do not trace into one graph); set compile=auto or off"
        )
    blocks = [m for m in module.modules() if isinstance(m, BloomBlock) and isinstance(m.mlp, BloomMLP)]
    for block in blocks:
        if "forward" in vars(block):
            raise RuntimeError(f"block {block.layer_number} is compiled already")
        # The slopes cached on the device now: built inside the trace they would be a new dictionary entry, which
        # the next step's guards would see as a change and recompile for.
        block.alibi.slopes(device)
        block.forward = torch.compile(block.forward, fullgraph=True)  # type: ignore[method-assign]
    return blocks
