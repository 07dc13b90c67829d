"""The shape of a BLOOM model, and its translation to and from transformers' config.json.

BLOOM-MoE (docs/MOE.md): with ``moe_num_experts`` > 0, every ``moe_every``-th block (blocks moe_every - 1,
2 * moe_every - 1, ...: every other block at 2) replaces its MLP by a mixture of that many BLOOM MLP experts behind
a top-``moe_top_k`` gate (appliance/model/moe.py). 0 experts is BLOOM itself: nothing else changes.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from appliance.planner.model_shape import ModelShape

# Special-token ids of the BLOOM tokenizer layout (<unk>, <s>, </s>, <pad> are the first four entries of the
# vocabulary); bigscience/bloom's config.json carries the same numbers.
UNK_TOKEN_ID = 0
BOS_TOKEN_ID = 1
EOS_TOKEN_ID = 2
PAD_TOKEN_ID = 3


@dataclass(frozen=True)
class BloomConfig:
    """Architecture hyper-parameters. Everything else (ALiBi, embedding LayerNorm, tied head) is fixed by BLOOM."""

    vocab_size: int
    hidden_size: int
    n_layer: int
    n_head: int
    layer_norm_epsilon: float = 1e-5
    initializer_range: float = 0.02
    hidden_dropout: float = 0.0
    attention_dropout: float = 0.0
    # Mixture of experts (docs/MOE.md); the defaults are DeepSpeed MoE's, and 0 experts keeps the model dense.
    moe_num_experts: int = 0
    moe_top_k: int = 1  # experts per token, 1 (Switch) or 2 (GShard)
    moe_every: int = 2  # blocks moe_every - 1, 2 * moe_every - 1, ... are MoE blocks
    moe_capacity_factor: float = 1.0  # an expert takes at most capacity_factor * k * tokens / experts tokens
    moe_eval_capacity_factor: float = 1.0
    moe_min_capacity: int = 4
    moe_aux_loss_coef: float = 0.01  # the load-balancing loss's weight in the training loss
    # False: no token is dropped (each expert's capacity is the largest load), as a dense model would compute.
    moe_drop_tokens: bool = True
    # Random token selection (top-1) and a sampled second expert (top-2, Gumbel noise); False: argmax routing.
    moe_random_routing: bool = True

    def __post_init__(self) -> None:
        problems = []
        for name in ("vocab_size", "hidden_size", "n_layer", "n_head"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                problems.append(f"{name} must be a positive integer (got {value!r})")
        if not problems and self.hidden_size % self.n_head != 0:
            problems.append(
                f"hidden_size({self.hidden_size}) % n_head({self.n_head}) = {self.hidden_size % self.n_head}, "
                "must be 0 so every head gets the same width"
            )
        if not self.layer_norm_epsilon > 0:
            problems.append(f"layer_norm_epsilon must be > 0 (got {self.layer_norm_epsilon!r})")
        if not self.initializer_range > 0:
            problems.append(f"initializer_range must be > 0 (got {self.initializer_range!r})")
        for name in ("hidden_dropout", "attention_dropout"):
            value = getattr(self, name)
            if not 0.0 <= value < 1.0:
                problems.append(f"{name} must be in [0, 1) (got {value!r})")
        problems += self._moe_problems()
        if problems:
            raise ValueError("invalid BLOOM config: " + "; ".join(problems))

    def _moe_problems(self) -> list[str]:
        problems = []
        if isinstance(self.moe_num_experts, bool) or not isinstance(self.moe_num_experts, int):
            return [f"moe_num_experts must be an integer >= 0 (got {self.moe_num_experts!r})"]
        if self.moe_num_experts < 0:
            problems.append(f"moe_num_experts must be >= 0 (got {self.moe_num_experts})")
        if self.moe_top_k not in (1, 2):
            problems.append(f"moe_top_k must be 1 or 2 (got {self.moe_top_k!r})")
        elif self.moe_num_experts and self.moe_top_k > self.moe_num_experts:
            problems.append(f"moe_top_k({self.moe_top_k}) > moe_num_experts({self.moe_num_experts})")
        if isinstance(self.moe_every, bool) or not isinstance(self.moe_every, int) or self.moe_every < 1:
            problems.append(f"moe_every must be a positive integer (got {self.moe_every!r})")
        elif self.moe_num_experts and self.moe_every > self.n_layer:
            problems.append(f"moe_every({self.moe_every}) > n_layer({self.n_layer}): no block would be an MoE block")
        for name in ("moe_capacity_factor", "moe_eval_capacity_factor"):
            if not getattr(self, name) > 0:
                problems.append(f"{name} must be > 0 (got {getattr(self, name)!r})")
        if isinstance(self.moe_min_capacity, bool) or not isinstance(self.moe_min_capacity, int):
            problems.append(f"moe_min_capacity must be an integer >= 0 (got {self.moe_min_capacity!r})")
        elif self.moe_min_capacity < 0:
            problems.append(f"moe_min_capacity must be >= 0 (got {self.moe_min_capacity})")
        if not self.moe_aux_loss_coef >= 0:
            problems.append(f"moe_aux_loss_coef must be >= 0 (got {self.moe_aux_loss_coef!r})")
        return problems

    # ---- mixture of experts ----

    @property
    def is_moe(self) -> bool:
        return self.moe_num_experts > 0

    def is_moe_block(self, layer_number: int) -> bool:
        """Whether block ``layer_number`` (0-based) has experts: the moe_every-th, 2 x moe_every-th, ... block."""
        return self.is_moe and (layer_number + 1) % self.moe_every == 0

    @property
    def moe_blocks(self) -> list[int]:
        return [i for i in range(self.n_layer) if self.is_moe_block(i)]

    def expert_parameters(self) -> int:
        """One expert, a BLOOM MLP: 4h*h + 4h + 4h*h + h."""
        h = self.hidden_size
        return 8 * h * h + 5 * h

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.n_head

    @property
    def ffn_hidden_size(self) -> int:
        # BLOOM's MLP is always 4x wide (transformers hard-codes it too).
        return 4 * self.hidden_size

    def num_parameters(self) -> int:
        """Parameters counted once (the output head shares the word embeddings)."""
        h = self.hidden_size
        # qkv (3h*h + 3h) + dense (h*h + h) + mlp (4h*h + 4h + 4h*h + h) + two LayerNorms (4h) = 12h^2 + 13h
        per_block = 12 * h * h + 13 * h
        # An MoE block holds moe_num_experts MLPs in place of one, and the gate's [experts, h] weight (no bias).
        per_moe_block_extra = (self.moe_num_experts - 1) * self.expert_parameters() + self.moe_num_experts * h
        moe_extra = len(self.moe_blocks) * per_moe_block_extra
        # word embeddings + embedding LayerNorm + final LayerNorm
        return self.vocab_size * h + 2 * h + self.n_layer * per_block + 2 * h + moe_extra

    def moe_dict(self) -> dict[str, Any]:
        """The MoE fields (config.json's "moe" entry of an MoE export, docs/MOE.md); empty for a dense model."""
        if not self.is_moe:
            return {}
        return {name.removeprefix("moe_"): getattr(self, name) for name in MOE_FIELDS}

    def to_hf_dict(self) -> dict[str, Any]:
        """The keys of transformers' BloomConfig (config.json of BloomForCausalLM). A BLOOM-MoE model's are BLOOM's
        under model_type "bloom_moe" (no transformers class loads it) with its MoE fields under "moe"
        (docs/MOE.md)."""
        if self.is_moe:
            dense = self.to_hf_dict_dense()
            return dense | {"model_type": "bloom_moe", "architectures": ["BloomMoEForCausalLM"], "moe": self.moe_dict()}
        return self.to_hf_dict_dense()

    def to_hf_dict_dense(self) -> dict[str, Any]:
        return {
            "model_type": "bloom",
            "architectures": ["BloomForCausalLM"],
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "n_layer": self.n_layer,
            "n_head": self.n_head,
            "layer_norm_epsilon": self.layer_norm_epsilon,
            "initializer_range": self.initializer_range,
            "hidden_dropout": self.hidden_dropout,
            "attention_dropout": self.attention_dropout,
            "apply_residual_connection_post_layernorm": False,
            "tie_word_embeddings": True,
            "use_cache": True,
            "pretraining_tp": 1,
            "slow_but_exact": False,
            "unk_token_id": UNK_TOKEN_ID,
            "bos_token_id": BOS_TOKEN_ID,
            "eos_token_id": EOS_TOKEN_ID,
            "pad_token_id": PAD_TOKEN_ID,
        }

    @classmethod
    def from_hf_dict(cls, d: Mapping[str, Any]) -> BloomConfig:
        """Read a transformers Bloom config.json (also the older `n_embed` / generic `num_*` spellings).

        Raises ValueError for a config this model cannot represent exactly.
        """
        model_type = d.get("model_type", "bloom")
        if model_type != "bloom":
            raise ValueError(f"model_type is {model_type!r}, expected 'bloom'")
        if d.get("apply_residual_connection_post_layernorm", False):
            raise ValueError("apply_residual_connection_post_layernorm=true is not BLOOM as published")
        if not d.get("tie_word_embeddings", True):
            raise ValueError("tie_word_embeddings=false: BLOOM ties its output head to the word embeddings")

        def pick(*names: str) -> Any:
            for name in names:
                if d.get(name) is not None:
                    return d[name]
            raise ValueError(f"config has none of {', '.join(names)}")

        return cls(
            vocab_size=pick("vocab_size"),
            hidden_size=pick("hidden_size", "n_embed"),
            n_layer=pick("n_layer", "num_hidden_layers"),
            n_head=pick("n_head", "num_attention_heads"),
            layer_norm_epsilon=float(d.get("layer_norm_epsilon", 1e-5)),
            initializer_range=float(d.get("initializer_range", 0.02)),
            hidden_dropout=float(d.get("hidden_dropout", 0.0)),
            attention_dropout=float(d.get("attention_dropout", 0.0)),
        )


MOE_FIELDS = (
    "moe_num_experts",
    "moe_top_k",
    "moe_every",
    "moe_capacity_factor",
    "moe_eval_capacity_factor",
    "moe_min_capacity",
    "moe_aux_loss_coef",
    "moe_drop_tokens",
    "moe_random_routing",
)


def config_for_shape(shape: ModelShape, vocab_size: int) -> BloomConfig:
    """The BloomConfig of a planned shape (plan.json's "model"), with `vocab_size` embedding rows: the tokenizer's
    entries padded to 128 x tp, which only the tokenizer stage knows. init_std becomes initializer_range, the std
    every weight matrix and the word embedding draw from (BloomForCausalLM.init_weights)."""
    if shape.ffn_hidden != 4 * shape.hidden:
        raise ValueError(
            f"model {shape.name}: ffn_hidden({shape.ffn_hidden}) != 4 x hidden({shape.hidden}); BLOOM's MLP is 4x wide"
        )
    return BloomConfig(
        vocab_size=vocab_size,
        hidden_size=shape.hidden,
        n_layer=shape.layers,
        n_head=shape.heads,
        layer_norm_epsilon=shape.layer_norm_epsilon,
        initializer_range=shape.init_std,
        **{name: getattr(shape, name) for name in MOE_FIELDS if hasattr(shape, name)},
    )
