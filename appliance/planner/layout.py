"""The parallel layout: one self-checking object (torchtitan's ParallelDims pattern). Only the planner picks degrees;
everyone else reads them from here.

Rank order is TP innermost (inside a node), then DP, then PP, as DeepSpeed's PipeModelDataParallelTopology lays
ranks out: rank = tp_rank + tp * (dp_rank + dp * pp_rank).
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass

from appliance.errors import BadInput
from appliance.planner.model_shape import RECOMPUTE_MODES

ZERO_STAGES = (0, 1, 2)
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
}


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

    def __post_init__(self) -> None:
        problems = []
        for key in ("tp", "pp", "dp", "micro_batch_size"):
            value = getattr(self, key)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                problems.append(f"{key} must be a positive integer, got {value!r}")
        if not isinstance(self.global_batch_size, int) or self.global_batch_size < 0:
            problems.append(f"global_batch_size must be a non-negative integer, got {self.global_batch_size!r}")
        if self.zero_stage not in ZERO_STAGES:
            problems.append(f"zero_stage must be 0, 1 or 2, got {self.zero_stage!r}")
        if self.recompute not in RECOMPUTE_MODES:
            problems.append(f"recompute must be one of {', '.join(RECOMPUTE_MODES)}, got {self.recompute!r}")
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

    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.dp

    @property
    def micro_batches(self) -> int:
        """Micro-batches per step and pipeline (gradient-accumulation steps)."""
        return self.global_batch_size // (self.micro_batch_size * self.dp) if self.global_batch_size else 0

    def validate(self, world_size: int, heads: int, layers: int) -> None:
        """Check the layout against a world size and a model; BadInput listing every broken rule, every factor named."""
        problems = []
        if self.world_size != world_size:
            problems.append(
                f"tp({self.tp}) * pp({self.pp}) * dp({self.dp}) = {self.world_size} != world size {world_size}"
            )
        if heads % self.tp:
            problems.append(f"heads({heads}) is not divisible by tp({self.tp})")
        partition_problem = partition_error(layers, self.pp)
        if partition_problem:
            problems.append(partition_problem)
        if problems:
            raise BadInput(f"layout {self.describe()}: " + "; ".join(problems))

    def to_dict(self) -> dict[str, int | str | bool]:
        return {
            "tp": self.tp,
            "pp": self.pp,
            "dp": self.dp,
            "micro_batch_size": self.micro_batch_size,
            "global_batch_size": self.global_batch_size,
            "zero_stage": self.zero_stage,
            "recompute": self.recompute,
            "sequence_parallel": self.sequence_parallel,
        }

    def describe(self) -> str:
        """The layout in parse_layout's syntax."""
        text = f"tp={self.tp},pp={self.pp},dp={self.dp},mbs={self.micro_batch_size}"
        if self.global_batch_size:
            text += f",gbs={self.global_batch_size}"
        return text + f",zero={self.zero_stage},recompute={self.recompute},sp={int(bool(self.sequence_parallel))}"


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
    """Parse "tp=4,pp=12,dp=8,mbs=2[,gbs=2048][,zero=1][,recompute=full][,sp=1]"; BadInput naming the bad part.
    tp, pp and dp are required; mbs defaults to 1; zero, recompute and sp default to BLOOM-176B's (1, full, 0)."""
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
                f"--layout {text!r}: unknown key {key!r} in {part!r} (known: tp, pp, dp, mbs, gbs, zero, recompute, sp)"
            )
        name = LAYOUT_KEYS[key]
        if name in values:
            raise BadInput(f"--layout {text!r}: {key!r} is given twice")
        values[name] = _layout_value(name, raw.strip(), part, text)
    missing = [k for k in ("tp", "pp", "dp") if k not in values]
    if missing:
        raise BadInput(f"--layout {text!r}: missing {', '.join(missing)} (tp, pp and dp are required)")
    try:
        return Layout(**values)  # type: ignore[arg-type]
    except BadInput as e:
        raise BadInput(f"--layout {text!r}: {e}") from e


def _layout_value(name: str, raw: str, part: str, text: str) -> int | str | bool:
    if name == "recompute":
        if raw not in RECOMPUTE_MODES:
            raise BadInput(f"--layout {text!r}: {part!r}: recompute must be one of {', '.join(RECOMPUTE_MODES)}")
        return raw
    if name == "sequence_parallel":
        lowered = raw.lower()
        if lowered not in ("0", "1", "true", "false", "on", "off", "yes", "no"):
            raise BadInput(f"--layout {text!r}: {part!r}: sp must be 0 or 1")
        return lowered in ("1", "true", "on", "yes")
    if not raw.isdigit():
        raise BadInput(f"--layout {text!r}: {part!r}: {raw!r} is not a non-negative integer")
    return int(raw)
