"""Greedy generation against transformers' generate(do_sample=False), and the text sample for eval.json."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
import transformers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from appliance.errors import BadInput
from appliance.model.bloom import BloomForCausalLM
from appliance.model.config import BloomConfig
from appliance.model.generate import greedy_generate, sample_text

CONFIG = BloomConfig(vocab_size=300, hidden_size=48, n_layer=2, n_head=6)


@pytest.fixture(scope="module")
def pair() -> tuple[transformers.BloomForCausalLM, BloomForCausalLM]:
    hf_config = transformers.BloomConfig(**CONFIG.to_hf_dict())
    torch.manual_seed(11)
    hf = transformers.BloomForCausalLM(hf_config).eval()
    with torch.no_grad():  # larger weights than init, so the argmax is not a near-tie between tokens
        for param in hf.parameters():
            param.add_(0.3 * torch.randn_like(param))
    ours = BloomForCausalLM(CONFIG).eval()
    ours.load_state_dict(hf.state_dict(), strict=True)
    return hf, ours


def test_greedy_equals_transformers_generate(pair):
    hf, ours = pair
    ids = torch.randint(4, 300, (2, 7), generator=torch.Generator().manual_seed(2))
    mask = torch.ones_like(ids)
    mask[1, :3] = 0  # left padding, as for a batch of prompts
    ids = ids.masked_fill(mask == 0, 3)
    with torch.no_grad():
        expected = hf.generate(
            input_ids=ids, attention_mask=mask, max_new_tokens=8, do_sample=False, eos_token_id=None, pad_token_id=3
        )
    got = greedy_generate(ours, ids, 8, attention_mask=mask)
    assert got.shape == (2, 15)
    assert torch.equal(got, expected)


def test_eos_stops_generation_and_fills_finished_rows(pair):
    _, ours = pair
    ids = torch.randint(4, 300, (1, 5), generator=torch.Generator().manual_seed(4))
    free = greedy_generate(ours, ids, 6)
    eos = int(free[0, 7])  # the third new token
    stopped = greedy_generate(ours, ids, 6, eos_token_id=eos)
    first_eos = int((free[0, 5:] == eos).nonzero()[0])
    assert stopped.shape[1] == 5 + first_eos + 1
    assert torch.equal(stopped, free[:, : stopped.shape[1]])

    other = torch.randint(4, 300, (1, 5), generator=torch.Generator().manual_seed(9))
    both = greedy_generate(ours, torch.cat([ids, other]), 6, eos_token_id=eos)
    assert (both[0, 5 + first_eos :] == eos).all()  # the finished row keeps receiving eos


def test_generate_restores_training_mode(pair):
    _, ours = pair
    ours.train()
    try:
        greedy_generate(ours, torch.tensor([[5, 6, 7]]), 2)
        assert ours.training
    finally:
        ours.eval()
    with pytest.raises(ValueError, match="input_ids must be"):
        greedy_generate(ours, torch.tensor([5, 6]), 2)


@pytest.fixture(scope="module")
def tokenizer_json(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=290,
        special_tokens=["<unk>", "<s>", "</s>", "<pad>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator(["the cat sat on the mat", "a dog and a cat", "die Katze, le chat"] * 3, trainer)
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    tokenizer.save(str(path))
    return path


def test_sample_text_decodes_the_greedy_continuation(pair, tokenizer_json):
    _, ours = pair
    text = sample_text(ours, tokenizer_json, "the cat", 5)
    tokenizer = Tokenizer.from_file(str(tokenizer_json))
    prompt_ids = tokenizer.encode("the cat").ids
    continuation = greedy_generate(ours, torch.tensor([prompt_ids]), 5, eos_token_id=2)[0, len(prompt_ids) :]
    assert text == tokenizer.decode(continuation.tolist(), skip_special_tokens=True)
    assert isinstance(text, str) and text == sample_text(ours, tokenizer_json, "the cat", 5)


def test_sample_text_bad_input(pair, tokenizer_json, tmp_path):
    _, ours = pair
    with pytest.raises(BadInput, match="encodes to no tokens"):
        sample_text(ours, tokenizer_json, "", 3)
    bad = tmp_path / "tokenizer.json"
    bad.write_text("{}")
    with pytest.raises(BadInput, match=re.escape(f"{bad}: not a readable tokenizer.json")):
        sample_text(ours, bad, "the cat", 3)
    small = BloomForCausalLM(BloomConfig(vocab_size=200, hidden_size=16, n_layer=1, n_head=2))
    with pytest.raises(BadInput, match="outside the model's vocabulary of 200"):
        sample_text(small, tokenizer_json, "the cat and the dog", 3)
