"""Model shapes (presets/models/*.toml) with their parameter and FLOP counts.

FLOP conventions (Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on GPU Clusters Using
Megatron-LM", appendix), with causal attention counted as it is computed:
- model FLOPs per token = 6 N + 6 L s h, where N = L (4h^2 + 2 h f) + V h are the weights that take part in
  matrix multiplies (the tied LM head counted once) and 6 L s h is the attention score and context product
  (QK^T and AV), forward and backward. Over the full s x s square they are 12 L s h (4 L s h forward, twice that
  backward), which is what Megatron counts; under the causal mask a flash kernel computes about half the square
  (it skips the blocks above the diagonal), so we count half: 2 L s h forward, 6 L s h in all. MFU uses these,
  and so do the trainer's step events (train/metrics.py) and `bench` (appliance/benchmark/).
- hardware FLOPs add what recomputation runs again: full recompute repeats every block's forward
  (+2 L (4h^2 + 2hf) + 2 L s h per token), selective recompute repeats the attention core (+2 L s h).
  With f = 4h and full recompute this is Megatron-DeepSpeed's 96 B s L h^2 (1 + s/(6h) + V/(16 L h)) with its
  attention term halved: 96 B s L h^2 (1 + s/(12h) + V/(16 L h)).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from appliance.errors import BadInput
from appliance.presets import load_preset

RECOMPUTE_MODES = ("none", "selective", "full")
VOCAB_PAD_MULTIPLE = 128  # Megatron pads the vocabulary to a multiple of 128 x TP (make-vocab-size-divisible-by)
# Standard deviation of the initial weights when a shape states none: Megatron's --init-method-std default (and
# transformers' BloomConfig initializer_range). BLOOM's own runs set 0.0048 (presets/models/bloom-*.toml).
DEFAULT_INIT_STD = 0.02


@dataclass(frozen=True)
class Rampup:
    """Batch-size ramp-up in samples (Megatron --rampup-batch-size start increment samples)."""

    start: int
    increment: int
    samples: int


@dataclass(frozen=True)
class TrainRecipe:
    """Published training hyperparameters that go with a shape (the [train] table); every field is optional."""

    global_batch_size: int | None = None
    lr: float | None = None
    min_lr: float | None = None
    train_tokens: int | None = None
    train_samples: int | None = None
    warmup_samples: int | None = None
    decay_samples: int | None = None
    rampup: Rampup | None = None
    eval_interval: int | None = None
    eval_samples: int | None = None
    save_interval: int | None = None
    seed: int | None = None
    weight_decay: float | None = None
    grad_clip: float | None = None
    adam_beta1: float | None = None
    adam_beta2: float | None = None
    adam_eps: float | None = None


@dataclass(frozen=True)
class ModelShape:
    layers: int
    hidden: int
    heads: int
    vocab_size: int  # as the tokenizer has it; padded_vocab() gives the embedding's row count
    seq_len: int
    ffn_hidden: int = 0  # 0 means 4 x hidden
    name: str = "custom"
    description: str = ""
    init_std: float = DEFAULT_INIT_STD  # every weight matrix and the embedding draw from N(0, init_std)
    layer_norm_epsilon: float = 1e-5
    recipe: TrainRecipe = field(default_factory=TrainRecipe)
    # BLOOM-MoE (model/config.py, docs/MOE.md): 0 experts is dense BLOOM and changes no count below.
    moe_num_experts: int = 0
    moe_top_k: int = 1
    moe_every: int = 2
    moe_capacity_factor: float = 1.0
    moe_eval_capacity_factor: float = 1.0
    moe_min_capacity: int = 4
    moe_aux_loss_coef: float = 0.01
    moe_drop_tokens: bool = True
    moe_random_routing: bool = True

    def __post_init__(self) -> None:
        if self.ffn_hidden == 0:
            object.__setattr__(self, "ffn_hidden", 4 * self.hidden)
        for key in ("layers", "hidden", "heads", "vocab_size", "seq_len", "ffn_hidden"):
            value = getattr(self, key)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise BadInput(f"model {self.name}: {key} must be a positive integer, got {value!r}")
        if self.hidden % self.heads:
            raise BadInput(f"model {self.name}: hidden({self.hidden}) is not divisible by heads({self.heads})")
        for key in ("init_std", "layer_norm_epsilon"):
            if not getattr(self, key) > 0:
                raise BadInput(f"model {self.name}: {key} must be > 0, got {getattr(self, key)!r}")
        problems = self._moe_problems()
        if problems:
            raise BadInput(f"model {self.name}: " + "; ".join(problems))

    def _moe_problems(self) -> list[str]:
        """The MoE keys' rules (model/config.py checks the same on the model it builds), every key named."""
        problems = []
        if not isinstance(self.moe_num_experts, int) or self.moe_num_experts < 0:
            problems.append(f"moe_num_experts must be an integer >= 0, got {self.moe_num_experts!r}")
        elif self.moe_num_experts:
            if self.moe_top_k not in (1, 2):
                problems.append(f"moe_top_k must be 1 or 2, got {self.moe_top_k!r}")
            elif self.moe_top_k > self.moe_num_experts:
                problems.append(f"moe_top_k({self.moe_top_k}) > moe_num_experts({self.moe_num_experts})")
            if not 1 <= self.moe_every <= self.layers:
                problems.append(f"moe_every must be in 1..layers({self.layers}), got {self.moe_every!r}")
            for key in ("moe_capacity_factor", "moe_eval_capacity_factor"):
                if not getattr(self, key) > 0:
                    problems.append(f"{key} must be > 0, got {getattr(self, key)!r}")
            if not self.moe_aux_loss_coef >= 0:
                problems.append(f"moe_aux_loss_coef must be >= 0, got {self.moe_aux_loss_coef!r}")
        return problems

    # ---- mixture of experts (the MoE cost model reads these) ----

    @property
    def moe_layers(self) -> int:
        """Blocks with experts: every moe_every-th block."""
        return self.layers // self.moe_every if self.moe_num_experts else 0

    def expert_parameters(self) -> int:
        """One expert, a BLOOM MLP: 2hf + f + h."""
        return 2 * self.hidden * self.ffn_hidden + self.ffn_hidden + self.hidden

    def all_expert_parameters(self) -> int:
        """Every expert of every MoE block (what expert parallelism splits over ep ranks)."""
        return self.moe_layers * self.moe_num_experts * self.expert_parameters()

    def gate_parameters(self) -> int:
        """The gates' [experts, hidden] weights (no bias), one per MoE block."""
        return self.moe_layers * self.moe_num_experts * self.hidden

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    def padded_vocab(self, tp: int = 1) -> int:
        """Embedding rows: the vocabulary rounded up to a multiple of 128 x TP so every TP shard is GEMM-friendly."""
        multiple = VOCAB_PAD_MULTIPLE * tp
        return math.ceil(self.vocab_size / multiple) * multiple

    def layer_parameters(self) -> int:
        """One block: QKV (3h^2 + 3h), attention output (h^2 + h), MLP (2hf + f + h), two LayerNorms (4h)."""
        h, f = self.hidden, self.ffn_hidden
        return 4 * h * h + 2 * h * f + 9 * h + f

    def embedding_parameters(self, tp: int = 1) -> int:
        """The tied word embedding / LM head, with the embedding LayerNorm (BLOOM has no position embeddings)."""
        return self.padded_vocab(tp) * self.hidden + 2 * self.hidden

    def parameters(self, tp: int = 1) -> int:
        """All parameters: blocks, tied embedding with its LayerNorm, final LayerNorm (BLOOM-176B: 176,247,271,424)."""
        dense = self.layers * self.layer_parameters() + self.embedding_parameters(tp) + 2 * self.hidden
        # An MoE block's experts replace its one MLP; its gate is extra.
        moe = self.all_expert_parameters() - self.moe_layers * self.expert_parameters() + self.gate_parameters()
        return dense + moe

    def matmul_parameters(self, tp: int = 1) -> int:
        """N in '6N': weights used in matrix multiplies (blocks' linear weights and the LM head). An MoE block's
        token passes through top_k experts and the gate, so it counts k MLPs' weights plus the gate's."""
        h, f = self.hidden, self.ffn_hidden
        moe = self.moe_layers * ((self.moe_top_k - 1) * 2 * h * f + self.moe_num_experts * h)
        return self.layers * (4 * h * h + 2 * h * f) + self.padded_vocab(tp) * h + moe

    def flops_per_token(self, seq_len: int | None = None, *, recompute: str = "none", tp: int = 1) -> float:
        """Training FLOPs per token, causal attention counted as computed (the module docstring). recompute="none"
        gives model FLOPs (6N + 6 L s h, the MFU convention); "selective" or "full" give hardware FLOPs, which
        include the recomputed forward work."""
        if recompute not in RECOMPUTE_MODES:
            raise BadInput(f"recompute must be one of {', '.join(RECOMPUTE_MODES)}, got {recompute!r}")
        s = self.seq_len if seq_len is None else seq_len
        h, f, L = self.hidden, self.ffn_hidden, self.layers
        # QK^T and AV forward: 2 s h FLOPs each per token over the full square; the causal half of it is computed.
        attention_forward = 2.0 * L * s * h
        flops = 6.0 * self.matmul_parameters(tp) + 3 * attention_forward  # backward is twice the forward
        if recompute == "full":
            flops += 2.0 * L * (4 * h * h + 2 * h * f) + attention_forward
        elif recompute == "selective":
            flops += attention_forward
        return flops

    def with_seq_len(self, seq_len: int | None) -> ModelShape:
        return self if seq_len is None or seq_len == self.seq_len else replace(self, seq_len=seq_len)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["parameters"] = self.parameters()
        d["padded_vocab"] = self.padded_vocab()
        d["recipe"] = {k: v for k, v in d["recipe"].items() if v is not None}
        return d


