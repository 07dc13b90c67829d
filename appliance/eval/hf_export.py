"""Hugging Face transformers Bloom format: export a trained model, import a published checkpoint.

An export directory loads with `BloomForCausalLM.from_pretrained(dir)` and `AutoTokenizer.from_pretrained(dir)`:
config.json, generation_config.json, model.safetensors (or numbered shards plus model.safetensors.index.json),
tokenizer.json, tokenizer_config.json, special_tokens_map.json. Weights are read and written with safetensors
only; pickled checkpoints (pytorch_model.bin) are never opened.

A BLOOM-MoE model (config.moe_num_experts > 0) has no transformers class: it exports to the same directory layout
with its MoE blocks' gate and experts under their own names and a config.json of model_type "bloom_moe" (the
format is docs/MOE.md's); transformers' BloomForCausalLM refuses it by its model_type, as ``import_hf`` does.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from tokenizers import Tokenizer

from appliance.errors import BadInput
from appliance.model.config import BloomConfig
from appliance.output_dirs import Inputs, OutputDir, claim_dir, matching, read_json_object

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
TIED_HEAD = "lm_head.weight"
# transformers names these four; BLOOM's tokenizer has them at ids 0..3.
SPECIAL_TOKENS = {"unk_token": "<unk>", "bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>"}
_BARE_PREFIXES = ("word_embeddings.", "word_embeddings_layernorm.", "h.", "ln_f.")
GENERATION_CONFIG = "generation_config.json"
# Every name an export writes: an earlier export's files are these, and only these are ever replaced or removed.
OUTPUT_NAMES = (
    "config.json",
    GENERATION_CONFIG,
    SINGLE_FILE,
    "model-*-of-*.safetensors",
    INDEX_FILE,
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
)
MODEL_TYPES = ("bloom", "bloom_moe")


def expected_shapes(config: BloomConfig) -> dict[str, tuple[int, ...]]:
    """Every stored tensor of a BloomForCausalLM (the tied head excluded), in file order, with its shape."""
    h, ffn = config.hidden_size, config.ffn_hidden_size
    shapes: dict[str, tuple[int, ...]] = {
        "transformer.word_embeddings.weight": (config.vocab_size, h),
        "transformer.word_embeddings_layernorm.weight": (h,),
        "transformer.word_embeddings_layernorm.bias": (h,),
    }
    for i in range(config.n_layer):
        p = f"transformer.h.{i}."
        shapes |= {
            p + "input_layernorm.weight": (h,),
            p + "input_layernorm.bias": (h,),
            p + "self_attention.query_key_value.weight": (3 * h, h),
            p + "self_attention.query_key_value.bias": (3 * h,),
            p + "self_attention.dense.weight": (h, h),
            p + "self_attention.dense.bias": (h,),
            p + "post_attention_layernorm.weight": (h,),
            p + "post_attention_layernorm.bias": (h,),
        }
        mlps = [f"{p}mlp."]
        if config.is_moe_block(i):  # docs/MOE.md: the gate, then every expert, a BLOOM MLP each
            shapes[f"{p}mlp.gate.weight"] = (config.moe_num_experts, h)
            mlps = [f"{p}mlp.experts.{e}." for e in range(config.moe_num_experts)]
        for m in mlps:
            shapes |= {
                m + "dense_h_to_4h.weight": (ffn, h),
                m + "dense_h_to_4h.bias": (ffn,),
                m + "dense_4h_to_h.weight": (h, ffn),
                m + "dense_4h_to_h.bias": (h,),
            }
    shapes |= {"transformer.ln_f.weight": (h,), "transformer.ln_f.bias": (h,)}
    return shapes


def canonical_name(key: str) -> str:
    """transformers' BloomForCausalLM name for key; bigscience checkpoints store the bare BloomModel names."""
    return "transformer." + key if key.startswith(_BARE_PREFIXES) else key


def _match_names(keys: list[str], config: BloomConfig, source: str) -> dict[str, str]:
    """Map each expected name to the key that holds it; BadInput for missing or unknown tensors."""
    by_name: dict[str, str] = {}
    for key in keys:
        name = canonical_name(key)
        if name == TIED_HEAD:
            continue  # tied to the word embeddings; the embedding tensor is the one kept
        if name in by_name:
            raise BadInput(f"{source}: tensor {name} appears twice (as {by_name[name]} and {key})")
        by_name[name] = key
    expected = expected_shapes(config)
    unknown = [key for name, key in by_name.items() if name not in expected]
    missing = [name for name in expected if name not in by_name]
    if missing or unknown:
        parts = []
        if missing:
            parts.append(f"missing {len(missing)} tensor(s), e.g. {', '.join(missing[:3])}")
        if unknown:
            parts.append(f"{len(unknown)} unexpected tensor(s), e.g. {', '.join(unknown[:3])}")
        raise BadInput(f"{source}: not a BLOOM model of this shape: " + "; ".join(parts))
    return by_name


