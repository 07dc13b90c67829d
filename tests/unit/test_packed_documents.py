"""Packed documents under reset_attention_mask: each document of a pack behaves as if it ran alone.

Four documents of different lengths, each ended by the EOD token, are packed into one sequence. With document ids,
every document's per-token log-probs and its loss gradient equal those of the document run alone through the
single-process model; without them they do not (the later documents see the earlier ones). That the ALiBi bias
needs no change (alibi.RankAlibi.bias_and_mask: a row-constant shift that softmax drops) is what these
comparisons prove: the packed run keeps the absolute key positions, the run alone starts each document at 0.

Tolerances. fp64: attention runs its softmax in float64 for float64 inputs (ops.attention_probs), but the LayerNorm
kernel keeps float32 statistics and float32 weight-gradient sums (ops.layer_norm), so the fp64 runs here swap in
torch's LayerNorm in float64 to take float32 out of the comparison; with 4 heads the slopes are powers of two, so the
float32 ALiBi bias is exact and only float64 rounding is left: 1e-10. fp32 (the model as it runs, unpatched): the
bound is a multiple of the floor measured on the spot, how far the fp32 run of a document alone is from its fp64 run;
packing moves the arithmetic no further than a few floors.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest
import torch

from appliance.data.documents import dataset_eod_id, document_ids, document_lengths
from appliance.data.sample_corpus import SAMPLE_CORPUS_DIR
from appliance.errors import BadInput
from appliance.model import ops
from appliance.model.bloom import BloomForCausalLM
from appliance.model.config import BloomConfig
from appliance.overrides import parse_overrides
from appliance.planner.runspec import load_spec
from appliance.run_request import RunRequest, apply_request, make_run_plan

EOD = 2  # </s> in our tokenizers (appliance/tokenizer/vocab.py)
CONFIG = BloomConfig(vocab_size=64, hidden_size=32, n_layer=2, n_head=4)
LENGTHS = (5, 11, 3, 9)  # tokens before each document's EOD
FP64_BOUND = 1e-10
# Packing puts a document's keys at other absolute positions (a larger ALiBi bias before the row shift) and sums the
# softmax over more (masked, zero) keys: measured 0.4-1.1 floors over five seeds on a 2-core AMD EPYC (floor
# 1.1e-7 to 1.6e-7); 8 leaves room for other summation orders, far below the gap without document ids (27,000 to
# 48,000 floors there; 1,000 asserted below).
FP32_FLOORS = 8.0
TEETH_FLOORS = 1000.0


def documents(seed: int, lengths: tuple[int, ...] = LENGTHS) -> list[torch.Tensor]:
    """Random documents of the given lengths (no special token inside), each followed by EOD."""
    gen = torch.Generator().manual_seed(seed)
    return [torch.cat([torch.randint(4, CONFIG.vocab_size, (n,), generator=gen), torch.tensor([EOD])]) for n in lengths]


def spans(docs: list[torch.Tensor]) -> list[slice]:
    starts = np.cumsum([0, *(len(d) for d in docs)])
    return [slice(int(a), int(b)) for a, b in itertools.pairwise(starts)]


def model_in(dtype: torch.dtype) -> BloomForCausalLM:
    return BloomForCausalLM(CONFIG, seed=0).to(dtype).eval()


def float64_layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float) -> torch.Tensor:
    """ops.layer_norm in x's dtype (the kernel keeps float32 statistics and float32 weight-gradient sums)."""
    return torch.nn.functional.layer_norm(x, x.shape[-1:], weight, bias, eps)


