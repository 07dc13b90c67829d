"""Export from any layout without holding the model: tensors are read from the shards one parameter at a time."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file

import appliance.parallel.checkpoint.weight_shards as shards
from appliance.model.bloom import BloomForCausalLM
from appliance.model.config import BloomConfig
from appliance.parallel.checkpoint.weight_shards import FULL_MODEL_FILE, LazyFullStateDict, shard_file_name
from appliance.parallel.tensor.param_splits import shard_state_dict


def _full_state() -> dict[str, torch.Tensor]:
    model = BloomForCausalLM(BloomConfig(vocab_size=256, hidden_size=32, n_layer=4, n_head=4))
    model.init_weights(seed=0)
    state = {k: v.detach().clone() for k, v in model.state_dict().items() if k != "lm_head.weight"}
    return state


def _stage_of(name: str) -> set[int]:
    """Pipeline stage(s) of a parameter at pp=2, 4 layers: the tied embedding sits in the first and the last."""
    if name.startswith("transformer.h."):
        return {0 if int(name.split(".")[2]) < 2 else 1}
    if name.startswith("transformer.ln_f"):
        return {1}
    if name.startswith("transformer.word_embeddings."):
        return {0, 1}
    return {0}  # the embedding LayerNorm


def test_tp2_pp2_shards_read_back_as_the_full_model_lazily(tmp_path, monkeypatch):
    full = _full_state()
    for t in range(2):
        mine = shard_state_dict(full, t, 2)
        for p in range(2):
            stage = {k: v.contiguous() for k, v in mine.items() if p in _stage_of(k)}
            save_file(stage, str(tmp_path / shard_file_name(t, p)))

    reads: list[str] = []
    real_safe_open = shards.safe_open

    class CountingOpen:
        def __init__(self, *args, **kwargs):  # type: ignore[no-untyped-def]
            self.handle = real_safe_open(*args, **kwargs)

        def __enter__(self):  # type: ignore[no-untyped-def]
            self.inner = self.handle.__enter__()
            return self

        def __exit__(self, *exc):  # type: ignore[no-untyped-def]
            return self.handle.__exit__(*exc)

        def keys(self):  # type: ignore[no-untyped-def]
            return self.inner.keys()

        def metadata(self):  # type: ignore[no-untyped-def]
            return self.inner.metadata()

        def get_tensor(self, name):  # type: ignore[no-untyped-def]
            reads.append(name)
            return self.inner.get_tensor(name)

    monkeypatch.setattr(shards, "safe_open", CountingOpen)
    lazy = LazyFullStateDict(tmp_path)
    assert reads == []  # opening the checkpoint reads no tensor
    assert set(lazy) == set(full)
    qkv = "transformer.h.3.self_attention.query_key_value.weight"
    torch.testing.assert_close(lazy[qkv], full[qkv], rtol=0, atol=0)
    assert reads == [qkv, qkv]  # that one parameter, from each of the two TP ranks of its stage
    for name, tensor in full.items():
        torch.testing.assert_close(lazy[name], tensor, rtol=0, atol=0, msg=name)


def test_single_file_form_and_missing_shards(tmp_path):
    full = _full_state()
    save_file(full, str(tmp_path / FULL_MODEL_FILE))
    lazy = LazyFullStateDict(tmp_path)
    assert all(torch.equal(lazy[k], v) for k, v in full.items())
    broken = tmp_path / "broken"
    broken.mkdir()
    save_file({"x": torch.zeros(1)}, str(broken / shard_file_name(1, 0)))
    with pytest.raises(FileNotFoundError, match=shard_file_name(0, 0)):
        LazyFullStateDict(broken)