SHAPE_KEYS = {"layers", "hidden", "heads", "vocab_size", "seq_len"}
OPTIONAL_KEYS = {
    "ffn_hidden": int,
    "name": str,
    "description": str,
    "init_std": float,
    "layer_norm_epsilon": float,
    "moe_num_experts": int,
    "moe_top_k": int,
    "moe_every": int,
    "moe_capacity_factor": float,
    "moe_eval_capacity_factor": float,
    "moe_min_capacity": int,
    "moe_aux_loss_coef": float,
    "moe_drop_tokens": bool,
    "moe_random_routing": bool,
}
RECIPE_INT_KEYS = {
    "global_batch_size",
    "train_tokens",
    "train_samples",
    "warmup_samples",
    "decay_samples",
    "eval_interval",
    "eval_samples",
    "save_interval",
    "seed",
}
RECIPE_FLOAT_KEYS = {"lr", "min_lr", "weight_decay", "grad_clip", "adam_beta1", "adam_beta2", "adam_eps"}


def model_from_table(table: dict[str, Any], source: str) -> ModelShape:
    """Build a ModelShape from a TOML table; BadInput naming `source` and the key on any problem."""
    allowed = SHAPE_KEYS | set(OPTIONAL_KEYS) | {"train"}
    for key in table:
        if key not in allowed:
            raise BadInput(f"{source}: unknown key {key!r} (allowed: {', '.join(sorted(allowed))})")
    for key in sorted(SHAPE_KEYS):
        if key not in table:
            raise BadInput(f"{source}: missing key {key!r}")
        if not _is_int(table[key]) or table[key] < 1:
            raise BadInput(f"{source}: key {key!r} must be a positive integer, got {table[key]!r}")
    values: dict[str, Any] = {k: table[k] for k in SHAPE_KEYS}
    for key, kind in OPTIONAL_KEYS.items():
        if key not in table:
            continue
        value = table[key]
        if kind is bool:
            ok = isinstance(value, bool)
        elif kind is int:
            ok = _is_int(value) and value > 0
        else:
            ok = isinstance(value, str) if kind is str else _is_num(value)
        if not ok:
            raise BadInput(f"{source}: key {key!r} has a bad value {value!r}")
        values[key] = float(value) if kind is float else value
    values["recipe"] = _recipe(table.get("train", {}), source)
    try:
        return ModelShape(**values)
    except BadInput as e:
        raise BadInput(f"{source}: {e}") from e


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_num(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _recipe(table: Any, source: str) -> TrainRecipe:
    if not isinstance(table, dict):
        raise BadInput(f"{source}: [train] must be a table")
    values: dict[str, Any] = {}
    for key, value in table.items():
        where = f"{source}: [train] {key}"
        if key in RECIPE_INT_KEYS:
            if not _is_int(value) or value < 0:
                raise BadInput(f"{where} must be a non-negative integer, got {value!r}")
            values[key] = value
        elif key in RECIPE_FLOAT_KEYS:
            if not _is_num(value) or value < 0:
                raise BadInput(f"{where} must be a non-negative number, got {value!r}")
            values[key] = float(value)
        elif key == "rampup":
            if not isinstance(value, dict) or set(value) != {"start", "increment", "samples"}:
                raise BadInput(f"{where} must be {{start, increment, samples}}, got {value!r}")
            if not all(_is_int(v) and v > 0 for v in value.values()):
                raise BadInput(f"{where}: start, increment and samples must be positive integers")
            values[key] = Rampup(**value)
        else:
            known = ", ".join(sorted(RECIPE_INT_KEYS | RECIPE_FLOAT_KEYS | {"rampup"}))
            raise BadInput(f"{source}: unknown key {key!r} in [train] (allowed: {known})")
    if "train_tokens" in values and "train_samples" in values:
        raise BadInput(f"{source}: [train] sets both train_tokens and train_samples; keep one")
    return TrainRecipe(**values)


def load_model_shape(name_or_path: str) -> ModelShape:
    """A model shape from a preset name (presets/models/NAME.toml, e.g. "bloom-1b7") or a TOML file path."""
    path, table = load_preset("models", name_or_path)
    table.setdefault("name", path.stem)
    return model_from_table(table, str(path))