@contextmanager
def float64_throughout(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The model's float32 island left in a float64 run (the LayerNorm statistics) in float64 too."""
    with monkeypatch.context() as patch:
        patch.setattr(ops, "layer_norm", float64_layer_norm)
        yield


def log_probs(model: BloomForCausalLM, ids: torch.Tensor, doc_ids: torch.Tensor | None = None) -> torch.Tensor:
    with torch.no_grad():
        return torch.log_softmax(model(ids[None], doc_ids=doc_ids).double(), dim=-1)[0]


def packed_and_alone(
    model: BloomForCausalLM, docs: list[torch.Tensor], *, with_doc_ids: bool
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per document: (its log-probs [n, vocab] inside the pack, its log-probs run alone)."""
    packed = torch.cat(docs)
    doc_ids = document_ids(packed[None], EOD) if with_doc_ids else None
    inside = log_probs(model, packed, doc_ids)
    return [(inside[span], log_probs(model, doc)) for span, doc in zip(spans(docs), docs, strict=False)]


def largest(pairs: list[tuple[torch.Tensor, torch.Tensor]], skip_first: bool = False) -> float:
    return max(float((a - b).abs().max()) for a, b in pairs[int(skip_first) :])


def test_document_ids_close_each_document_with_its_eod() -> None:
    ids = torch.tensor([[7, 8, EOD, 9, 10, 11, EOD, 12], [EOD, EOD, 5, 6, 7, 8, 9, EOD]])
    want = [[0, 0, 0, 1, 1, 1, 1, 2], [0, 1, 2, 2, 2, 2, 2, 2]]
    assert document_ids(ids, EOD).tolist() == want
    assert document_lengths(ids[0].numpy(), EOD) == [3, 4, 1]
    assert document_lengths(ids[1].numpy(), EOD) == [1, 1, 6]
    assert document_lengths(np.array([5, 6, 7]), EOD) == [3]  # a sample inside one long document


def test_each_packed_document_equals_the_document_alone_fp64(monkeypatch: pytest.MonkeyPatch) -> None:
    model, docs = model_in(torch.float64), documents(0)
    with float64_throughout(monkeypatch):
        separated = packed_and_alone(model, docs, with_doc_ids=True)
        crossing = packed_and_alone(model, docs, with_doc_ids=False)
    assert largest(separated) < FP64_BOUND
    # Teeth: without document ids, every document after the first sees the ones before it.
    assert largest(crossing, skip_first=True) > 1e-3
    assert largest(crossing[:1]) < FP64_BOUND  # ... and the first one sees nothing else either way


def test_each_packed_document_equals_the_document_alone_fp32() -> None:
    docs = documents(1)
    fp32, fp64 = model_in(torch.float32), model_in(torch.float64)
    # The floor: how far fp32 is from fp64 for the documents run alone (the model as it runs, float32 softmax both).
    floor = max(float((log_probs(fp32, d) - log_probs(fp64, d)).abs().max()) for d in docs)
    assert 1e-9 < floor < 1e-3, f"implausible fp32 floor {floor:.3e}"
    separated = largest(packed_and_alone(fp32, docs, with_doc_ids=True))
    crossing = largest(packed_and_alone(fp32, docs, with_doc_ids=False), skip_first=True)
    assert separated < FP32_FLOORS * floor, f"packed vs alone {separated:.3e} = {separated / floor:.1f} floors"
    assert crossing > TEETH_FLOORS * floor, f"without doc ids only {crossing / floor:.1f} floors apart"


def _loss_gradient(
    model: BloomForCausalLM, ids: torch.Tensor, labels: torch.Tensor, doc_ids: torch.Tensor | None
) -> dict[str, torch.Tensor]:
    """Gradients of the mean next-token loss, taken in float64 from the logits (model.loss computes its chunked
    cross-entropy in float32, which would set the floor; the loss itself is checked against this one below)."""
    model.zero_grad(set_to_none=True)
    logits = model(ids[None], doc_ids=doc_ids)[0]
    loss = torch.nn.functional.cross_entropy(logits[:-1], labels[1:], ignore_index=-100)
    chunked = model.loss(ids[None], labels[None], doc_ids=doc_ids)
    assert abs(float(chunked.detach()) - float(loss.detach())) < 1e-5 * float(loss.detach())  # float32, same figure
    loss.backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_loss_gradient_of_each_packed_document_equals_the_document_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    """The gradient w.r.t. every weight of the loss over one document's tokens, packed and alone (fp64). Inside
    the pack the labels outside the document are ignored; the EOD's target (the next document's first token) is
    ignored in both, as a document alone has no next token."""
    model, docs = model_in(torch.float64), documents(2)
    packed = torch.cat(docs)
    doc_ids = document_ids(packed[None], EOD)
    worst, worst_without = 0.0, 0.0
    with float64_throughout(monkeypatch):
        for index, (span, doc) in enumerate(zip(spans(docs), docs, strict=False)):
            labels = torch.full_like(packed, -100)
            # loss() shifts: position t predicts labels[t + 1], so the document's own targets are [start+1, end).
            labels[span.start + 1 : span.stop] = packed[span.start + 1 : span.stop]
            alone = _loss_gradient(model, doc, doc.clone(), None)
            inside = _loss_gradient(model, packed, labels, doc_ids)
            assert alone.keys() == inside.keys()
            for name in alone:
                scale = float(alone[name].abs().max()) or 1.0
                worst = max(worst, float((inside[name] - alone[name]).abs().max()) / scale)
            if index > 0:
                crossing = _loss_gradient(model, packed, labels, None)
                worst_without = max(
                    worst_without,
                    max(float((crossing[n] - alone[n]).abs().max()) / float(alone[n].abs().max()) for n in alone),
                )
    assert worst < FP64_BOUND
    assert worst_without > 1e-3


def test_a_document_does_not_see_its_neighbours(monkeypatch: pytest.MonkeyPatch) -> None:
    """The third document's logits stay put when the documents around it change, in content and in length (so it
    also starts at another position); without document ids they move."""
    model = model_in(torch.float64)
    middle = documents(3, (7,))[0]
    packs = [
        [*documents(4, (5, 2)), middle, *documents(5, (9,))],
        [*documents(6, (12, 6)), middle, *documents(7, (1,))],
    ]

    def middle_logits(pack: list[torch.Tensor], with_doc_ids: bool) -> torch.Tensor:
        packed = torch.cat(pack)
        with torch.no_grad():
            logits = model(packed[None], doc_ids=document_ids(packed[None], EOD) if with_doc_ids else None)
        return logits[0, spans(pack)[2]]

    with float64_throughout(monkeypatch):
        a, b = (middle_logits(p, True) for p in packs)
        c, d = (middle_logits(p, False) for p in packs)
    assert float((a - b).abs().max()) < FP64_BOUND
    assert float((c - d).abs().max()) > 1e-3


def test_padding_and_document_ids_together(monkeypatch: pytest.MonkeyPatch) -> None:
    """A left-padded pack: the real tokens' log-probs are those of the unpadded pack (padding keys masked, ALiBi
    positions counted over real tokens), so each document still equals itself alone."""
    model, docs = model_in(torch.float64), documents(8)
    packed = torch.cat(docs)
    pad = 6
    padded = torch.cat([torch.full((pad,), 3), packed])  # 3: <pad>
    attention_mask = torch.cat([torch.zeros(pad, dtype=torch.int64), torch.ones(len(packed), dtype=torch.int64)])
    with float64_throughout(monkeypatch), torch.no_grad():
        plain = model(packed[None], doc_ids=document_ids(packed[None], EOD))[0]
        both = model(padded[None], attention_mask[None], doc_ids=document_ids(padded[None], EOD))[0, pad:]
        alone = [model(d[None])[0] for d in docs]
    assert float((both - plain).abs().max()) < FP64_BOUND
    assert max(float((both[s] - a).abs().max()) for s, a in zip(spans(docs), alone, strict=False)) < FP64_BOUND


def test_doc_ids_must_match_the_input() -> None:
    model = model_in(torch.float32)
    ids = torch.cat(documents(9))[None]
    with pytest.raises(ValueError, match=r"doc_ids shape \(1, 5\) != input_ids shape"):
        model(ids, doc_ids=torch.zeros(1, 5, dtype=torch.int64))


def test_the_flash_path_masks_other_documents_too(monkeypatch: pytest.MonkeyPatch) -> None:
    """The fused path (taken without padding where the kernel runs) gets the document ids: forced on here, it runs
    the kernel's torch twin (its float64 math where document ids are given), and each packed document equals the
    document alone on the materialized path."""
    model, docs = model_in(torch.float64), documents(10)
    packed = torch.cat(docs)
    with float64_throughout(monkeypatch):
        alone = [log_probs(model, doc) for doc in docs]
        monkeypatch.setattr(ops, "flash_attention_available", lambda q: True)
        fused = log_probs(model, packed, document_ids(packed[None], EOD))
        crossing = log_probs(model, packed)
    assert largest([(fused[span], a) for span, a in zip(spans(docs), alone, strict=True)]) < FP64_BOUND
    assert largest([(crossing[span], a) for span, a in zip(spans(docs), alone, strict=True)], skip_first=True) > 1e-3


def test_the_setting_is_off_by_default_settable_and_optional_in_older_plans(tmp_path: Path) -> None:
    """train.reset_attention_mask: false unless `--set reset_attention_mask=true`; written into plan.json; a plan
    written before the key existed reads as false (attention across documents, as BLOOM-176B trained)."""
    spec = make_run_plan(RunRequest(corpus=[SAMPLE_CORPUS_DIR], hardware="cpu-laptop-2core"))
    assert spec.train.reset_attention_mask is False
    on = apply_request(spec, RunRequest(corpus=[], overrides=parse_overrides(["reset_attention_mask=true"])))
    assert on.train.reset_attention_mask is True
    written = json.loads(on.dumps())
    assert written["train"]["reset_attention_mask"] is True
    del written["train"]["reset_attention_mask"]
    (tmp_path / "plan.json").write_text(json.dumps(written))
    assert load_spec(tmp_path / "plan.json").train.reset_attention_mask is False
    assert parse_overrides(["reset_attention_mask=off"]) == {"reset_attention_mask": False}
    with pytest.raises(BadInput, match=r"--set reset_attention_mask=maybe: expected bool"):
        parse_overrides(["reset_attention_mask=maybe"])


def test_the_eod_id_comes_from_the_datasets(tmp_path: Path) -> None:
    def write(eods: dict[str, int | None]) -> Path:
        entries = {lang: {"prefix": f"{lang}_text_document", "documents": 1, "tokens": 2, "eod_id": e}
                   for lang, e in eods.items()}  # fmt: skip
        (tmp_path / "datasets.json").write_text(json.dumps(entries))
        return tmp_path

    assert dataset_eod_id(write({"en": 2, "fr": 2})) == 2
    with pytest.raises(BadInput, match=r"datasets.json: reset_attention_mask needs one EOD token id .*'fr': None"):
        dataset_eod_id(write({"en": 2, "fr": None}))
    with pytest.raises(BadInput, match=r"found \{'en': 2, 'fr': 5\}"):
        dataset_eod_id(write({"en": 2, "fr": 5}))
