"""The figures of one validation pass: mean next-token loss and bits per byte, per source and over all of them.

A loss in nats per token depends on the tokenizer: a vocabulary of 8,400 entries cuts a text into more, easier
tokens than BLOOM's 250,680, so two runs' losses say nothing about which model predicts the text better. Bits per
byte divides the same summed loss by the text's size instead of its token count:

    bits per byte = (sum over predicted tokens of -ln p) / ln 2 / (UTF-8 bytes those tokens stand for)

The numerator is the validation loss's own sum, every predicted token included. The bytes of a token come from
the tokenizer (appliance/tokenizer/token_bytes.py); the </s> that ends each document stands for none, so its
loss (predicting where a document ends) is counted against the bytes of the text around it, as a byte-level model
would have to spend bits on a terminator. A token never straddles two documents (each document is encoded on its
own, then </s> appended), and a sample that starts inside a document counts only its predicted tokens: the first
token of a sample is an input, never a label, so its bytes are not in the denominator either.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from appliance.parallel.loss import IGNORE_INDEX

OVERALL = "all"  # the key of the figure over every source


@dataclass(frozen=True)
class SourceSums:
    """One validation set's sums, over the samples of every DP rank once reduced."""

    loss_nats: float  # -ln p summed over the predicted tokens
    tokens: float
    text_bytes: float  # UTF-8 bytes of the predicted tokens; 0 without a byte table

    FIELDS = 3  # the floats one source adds to the evaluation's single all-reduce

    def as_list(self) -> list[float]:
        return [self.loss_nats, self.tokens, self.text_bytes]


def bits_per_byte(loss_nats: float, text_bytes: float) -> float | None:
    """None where the tokens stand for no bytes (no byte table, or special tokens only)."""
    return loss_nats / math.log(2) / text_bytes if text_bytes > 0 else None


@dataclass(frozen=True)
class Validation:
    """Mean next-token loss (nats) and bits per byte per source, and over all sources under OVERALL. A source
    whose bits per byte is unknown (bits_per_byte's None) has no entry in bits_per_byte."""

    loss: dict[str, float]
    bits_per_byte: dict[str, float]

    @classmethod
    def of(cls, sums: Mapping[str, SourceSums]) -> Validation:
        everything = SourceSums(
            loss_nats=sum(s.loss_nats for s in sums.values()),
            tokens=sum(s.tokens for s in sums.values()),
            text_bytes=sum(s.text_bytes for s in sums.values()),
        )
        loss: dict[str, float] = {}
        bpb: dict[str, float] = {}
        for name, s in {**sums, OVERALL: everything}.items():
            loss[name] = s.loss_nats / max(s.tokens, 1.0)
            figure = bits_per_byte(s.loss_nats, s.text_bytes)
            if figure is not None:
                bpb[name] = figure
        return cls(loss=loss, bits_per_byte=bpb)

    @classmethod
    def from_reduced(cls, names: list[str], reduced: list[float]) -> Validation:
        """The inverse of concatenating each name's SourceSums.as_list(), in order."""
        n = SourceSums.FIELDS
        return cls.of({name: SourceSums(*reduced[n * i : n * (i + 1)]) for i, name in enumerate(names)})

    @property
    def overall_loss(self) -> float:
        return self.loss[OVERALL]

    @property
    def overall_bits_per_byte(self) -> float | None:
        return self.bits_per_byte.get(OVERALL)

    def per_source_loss(self) -> dict[str, float]:
        return {k: v for k, v in self.loss.items() if k != OVERALL}

    def per_source_bits_per_byte(self) -> dict[str, float]:
        return {k: v for k, v in self.bits_per_byte.items() if k != OVERALL}


def label_bytes(labels: torch.Tensor, byte_lengths: torch.Tensor) -> int:
    """UTF-8 bytes of the labels' tokens, IGNORE_INDEX left out. An id beyond the table means data made with
    another tokenizer than the run's."""
    ids = labels[labels != IGNORE_INDEX]
    if ids.numel() == 0:
        return 0
    outside = ids[(ids < 0) | (ids >= byte_lengths.numel())]
    if outside.numel():
        raise ValueError(
            f"token id {int(outside[0])} in the validation data is outside the tokenizer's {byte_lengths.numel()} "
            "ids: the data was tokenized with another tokenizer than the run's tokenizer/tokenizer.json"
        )
    return int(byte_lengths[ids].sum())
