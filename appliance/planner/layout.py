"""The parallel layout: one self-checking object (torchtitan's ParallelDims pattern). Only the planner picks degrees;
everyone else reads them from here.

Rank order is TP innermost (inside a node), then CP, then DP, then PP (appliance/parallel/topology.py):
rank = tp_rank + tp * (cp_rank + cp * (dp_rank + dp * pp_rank)); with cp = 1 this is DeepSpeed's
PipeModelDataParallelTopology.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from appliance.errors import BadInput
from appliance.planner.layout_rules import moe_problems, store_problems, tp2d_precision_problems
from appliance.planner.model_shape import RECOMPUTE_MODES

ZERO_STAGES = (0, 1, 2)
# Context (segment) parallelism: how attention sees the whole sequence when each CP rank holds a slice of it.
# "ulysses": an all-to-all trades the sequence split for a head split (DeepSpeed-Ulysses), so heads per TP rank
# must divide by cp; "ring": key/value chunks travel a ring of CP ranks, zigzag-ordered to balance causal work.
CP_MODES = ("ulysses", "ring")
# parse_layout keys and the field each sets; unnamed fields take BLOOM-176B's settings (ZeRO-1-equivalent bf16
# optimizer, full activation recompute, no sequence parallelism), so "tp=4,pp=12,dp=8,mbs=2" is BLOOM's layout.
LAYOUT_KEYS = {
    "tp": "tp",
    "pp": "pp",
    "dp": "dp",
    "mbs": "micro_batch_size",
    "micro_batch_size": "micro_batch_size",
    "gbs": "global_batch_size",
    "global_batch_size": "global_batch_size",
    "zero": "zero_stage",
    "zero_stage": "zero_stage",
    "recompute": "recompute",
    "sp": "sequence_parallel",
    "sequence_parallel": "sequence_parallel",
    "cp": "cp",
    "cp_mode": "cp_mode",
    "tp2d": "tp2d",
    "ep": "ep",
}
# Each field's --layout key, in Layout.describe's order (layout_text writes them).
SHORT_KEYS = {
    "tp": "tp",
    "pp": "pp",
    "dp": "dp",
    "micro_batch_size": "mbs",
    "global_batch_size": "gbs",
    "zero_stage": "zero",
    "recompute": "recompute",
    "sequence_parallel": "sp",
    "tp2d": "tp2d",
    "cp": "cp",
    "cp_mode": "cp_mode",
    "ep": "ep",
}
# Keys a plan.json written before context parallelism lacks; reading one fills in these defaults (runspec.py).
LATER_LAYOUT_KEYS = ("cp", "cp_mode", "tp2d", "ep")


@dataclass(frozen=True)
class Layout:
    tp: int
    pp: int
    dp: int
    micro_batch_size: int = 1
    global_batch_size: int = 0  # 0: not chosen yet; make_plan fills it from the request or the model's recipe
    zero_stage: int = 1
    recompute: str = "full"
    sequence_parallel: bool = False
    cp: int = 1  # context-parallel ranks per sequence; they hold the same weights, so batch sizes count over dp
    cp_mode: str = "ulysses"
    # 2D tensor parallelism (Optimus): Q x Q ranks in place of tp, each weight and activation split over the mesh
    # (parallel/tensor2d/layers2d.py); the topology's tp axis is then those Q * Q ranks (tp_ranks).
    tp2d: int = 1
    # Expert parallelism (BLOOM-MoE, docs/MOE.md): ep ranks share each MoE block's experts. It folds inside dp
    # (dp = edp x ep, parallel/topology.py), so it adds no rank: the world is still tp * pp * dp * cp.
    ep: int = 1

    def __post_init__(self) -> None:
        problems = []
        for key in ("tp", "pp", "dp", "cp", "micro_batch_size", "tp2d", "ep"):
            value = getattr(self, key)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                problems.append(f"{key} must be a positive integer, got {value!r}")
        if not isinstance(self.global_batch_size, int) or self.global_batch_size < 0:
            problems.append(f"global_batch_size must be a non-negative integer, got {self.global_batch_size!r}")
        if self.zero_stage not in ZERO_STAGES:
            problems.append(f"zero_stage must be 0, 1 or 2, got {self.zero_stage!r}")
        if self.recompute not in RECOMPUTE_MODES:
            problems.append(f"recompute must be one of {', '.join(RECOMPUTE_MODES)}, got {self.recompute!r}")
        if self.cp_mode not in CP_MODES:
            problems.append(f"cp_mode must be one of {', '.join(CP_MODES)}, got {self.cp_mode!r}")
        if not problems and self.tp2d > 1:
            problems += self._tp2d_problems()
        if not problems and self.dp % self.ep:
            problems.append(f"dp({self.dp}) % ep({self.ep}) != 0 (expert parallelism folds inside dp)")
        if problems:
            raise BadInput(f"layout {self.describe()}: " + "; ".join(problems))
        if self.zero_stage == 2 and self.pp > 1:
            # DeepSpeed's pipeline engine partitions gradients only up to ZeRO-1 (it asserts zero stage < 2).
            raise BadInput(f"layout {self.describe()}: ZeRO-2 cannot run with pipeline parallelism (pp > 1)")
        if self.sequence_parallel and self.tp == 1:
            raise BadInput(f"layout {self.describe()}: sequence parallelism needs tp > 1 (it splits TP regions)")
        if self.global_batch_size and self.global_batch_size % (self.micro_batch_size * self.dp):
            raise BadInput(
                f"layout {self.describe()}: global batch({self.global_batch_size}) is not divisible by"
                f" mbs({self.micro_batch_size}) * dp({self.dp}) = {self.micro_batch_size * self.dp}"
            )

    def _tp2d_problems(self) -> list[str]:
        """What 2D tensor parallelism cannot be combined with (yet), each with its reason."""
        q, problems = self.tp2d, []
        if self.tp > 1:
            problems.append(f"tp2d({q}) and tp({self.tp}) are both set: tp2d's {q} x {q} ranks take tp's place")
        if self.sequence_parallel:
            problems.append(
                f"tp2d({q}) with sp: the mesh already splits every activation over its rows (batch) and columns "
                "(hidden), so there is nothing left for sequence parallelism to split"
            )
        if self.cp > 1:
            problems.append(f"tp2d({q}) with cp({self.cp}): context parallelism has no 2D attention path yet")
        if self.micro_batch_size % q:
            problems.append(f"mbs({self.micro_batch_size}) is not divisible by tp2d({q}) (the mesh rows split it)")
        return problems

    @property
    def tp_ranks(self) -> int:
        """Ranks of one tensor-parallel group: tp, or tp2d x tp2d (the topology's tp axis)."""
        return self.tp * self.tp2d * self.tp2d

    @property
    def world_size(self) -> int:
        return self.tp_ranks * self.pp * self.dp * self.cp

    @property
    def factors(self) -> str:
        """The world size's factors for messages: ``tp(4) * pp(12) * dp(8)``, with ``* cp(C)`` when cp > 1 and
        ``tp2d(Q)^2`` in place of tp when tp2d > 1."""
        shown = [f"tp2d({self.tp2d})^2" if self.tp2d > 1 else f"tp({self.tp})", f"pp({self.pp})", f"dp({self.dp})"]
        return " * ".join(shown + ([f"cp({self.cp})"] if self.cp > 1 else []))

    @property
    def dp_cp(self) -> int:
        """Ranks that hold the same weights and reduce their gradients together (the topology's dp_cp group):
        ZeRO partitions the optimizer states over them."""
        return self.dp * self.cp

    @property
    def micro_batches(self) -> int:
        """Micro-batches per step and pipeline (gradient-accumulation steps)."""
        return self.global_batch_size // (self.micro_batch_size * self.dp) if self.global_batch_size else 0

    def validate(
        self,
        world_size: int,
        heads: int,
        layers: int,
        seq_len: int | None = None,
        *,
        moe_num_experts: int = 0,
        dtype: str | None = None,
        expert_device_budget_mb: int = 0,
        expert_host_budget_mb: int = 0,
    ) -> None:
        """Check the layout against a world size, a model and the run's settings; BadInput listing every broken rule,
        every factor named. Every rule the training ranks hold a layout to is here (the ones that depend on experts,
        precision or the expert store in layout_rules.py, which the engine's own checks share), so the planner refuses
        what the ranks would, in the same words. ``moe_num_experts``: the model's experts per MoE block (0: a dense
        model, which ep > 1 cannot split); ``dtype``: the run's precision (None: its rules are not checked);
        ``expert_*_budget_mb``: the run's tiered expert store (both 0: none)."""
        problems = moe_problems(
            moe_num_experts=moe_num_experts,
            ep=self.ep,
            tp=self.tp_ranks,
            tp2d=self.tp2d,
            sequence_parallel=self.sequence_parallel,
        )
        if dtype is not None:
            problems += tp2d_precision_problems(tp2d=self.tp2d, dtype=dtype, zero_stage=self.zero_stage)
            problems += store_problems(
                is_moe=moe_num_experts > 0,
                dtype=dtype,
                zero_stage=self.zero_stage,
                cp=self.cp,
                tp=self.tp_ranks,
                device_budget_bytes=expert_device_budget_mb * 2**20,
                host_budget_bytes=expert_host_budget_mb * 2**20,
            )
        if self.world_size != world_size:
            problems.append(f"{self.factors} = {self.world_size} != world size {world_size}")
        if heads % self.tp:
            problems.append(f"heads({heads}) is not divisible by tp({self.tp})")
        elif heads % self.tp2d:
            problems.append(f"heads({heads}) is not divisible by tp2d({self.tp2d}) (heads split over mesh columns)")
        elif self.cp > 1 and self.cp_mode == "ulysses" and (heads // self.tp) % self.cp:
            # After Ulysses' all-to-all each CP rank attends with (heads / tp) / cp whole heads.
            problems.append(
                f"heads({heads}) / tp({self.tp}) = {heads // self.tp} heads per TP rank is not divisible by"
                f" cp({self.cp}) (cp_mode=ulysses splits them over the CP ranks; cp_mode=ring does not)"
            )
        chunks = self.sequence_chunks
        if seq_len is not None and seq_len % chunks:
            problems.append(
                f"seq_len({seq_len}) is not divisible by {chunks} (cp({self.cp}) chunks"
                + (", two per rank for the zigzag order)" if self.cp_mode == "ring" and self.cp > 1 else ")")
            )
        elif seq_len is not None and self.sequence_parallel and (seq_len // self.cp) % self.tp:
            # Sequence parallelism cuts each CP rank's seq_len / cp tokens again over the TP ranks.
            problems.append(
                f"seq_len({seq_len}) / cp({self.cp}) = {seq_len // self.cp} tokens per CP rank is not divisible by"
                f" tp({self.tp}) (sequence parallelism splits them over the TP ranks)"
            )
        partition_problem = partition_error(layers, self.pp)
        if partition_problem:
            problems.append(partition_problem)
        if problems:
            raise BadInput(f"layout {self.describe()}: " + "; ".join(problems))

    def to_dict(self) -> dict[str, int | str | bool]:
        # tp2d only where it is used, so plans without it read as before.
        return self._core_dict() | ({"tp2d": self.tp2d} if self.tp2d > 1 else {})

    def _core_dict(self) -> dict[str, int | str | bool]:
        return {
            "tp": self.tp,
            "pp": self.pp,
            "dp": self.dp,
            "micro_batch_size": self.micro_batch_size,
            "global_batch_size": self.global_batch_size,
            "zero_stage": self.zero_stage,
            "recompute": self.recompute,
            "sequence_parallel": self.sequence_parallel,
            "cp": self.cp,
            "cp_mode": self.cp_mode,
            "ep": self.ep,
        }

    @property
    def sequence_chunks(self) -> int:
        """How many equal pieces each sequence is cut into: cp, or 2 * cp for ring's zigzag order (rank r holds
        pieces r and 2cp-1-r, so every rank gets the same share of causal attention work)."""
        return 2 * self.cp if self.cp > 1 and self.cp_mode == "ring" else self.cp

    def describe(self) -> str:
        """The layout in parse_layout's syntax."""
        text = f"tp={self.tp},pp={self.pp},dp={self.dp},mbs={self.micro_batch_size}"
        if self.global_batch_size:
            text += f",gbs={self.global_batch_size}"
        text += f",zero={self.zero_stage},recompute={self.recompute},sp={int(bool(self.sequence_parallel))}"
        text += f",tp2d={self.tp2d}" if self.tp2d > 1 else ""
        text += f",cp={self.cp},cp_mode={self.cp_mode}" if self.cp > 1 else ""
        return text + (f",ep={self.ep}" if self.ep > 1 else "")


@dataclass(frozen=True)
class Partition:
    """How DeepSpeed's PipelineModule splits the blocks: `method` is its partition_method string."""

    method: str
    layers_per_stage: tuple[int, ...]  # transformer blocks on each stage; stage 0 also holds the embedding,
    # the last stage the final LayerNorm and the (tied) LM head


def partition_error(layers: int, pp: int) -> str | None:
    if pp > layers + 2 or ((layers + 2) % pp and layers % pp):
        return (
            f"layers({layers}) cannot be balanced over pp({pp}): neither {layers} blocks nor {layers + 2}"
            f" (blocks plus the embedding and LM-head) divide by {pp}"
        )
    return None


@functools.lru_cache(maxsize=512)
def pipeline_partition(layers: int, pp: int) -> Partition:
    """BLOOM's balance: count the two tied-embedding ends as blocks ('type:transformer|embedding') when that
    divides evenly (70 + 2 = 72 = 12 x 6: stages 0 and 11 get 5 blocks each); otherwise split the blocks evenly."""
    problem = partition_error(layers, pp)
    if problem:
        raise BadInput(problem)
    if pp == 1:
        return Partition("type:transformer", (layers,))
    if (layers + 2) % pp == 0 and (layers + 2) // pp >= 2:
        per = (layers + 2) // pp
        return Partition("type:transformer|embedding", (per - 1, *([per] * (pp - 2)), per - 1))
    if layers % pp == 0:
        return Partition("type:transformer", (layers // pp,) * pp)
    # Only (layers + 2) divides, with one unit per stage: the ends hold just the embedding and the head.
    return Partition("type:transformer|embedding", (0, *([1] * (pp - 2)), 0))


def parse_layout(text: str) -> Layout:
    """Parse "tp=4,pp=12,dp=8,mbs=2[,gbs=2048][,zero=1][,recompute=full][,sp=1][,cp=2][,cp_mode=ring][,ep=2]";
    BadInput naming the bad part. tp, pp and dp are required; mbs defaults to 1; zero, recompute and sp default to
    BLOOM-176B's (1, full, 0); cp to 1 and cp_mode to ulysses; ep to 1. The command line's --layout is
    parse_layout_fields instead: the planner chooses what it leaves out."""
    values = parse_layout_fields(text)
    missing = [k for k in ("tp", "pp", "dp") if k not in values]
    if missing:
        raise BadInput(f"--layout {text!r}: missing {', '.join(missing)} (tp, pp and dp are required)")
    try:
        return Layout(**values)  # type: ignore[arg-type]
    except BadInput as e:
        raise BadInput(f"--layout {text!r}: {e}") from e


def parse_layout_fields(text: str) -> dict[str, int | str | bool]:
    """The fields --layout names, by Layout field name, each value checked on its own (parse_layout's syntax; none
    is required): the planner keeps them and chooses the others (make_plan's `fixed`). Whether they go together
    (and with the model and the hardware) is the planner's question."""
    values: dict[str, int | str | bool] = {}
    parts = [p for p in re.split(r"[,\s]+", text.strip()) if p]
    if not parts:
        raise BadInput("--layout is empty; expected e.g. tp=4,pp=12,dp=8,mbs=2")
    for part in parts:
        key, sep, raw = part.partition("=")
        key = key.strip().lower()
        if not sep or not raw.strip():
            raise BadInput(f"--layout {text!r}: {part!r} is not key=value")
        if key not in LAYOUT_KEYS:
            raise BadInput(
                f"--layout {text!r}: unknown key {key!r} in {part!r}"
                " (known: tp, pp, dp, mbs, gbs, zero, recompute, sp, cp, cp_mode, tp2d, ep)"
            )
        name = LAYOUT_KEYS[key]
        if name in values:
            raise BadInput(f"--layout {text!r}: {key!r} is given twice")
        values[name] = _layout_value(name, raw.strip(), part, text)
    if "tp2d" in values and "tp" not in values:
        values["tp"] = 1  # tp2d takes tp's place
    for name, value in values.items():  # each alone; Layout checks them together once the rest is chosen
        least = 0 if name == "global_batch_size" else 1  # gbs=0: the planner's batch
        if name != "zero_stage" and isinstance(value, int) and not isinstance(value, bool) and value < least:
            raise BadInput(f"--layout {text!r}: {name} must be a positive integer, got {value}")
    if values.get("zero_stage", 0) not in ZERO_STAGES:
        raise BadInput(f"--layout {text!r}: zero_stage must be 0, 1 or 2, got {values['zero_stage']}")
    return values


def completes_layout(fields: Mapping[str, Any], *, moe: bool) -> bool:
    """Whether --layout's fields leave the search nothing to choose: tp, pp, dp, mbs, zero and recompute, sp where
    tp > 1 could have it, cp_mode where cp > 1, ep for an MoE model. A missing cp is 1 and a missing tp2d 1 (the
    search tries neither), so a layout written in full before partial layouts existed still means what it did."""
    needed = {"tp", "pp", "dp", "micro_batch_size", "zero_stage", "recompute"}
    if fields.get("tp", 1) > 1 and fields.get("tp2d", 1) == 1 and not moe:
        needed.add("sequence_parallel")
    if fields.get("cp", 1) > 1:
        needed.add("cp_mode")
    if moe:
        needed.add("ep")
    return needed <= fields.keys()


def layout_text(fields: Mapping[str, Any]) -> str:
    """A layout, whole (Layout.to_dict) or in part (a rejected tp/pp/dp combination), in --layout's syntax, so any
    layout the planner prints can be given back to --layout: Layout.describe's keys and order, and what describe
    leaves out left out (cp 1 and its mode, tp2d 1, ep 1, gbs 0). Keys that are not layout fields are dropped."""
    shown = {name: fields[name] for name in SHORT_KEYS if name in fields}
    for name, default in (("cp", 1), ("tp2d", 1), ("ep", 1), ("global_batch_size", 0)):
        if shown.get(name) == default:
            shown.pop(name)
    if "cp" not in shown:
        shown.pop("cp_mode", None)  # no exchange runs: its mode means nothing
    return ",".join(f"{SHORT_KEYS[k]}={int(v) if isinstance(v, bool) else v}" for k, v in shown.items())


def _layout_value(name: str, raw: str, part: str, text: str) -> int | str | bool:
    if name == "recompute":
        if raw not in RECOMPUTE_MODES:
            raise BadInput(f"--layout {text!r}: {part!r}: recompute must be one of {', '.join(RECOMPUTE_MODES)}")
        return raw
    if name == "cp_mode":
        if raw not in CP_MODES:
            raise BadInput(f"--layout {text!r}: {part!r}: cp_mode must be one of {', '.join(CP_MODES)}")
        return raw
    if name == "sequence_parallel":
        lowered = raw.lower()
        if lowered not in ("0", "1", "true", "false", "on", "off", "yes", "no"):
            raise BadInput(f"--layout {text!r}: {part!r}: sp must be 0 or 1")
        return lowered in ("1", "true", "on", "yes")
    if not raw.isdigit():
        raise BadInput(f"--layout {text!r}: {part!r}: {raw!r} is not a non-negative integer")
    return int(raw)
