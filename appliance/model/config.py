"""The shape of a BLOOM model, and its translation to and from transformers' config.json."""

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
        if problems:
            raise ValueError("invalid BLOOM config: " + "; ".join(problems))

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
        # word embeddings + embedding LayerNorm + final LayerNorm
        return self.vocab_size * h + 2 * h + self.n_layer * per_block + 2 * h

    def to_hf_dict(self) -> dict[str, Any]:
        """The keys of transformers' BloomConfig (config.json of BloomForCausalLM)."""
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
    )
