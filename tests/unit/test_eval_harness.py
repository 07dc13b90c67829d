"""Task scoring against transformers' own numbers, and the metric arithmetic on hand-made cases."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
import transformers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from appliance.eval.harness import TextCodec, choice_scores, evaluate_task, exact_match, mean_and_stderr, score_task
from appliance.eval.scoring import ModelScorer, generate_greedy, score_log_likelihoods
from appliance.eval.tasks import load_task
from appliance.model.bloom import BloomForCausalLM
from appliance.model.config import BloomConfig

CONFIG = BloomConfig(vocab_size=320, hidden_size=48, n_layer=2, n_head=6)
TEXTS = [
    "The cat sat on the mat. The dog sat on the rug.",
    "Le chat dort sur le tapis, le chien dort dehors.",
    "El gato duerme en la alfombra y el perro fuera.",
    "猫在垫子上睡觉，狗在外面。",
]


@pytest.fixture(scope="module")
def tokenizer_json(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=320,
        special_tokens=["<unk>", "<s>", "</s>", "<pad>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator(TEXTS * 4, trainer)
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    tokenizer.save(str(path))
    return path


@pytest.fixture(scope="module")
def pair() -> tuple[transformers.BloomForCausalLM, BloomForCausalLM]:
    torch.manual_seed(3)
    hf = transformers.BloomForCausalLM(transformers.BloomConfig(**CONFIG.to_hf_dict())).eval()
    with torch.no_grad():  # away from init, so log-probabilities differ clearly between choices
        for param in hf.parameters():
            param.add_(0.3 * torch.randn_like(param))
    ours = BloomForCausalLM(CONFIG).eval()
    ours.load_state_dict(hf.state_dict(), strict=True)
    return hf, ours


def direct_log_likelihood(hf: transformers.BloomForCausalLM, context: list[int], continuation: list[int], window: int):
    """log p(continuation | context) straight from transformers, one request at a time, no padding."""
    tokens = (context + continuation)[-(window + 1) :]
    with torch.no_grad():
        logprobs = torch.log_softmax(hf(torch.tensor([tokens[:-1]])).logits[0].double(), dim=-1)
    targets = torch.tensor(tokens[1:])
    picked = logprobs.gather(-1, targets[:, None]).squeeze(-1)[-len(continuation) :]
    greedy = bool((logprobs.argmax(-1)[-len(continuation) :] == targets[-len(continuation) :]).all())
    return float(picked.sum()), greedy


def test_log_likelihoods_equal_transformers(pair, tokenizer_json):
    hf, ours = pair
    codec = TextCodec(tokenizer_json)
    requests = [
        codec.encode_pair("The cat sat on the", " mat"),
        codec.encode_pair("The cat sat on the ", "rug."),  # the trailing space moves to the continuation
        codec.encode_pair("Le chat dort sur le tapis, le chien", " dort dehors."),
        codec.encode_pair("猫在垫子上", "睡觉，狗在外面。"),
        codec.encode_pair("", " The dog"),  # no context: conditioned on </s>
    ]
    assert requests[1][1][0] == codec.encode(" rug")[0] and requests[4][0] == [codec.eos_id]
    for window in (64, 9):  # 9 tokens: the longer requests lose the start of their context, as in lm-eval
        ours_scores = score_log_likelihoods(
            ModelScorer(ours).target_logprobs, requests, max_length=window, batch_size=2, pad_id=codec.pad_id
        )
        hf_scores = score_log_likelihoods(ModelScorer(hf).target_logprobs, requests, max_length=window, batch_size=5)
        for (ctx, cont), mine, theirs in zip(requests, ours_scores, hf_scores, strict=True):
            expected = direct_log_likelihood(hf, ctx, cont, window)
            assert mine[0] == pytest.approx(expected[0], abs=1e-4) and mine[1] == expected[1]
            assert theirs[0] == pytest.approx(expected[0], abs=1e-4) and theirs[1] == expected[1]


def test_greedy_generation_equals_transformers_generate(pair):
    hf, ours = pair
    prompts = [[40, 41, 42, 43, 44, 45], [50, 51], [60, 61, 62, 63]]  # different lengths: left padding in a batch
    got = generate_greedy(
        ModelScorer(ours).next_tokens, prompts, max_new_tokens=6, max_length=32, is_done=lambda t: False, pad_id=3
    )
    for prompt, tokens in zip(prompts, got, strict=True):
        with torch.no_grad():
            expected = hf.generate(
                input_ids=torch.tensor([prompt]), max_new_tokens=6, do_sample=False, eos_token_id=None, pad_token_id=3
            )[0, len(prompt) :].tolist()
        assert tokens == expected
    stopped = generate_greedy(
        ModelScorer(ours).next_tokens, prompts, max_new_tokens=6, max_length=32, is_done=lambda t: len(t) == 2
    )
    assert stopped == [tokens[:2] for tokens in got]


def write_quiz(folder: Path, output_type: str, extra: str = "") -> Path:
    docs = [
        {"text": "The cat sat on the", "choices": ["mat.", "rug.", "dog."], "label": 0, "word": "mat"},
        {"text": "Le chat dort sur le", "choices": ["tapis.", "chien."], "label": 1, "word": "tapis"},
        {
            "text": "El gato duerme en la",
            "choices": ["alfombra.", "gato.", "perro.", "fuera."],
            "label": 0,
            "word": "x",
        },
    ]
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "test.jsonl").write_text("".join(json.dumps(d, ensure_ascii=False) + "\n" for d in docs))
    target = '"{{label}}"' if output_type == "multiple_choice" else '"{{word}}"'
    if output_type == "loglikelihood":
        target = '" {{word}}"'
    text = (
        f"task: quiz_{output_type}\ndataset_path: json\ndataset_kwargs: {{data_files: {{test: test.jsonl}}}}\n"
        f'test_split: test\noutput_type: {output_type}\ndoc_to_text: "{{{{text}}}}"\ndoc_to_target: {target}\n'
        f'doc_to_choice: "{{{{choices}}}}"\n{extra}'
    )
    (folder / "task.yaml").write_text(text)
    return folder / "task.yaml"


def test_multiple_choice_task_scores_every_choice_like_lm_eval(pair, tokenizer_json, tmp_path):
    hf, ours = pair
    codec = TextCodec(tokenizer_json)
    task = load_task(write_quiz(tmp_path, "multiple_choice"))
    per_doc = score_task(task, ModelScorer(ours), codec, max_length=64, batch_size=4)
    for i, doc in enumerate(task.docs):
        expected = [direct_log_likelihood(hf, *codec.encode_pair(doc["text"], " " + c), 64)[0] for c in doc["choices"]]
        assert per_doc[i]["lls"] == pytest.approx(expected, abs=1e-4)
        assert per_doc[i]["acc"] == float(max(range(len(expected)), key=expected.__getitem__) == doc["label"])
    result = evaluate_task(task, ModelScorer(ours), codec, max_length=64, limit=2)
    assert result["n"] == 2 and result["output_type"] == "multiple_choice"
    assert result["acc"] == pytest.approx(sum(d["acc"] for d in per_doc[:2]) / 2)
    assert set(result) >= {"acc", "acc_stderr", "acc_norm", "acc_norm_stderr", "acc_bytes", "acc_bytes_stderr"}


def test_loglikelihood_and_generation_tasks(pair, tokenizer_json, tmp_path):
    hf, ours = pair
    codec = TextCodec(tokenizer_json)
    task = load_task(write_quiz(tmp_path / "ll", "loglikelihood"))
    result = evaluate_task(task, ModelScorer(ours), codec, max_length=64)
    lls = [direct_log_likelihood(hf, *codec.encode_pair(d["text"], " " + d["word"]), 64)[0] for d in task.docs]
    assert result["perplexity"] == pytest.approx(math.exp(-sum(lls) / 3), rel=1e-4)
    assert result["acc_norm"] is None and result["n"] == 3

    task = load_task(
        write_quiz(tmp_path / "gen", "generate_until", "generation_kwargs: {until: ['.'], max_gen_toks: 4}\n")
    )
    per_doc = score_task(task, ModelScorer(ours), codec, max_length=64)
    for i, doc in enumerate(task.docs):
        with torch.no_grad():
            prompt = codec.encode(doc["text"])
            out = hf.generate(input_ids=torch.tensor([prompt]), max_new_tokens=4, do_sample=False, pad_token_id=3)
        new = out[0, len(prompt) :].tolist()
        expected_text = codec.decode(new[: new.index(codec.eos_id)] if codec.eos_id in new else new).split(".")[0]
        assert per_doc[i]["generation"] == expected_text
        assert per_doc[i]["acc"] == float(expected_text == doc["word"])
    assert evaluate_task(task, ModelScorer(ours), codec, max_length=64)["metric"] == "exact_match"


def test_accuracy_normalization_and_standard_error_by_hand():
    # Raw log-likelihoods favour the short choice; per character the long one wins; per byte the short one again
    # (its two characters take 6 bytes): -4 / 2 < -9 / 10 < -4 / 6.
    lls = [-4.0, -9.0]
    assert choice_scores(lls, ["日本", "abcdefghij"], target=1) == {"acc": 0.0, "acc_norm": 1.0, "acc_bytes": 0.0}
    assert choice_scores([-2.0, -2.0], ["a", "b"], target=0)["acc"] == 1.0  # ties go to the first choice

    # 3 of 4 right: mean 0.75; sample variance (3 * 0.0625 + 0.5625) / 3 = 0.25; stderr sqrt(0.25 / 4) = 0.25.
    assert mean_and_stderr([1, 1, 0, 1]) == (0.75, pytest.approx(0.25))
    assert mean_and_stderr([1.0]) == (1.0, None) and mean_and_stderr([]) == (None, None)
    mean, stderr = mean_and_stderr([1] * 30 + [0] * 10)  # sqrt(p (1 - p) / (n - 1)) for 0/1 scores
    assert (mean, stderr) == (0.75, pytest.approx(math.sqrt(0.75 * 0.25 / 39)))


def test_exact_match_options():
    assert exact_match("Paris", "Paris", {}) and not exact_match("paris", "Paris", {})
    assert exact_match("paris!", "Paris", {"ignore_case": True, "ignore_punctuation": True})
    assert exact_match("42 apples", "apples", {"regexes_to_ignore": [r"\d+ "]})
    assert exact_match("a1b2", "ab", {"ignore_numbers": True})
