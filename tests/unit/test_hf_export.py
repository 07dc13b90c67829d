"""Export to, and import from, the transformers Bloom format; everything built locally, nothing downloaded."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
import transformers
from safetensors import safe_open
from safetensors.torch import save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

import appliance.eval.hf_export as hf_export
from appliance.errors import BadInput
from appliance.eval.hf_export import export_hf, import_hf
from appliance.model.bloom import BloomForCausalLM
from appliance.model.config import BloomConfig

# The model's vocabulary is larger than the tokenizer's, as BLOOM pads its vocabulary for tensor parallelism.
CONFIG = BloomConfig(vocab_size=320, hidden_size=48, n_layer=2, n_head=6)
SENTENCES = [
    "The quick brown fox jumps over the lazy dog.",
    "Le vif renard brun saute par-dessus le chien paresseux.",
    "El veloz zorro marrón salta sobre el perro perezoso.",
    "敏捷的棕色狐狸跳过了懒狗。",
    "Быстрая коричневая лиса перепрыгивает через ленивую собаку.",
    "def jump(fox, dog):\n    return fox.over(dog)",
]


@pytest.fixture(scope="module")
def tokenizer_json(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny byte-level BPE with BLOOM's four special tokens at ids 0..3."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<unk>", "<s>", "</s>", "<pad>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator(SENTENCES * 4, trainer)
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    tokenizer.save(str(path))
    return path


@pytest.fixture(scope="module")
def model() -> BloomForCausalLM:
    ours = BloomForCausalLM(CONFIG, seed=0).eval()
    with torch.no_grad():  # away from init, so a swapped or missing tensor shows in the logits
        for param in ours.parameters():
            param.add_(0.1 * torch.randn(param.shape, generator=torch.Generator().manual_seed(param.numel())))
    return ours


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(4, 300, (2, 9), generator=torch.Generator().manual_seed(5))
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    return ids, mask


def hf_logits(directory: Path) -> torch.Tensor:
    hf = transformers.BloomForCausalLM.from_pretrained(directory, local_files_only=True).eval()
    assert hf.lm_head.weight.data_ptr() == hf.transformer.word_embeddings.weight.data_ptr()
    ids, mask = batch()
    with torch.no_grad():
        return hf(input_ids=ids, attention_mask=mask).logits


def our_logits(model: BloomForCausalLM) -> torch.Tensor:
    ids, mask = batch()
    with torch.no_grad():
        return model(ids, mask)


def assert_same_real_logits(a: torch.Tensor, b: torch.Tensor) -> None:
    real = batch()[1].bool()
    assert (a[real] - b[real]).abs().max() < 1e-4


def test_export_loads_in_transformers(model, tokenizer_json, tmp_path):
    out = export_hf(model.state_dict(), CONFIG, tokenizer_json, tmp_path / "export")
    names = sorted(p.name for p in out.iterdir())
    assert names == [
        ".bloom-appliance.json",  # the marker: an earlier export, which a rerun may replace
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "special_tokens_map.json",
        "tokenizer.json",
        "tokenizer_config.json",
    ]
    with safe_open(str(out / "model.safetensors"), framework="pt") as reader:
        keys = set(reader.keys())
    assert "lm_head.weight" not in keys and "transformer.ln_f.bias" in keys
    assert_same_real_logits(hf_logits(out), our_logits(model))

    text = "Le renard saute, 狐狸 jumps!"
    hf_tokenizer = transformers.AutoTokenizer.from_pretrained(out, local_files_only=True)
    assert hf_tokenizer(text)["input_ids"] == Tokenizer.from_file(str(tokenizer_json)).encode(text).ids
    assert (hf_tokenizer.unk_token_id, hf_tokenizer.bos_token_id, hf_tokenizer.eos_token_id) == (0, 1, 2)
    assert hf_tokenizer.pad_token_id == 3 and hf_tokenizer.padding_side == "left"
    config = json.loads((out / "config.json").read_text())
    assert (config["pad_token_id"], config["eos_token_id"], config["dtype"]) == (3, 2, "float32")


def test_sharded_export_loads_and_imports(model, tokenizer_json, tmp_path):
    out = export_hf(model.state_dict(), CONFIG, tokenizer_json, tmp_path / "sharded", max_shard_bytes=40_000)
    shards = sorted(out.glob("model-*-of-*.safetensors"))
    assert len(shards) > 3 and not (out / "model.safetensors").exists()
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == {p.name for p in shards}
    assert index["metadata"]["total_size"] == 4 * CONFIG.num_parameters()
    assert_same_real_logits(hf_logits(out), our_logits(model))

    config, state_dict = import_hf(out)
    assert config == CONFIG
    reloaded = BloomForCausalLM(config).eval()
    reloaded.load_state_dict(state_dict, strict=True)
    assert torch.equal(our_logits(reloaded), our_logits(model))


def test_import_transformers_checkpoint(tmp_path):
    hf_config = transformers.BloomConfig(**CONFIG.to_hf_dict())
    torch.manual_seed(3)
    hf = transformers.BloomForCausalLM(hf_config).eval()
    with torch.no_grad():
        for param in hf.parameters():
            param.add_(0.1 * torch.randn_like(param))
    hf.save_pretrained(tmp_path / "hf")
    config, state_dict = import_hf(tmp_path / "hf")
    ours = BloomForCausalLM(config).eval()
    ours.load_state_dict(state_dict, strict=True)
    ids, mask = batch()
    with torch.no_grad():
        expected = hf(input_ids=ids, attention_mask=mask).logits
    assert_same_real_logits(our_logits(ours), expected)


def test_import_accepts_bare_bigscience_names(model, tmp_path):
    """bigscience checkpoints store BloomModel names (h.0..., no "transformer.") and sometimes the tied head."""
    bare = {k.removeprefix("transformer."): v.clone() for k, v in model.state_dict().items() if k != "lm_head.weight"}
    bare["lm_head.weight"] = bare["word_embeddings.weight"].clone()
    (tmp_path / "bare").mkdir()
    save_file(bare, str(tmp_path / "bare" / "model.safetensors"))
    config_dict = CONFIG.to_hf_dict()
    config_dict["n_embed"] = config_dict.pop("hidden_size")  # the older spelling
    (tmp_path / "bare" / "config.json").write_text(json.dumps(config_dict))
    config, state_dict = import_hf(tmp_path / "bare")
    assert config == CONFIG
    assert state_dict["lm_head.weight"] is state_dict["transformer.word_embeddings.weight"]
    reloaded = BloomForCausalLM(config).eval()
    reloaded.load_state_dict(state_dict, strict=True)
    assert torch.equal(our_logits(reloaded), our_logits(model))


def test_bf16_export_and_reexport_replaces(model, tokenizer_json, tmp_path):
    out = tmp_path / "export"
    export_hf(model.state_dict(), CONFIG, tokenizer_json, out)
    export_hf(model.state_dict(), CONFIG, tokenizer_json, out, dtype=torch.bfloat16, model_max_length=128)
    with safe_open(str(out / "model.safetensors"), framework="pt") as reader:
        assert reader.get_tensor("transformer.h.0.mlp.dense_h_to_4h.weight").dtype == torch.bfloat16
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    assert json.loads((out / "tokenizer_config.json").read_text())["model_max_length"] == 128
    assert [p.name for p in tmp_path.iterdir()] == ["export"]  # no temporary or old directory left behind


def test_failed_export_leaves_nothing(model, tokenizer_json, tmp_path, monkeypatch):
    def crash(*args: object, **kwargs: object) -> None:
        raise OSError("disk full")

    monkeypatch.setattr(hf_export, "save_file", crash)
    with pytest.raises(OSError, match="disk full"):
        export_hf(model.state_dict(), CONFIG, tokenizer_json, tmp_path / "export")
    assert list(tmp_path.iterdir()) == []


def test_export_rejects_bad_input(model, tokenizer_json, tmp_path):
    state_dict = dict(model.state_dict())
    del state_dict["transformer.h.1.mlp.dense_4h_to_h.bias"]
    with pytest.raises(BadInput, match=r"missing 1 tensor.*h\.1\.mlp\.dense_4h_to_h\.bias"):
        export_hf(state_dict, CONFIG, tokenizer_json, tmp_path / "a")
    wider = BloomConfig(vocab_size=320, hidden_size=60, n_layer=2, n_head=6)
    with pytest.raises(BadInput, match=r"word_embeddings.weight has shape \(320, 48\), expected \(320, 60\)"):
        export_hf(model.state_dict(), wider, tokenizer_json, tmp_path / "a")
    with pytest.raises(BadInput, match=r"tokenizer\.json not found"):
        export_hf(model.state_dict(), CONFIG, tmp_path / "none.json", tmp_path / "a")
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "notes.txt").write_text("mine")
    with pytest.raises(
        BadInput, match=r"busy: holds notes\.txt and no \.bloom-appliance\.json, so it is not an earlier"
    ):
        export_hf(model.state_dict(), CONFIG, tokenizer_json, tmp_path / "busy")
    small = BloomConfig(vocab_size=200, hidden_size=48, n_layer=2, n_head=6)
    small_state = {k: v[:200] if v.shape[0] == 320 else v for k, v in model.state_dict().items()}
    with pytest.raises(BadInput, match="more than the model's 200"):
        export_hf(small_state, small, tokenizer_json, tmp_path / "a")
    assert not (tmp_path / "a").exists()


def test_import_rejects_bad_input(model, tmp_path):
    with pytest.raises(BadInput, match=re.escape(f"{tmp_path / 'nowhere'}: not a directory")):
        import_hf(tmp_path / "nowhere")
    directory = tmp_path / "m"
    directory.mkdir()
    with pytest.raises(BadInput, match=r"config\.json: missing"):
        import_hf(directory)
    (directory / "config.json").write_text("{not json")
    with pytest.raises(BadInput, match=r"config\.json: not readable JSON"):
        import_hf(directory)
    (directory / "config.json").write_text(json.dumps(CONFIG.to_hf_dict() | {"model_type": "llama"}))
    with pytest.raises(BadInput, match="model_type"):
        import_hf(directory)
    (directory / "config.json").write_text(json.dumps(CONFIG.to_hf_dict()))
    (directory / "pytorch_model.bin").write_bytes(b"pickle")
    with pytest.raises(BadInput, match=r"pickled pytorch_model\.bin checkpoints are not read"):
        import_hf(directory)
    (directory / "model.safetensors").write_bytes(b"garbage")
    with pytest.raises(BadInput, match="not a readable safetensors file"):
        import_hf(directory)
    truncated = {k: v for k, v in model.state_dict().items() if ".h.1." not in k and k != "lm_head.weight"}
    save_file(truncated, str(directory / "model.safetensors"))
    with pytest.raises(BadInput, match=r"missing 12 tensor"):
        import_hf(directory)