def _check_shape(name: str, tensor: torch.Tensor, expected: tuple[int, ...], source: str) -> None:
    if tuple(tensor.shape) != expected:
        raise BadInput(f"{source}: {name} has shape {tuple(tensor.shape)}, expected {expected}")


def _file_tensor(tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A CPU tensor that owns its storage (safetensors rejects views into shared buffers)."""
    return tensor.detach().to(device="cpu", dtype=dtype, copy=True).contiguous()


def _plan_shards(sizes: dict[str, int], max_shard_bytes: int) -> list[list[str]]:
    """Consecutive tensors grouped so each group stays under max_shard_bytes (a larger tensor gets its own)."""
    shards: list[list[str]] = [[]]
    used = 0
    for name, size in sizes.items():
        if shards[-1] and used + size > max_shard_bytes:
            shards.append([])
            used = 0
        shards[-1].append(name)
        used += size
    return shards


def _write_json(path: Path, data: Mapping[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def _load_tokenizer(tokenizer_json: Path, config: BloomConfig) -> dict[str, int | None]:
    """Check the tokenizer fits the model; return transformers' special-token id keys (None for an absent token)."""
    if not tokenizer_json.is_file():
        raise BadInput(f"{tokenizer_json}: tokenizer.json not found")
    try:
        tokenizer = Tokenizer.from_file(str(tokenizer_json))
    except Exception as exc:  # tokenizers raises a bare Exception for unreadable or malformed files
        raise BadInput(f"{tokenizer_json}: not a readable tokenizer.json ({exc})") from exc
    vocab = tokenizer.get_vocab_size(with_added_tokens=True)
    if vocab > config.vocab_size:
        raise BadInput(f"{tokenizer_json}: {vocab} tokens, more than the model's {config.vocab_size}")
    return {f"{role}_id": tokenizer.token_to_id(token) for role, token in SPECIAL_TOKENS.items()}


def _write_tokenizer(
    tokenizer_json: Path, out: Path, special_ids: Mapping[str, int | None], model_max_length: int | None
) -> None:
    """Copy tokenizer.json and write the two small files transformers reads beside it."""
    shutil.copyfile(tokenizer_json, out / "tokenizer.json")
    present = {role: token for role, token in SPECIAL_TOKENS.items() if special_ids[f"{role}_id"] is not None}
    tokenizer_config: dict[str, Any] = {
        "tokenizer_class": "BloomTokenizerFast",
        # BLOOM pads on the left so a batch of prompts ends aligned for generation.
        "padding_side": "left",
        "add_prefix_space": False,
        "clean_up_tokenization_spaces": False,
        **present,
    }
    if model_max_length is not None:
        tokenizer_config["model_max_length"] = model_max_length
    _write_json(out / "tokenizer_config.json", tokenizer_config)
    _write_json(out / "special_tokens_map.json", present)


def claim_export_dir(out_dir: Path, *, inputs: Inputs | None = None, force: bool = False) -> OutputDir:
    """--out: new, empty or an earlier export, and none of `inputs` (appliance/output_dirs.py); BadInput otherwise.
    `force`: write beside files the export did not write (never over them). Writes nothing."""
    return claim_dir(out_dir, "export", inputs=inputs, force=force, legacy=_earlier_export, writes=OUTPUT_NAMES)


def _earlier_export(out_dir: Path) -> list[str] | None:
    """An export written before the marker existed: a Bloom config.json beside a generation_config.json. A bare
    config.json is not enough: other projects' folders hold one."""
    config = read_json_object(out_dir / "config.json")
    if config is None or config.get("model_type") not in MODEL_TYPES or not (out_dir / GENERATION_CONFIG).is_file():
        return None
    return matching(out_dir, OUTPUT_NAMES)


def export_hf(
    state_dict: Mapping[str, torch.Tensor],
    config: BloomConfig,
    tokenizer_json: Path,
    out_dir: Path,
    *,
    max_shard_bytes: int = 2 * 1024**3,
    dtype: torch.dtype = torch.float32,
    model_max_length: int | None = None,
    inputs: Inputs | None = None,
    force: bool = False,
) -> Path:
    """Write a transformers Bloom model directory at out_dir and return it.

    state_dict: our (= transformers') names, with or without "transformer." and the tied lm_head.weight (dropped).
    Tensors are converted to dtype one shard at a time, so at most one shard is held twice. The export is built in
    a hidden staging folder inside out_dir and its files renamed into place, each whole: a crash before that leaves
    out_dir as it was. out_dir must be new, empty or an earlier export (`claim_export_dir`, with `inputs` and
    `force`); a rerun replaces or removes only the earlier export's files.
    """
    out_dir, tokenizer_json = Path(out_dir), Path(tokenizer_json)
    if max_shard_bytes <= 0:
        raise ValueError(f"max_shard_bytes must be > 0 (got {max_shard_bytes})")
    special_ids = _load_tokenizer(tokenizer_json, config)
    out = claim_export_dir(out_dir, inputs=inputs, force=force)
    source = "state_dict to export"
    names = _match_names(list(state_dict), config, source)
    expected = expected_shapes(config)
    for name, key in names.items():
        _check_shape(name, state_dict[key], expected[name], source)

    itemsize = torch.empty((), dtype=dtype).element_size()
    sizes = {name: state_dict[names[name]].numel() * itemsize for name in expected}
    shards = _plan_shards(sizes, max_shard_bytes)

    tmp = out.staging()
    try:
        _write_tokenizer(tokenizer_json, tmp, special_ids, model_max_length)
        weight_map: dict[str, str] = {}
        for index, shard in enumerate(shards, start=1):
            file_name = SINGLE_FILE if len(shards) == 1 else f"model-{index:05d}-of-{len(shards):05d}.safetensors"
            tensors = {name: _file_tensor(state_dict[names[name]], dtype) for name in shard}
            save_file(tensors, str(tmp / file_name), metadata={"format": "pt"})
            del tensors
            weight_map |= dict.fromkeys(shard, file_name)
        if len(shards) > 1:
            _write_json(tmp / INDEX_FILE, {"metadata": {"total_size": sum(sizes.values())}, "weight_map": weight_map})
        dtype_name = str(dtype).removeprefix("torch.")
        # "dtype" is read by transformers 5, "torch_dtype" by 4.x (e.g. an lm-evaluation-harness install).
        # The special-token ids are the tokenizer's, in case they are not BLOOM's 0..3.
        hf_config = config.to_hf_dict() | special_ids | {"dtype": dtype_name, "torch_dtype": dtype_name}
        _write_json(tmp / "config.json", hf_config)
        generation = {k: v for k, v in special_ids.items() if k != "unk_token_id" and v is not None}
        _write_json(tmp / "generation_config.json", generation)
        out.publish(tmp)
    except BaseException:
        out.abandon(tmp)
        raise
    return out_dir


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise BadInput(f"{path}: not readable JSON ({exc})") from exc


def import_hf(model_dir: Path) -> tuple[BloomConfig, dict[str, torch.Tensor]]:
    """Read a transformers Bloom checkpoint (safetensors, single file or sharded) into our config and names.

    The returned state_dict uses BloomForCausalLM's names, keeps the stored dtype, and includes lm_head.weight as
    the same tensor as the word embeddings, so `model.load_state_dict(sd)` works strictly.
    """
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise BadInput(f"{model_dir}: not a directory")
    config_path = model_dir / "config.json"
    if not config_path.is_file():
        raise BadInput(f"{config_path}: missing; not a transformers model directory")
    raw_config = _read_json(config_path)
    if not isinstance(raw_config, dict):
        raise BadInput(f"{config_path}: expected a JSON object")
    try:
        config = BloomConfig.from_hf_dict(raw_config)
    except ValueError as exc:
        raise BadInput(f"{config_path}: {exc}") from exc

    if (model_dir / INDEX_FILE).is_file():
        index = _read_json(model_dir / INDEX_FILE)
        weight_map = index.get("weight_map") if isinstance(index, dict) else None
        if not isinstance(weight_map, dict) or not weight_map:
            raise BadInput(f"{model_dir / INDEX_FILE}: no weight_map")
        files = list(dict.fromkeys(weight_map.values()))
    elif (model_dir / SINGLE_FILE).is_file():
        files = [SINGLE_FILE]
    else:
        raise BadInput(
            f"{model_dir}: no {SINGLE_FILE} or {INDEX_FILE} (pickled pytorch_model.bin checkpoints are not read)"
        )

    stored: dict[str, torch.Tensor] = {}
    for file_name in files:
        path = model_dir / file_name
        if Path(file_name).name != file_name or not path.is_file():
            raise BadInput(f"{path}: listed in {INDEX_FILE} but missing")
        try:
            with safe_open(str(path), framework="pt") as reader:
                for key in reader.keys():  # noqa: SIM118 - safe_open is not a Mapping
                    if canonical_name(key) != TIED_HEAD:
                        stored[key] = reader.get_tensor(key)
        except (SafetensorError, OSError) as exc:
            raise BadInput(f"{path}: not a readable safetensors file ({exc})") from exc

    source = str(model_dir)
    names = _match_names(list(stored), config, source)
    expected = expected_shapes(config)
    state_dict = {}
    for name, shape in expected.items():
        _check_shape(name, stored[names[name]], shape, source)
        state_dict[name] = stored[names[name]]
    state_dict[TIED_HEAD] = state_dict["transformer.word_embeddings.weight"]
    return config, state_dict
