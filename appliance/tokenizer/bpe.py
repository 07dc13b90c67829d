"""BLOOM's tokenizer recipe with Hugging Face `tokenizers`: byte-level BPE on a language-balanced sample.

The pipeline is BLOOM's tokenizer.json: no normalizer (text is never changed, so decoding restores it exactly);
pre-tokenizer Sequence[Split(BLOOM's regex, isolated), ByteLevel(add_prefix_space=False, use_regex=False)];
BPE over the 256 byte symbols (every UTF-8 string is encodable, no <unk> ever comes out); ByteLevel decoder.
Ids 0-3 are <unk> <s> </s> <pad>, then the placeholders, then the learned merges, then padding placeholders up
to a multiple of 128 x TP (vocab.py explains why the tokenizer, not only the model, is padded).
"""

from __future__ import annotations

import json
import os
import random
import statistics
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from appliance.data.tokenize_corpus import iter_corpus, list_shards
from appliance.errors import BadInput
from appliance.output_dirs import OutputDir, claim_dir, matching, read_json_object
from appliance.tokenizer.fertility import fertility_report, reference_rule
from appliance.tokenizer.vocab import (
    BLOOM_SPLIT_REGEX,
    SPECIAL_TOKENS,
    default_placeholder_count,
    pad_with_placeholders,
    placeholder,
)

ProgressFn = Callable[[float, str], None]
# One document in 10 (a seeded draw) is held out to measure fertility, up to 256 KiB per language:
# enough words for a stable tokens-per-word figure, small enough to encode in a blink.
HELD_OUT_SHARE = 0.1
HELD_OUT_CAP_BYTES = 256 * 1024
# Ceiling of the default per-language cap, so a large corpus's sample stays in memory (BPE training holds its
# word counts anyway): 64 MiB x 46 languages (ROOTS) is ~3 GB of text. Pass sample_bytes_per_lang to go beyond.
DEFAULT_CAP_CEILING_BYTES = 64 * 1024 * 1024
BYTE_ALPHABET = 256
FERTILITY_JSON = "fertility.json"
# The stage's progress, part by part. The shares follow the sample corpus's times on a 2-core VM (12 languages,
# 9,728 entries, 13 s in all): the two passes that draw the sample 0.2 s, the trainer reading the sample 1.1-1.8 s,
# learning the merges 5-8 s, the 12 reference tokenizers 4.5 s, the fertility check 1.4 s. A large corpus spends
# longer in the passes (the sample is capped, the corpus is not): its first share then moves slower than the rest.
SAMPLING_SPAN = (0.0, 0.05)
READING_SPAN = (0.05, 0.15)  # the trainer reading the sample; learning the merges takes it to REFERENCES_SPAN[0]
REFERENCES_SPAN = (0.55, 0.9)  # the monolingual reference tokenizers; then the fertility check, then done
REPORT_EVERY_BYTES = 1 << 20  # progress while reading text: once per MiB, not per document
# While the trainer learns its merges, the tokenizers library says nothing (its own progress bar writes to the
# terminal); a beat this often says the stage is alive and for how long it has been merging.
MERGE_BEAT_S = 0.5
OUTPUT_NAMES = ("tokenizer.json", "tokenizer_config.json", FERTILITY_JSON)  # everything a tokenizer writes into --out


def bloom_tokenizer() -> Tokenizer:
    """An untrained tokenizer with BLOOM's pipeline."""
    tokenizer = Tokenizer(models.BPE(unk_token=None, fuse_unk=False, byte_fallback=False))
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(BLOOM_SPLIT_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer


def train_bpe(
    texts: Iterable[str], vocab_size: int, placeholders: int, *, merging: Callable[[float], None] | None = None
) -> Tokenizer:
    """Train BLOOM's pipeline to vocab_size entries, counting the 4 special tokens and the placeholders.

    merging(seconds) is called every MERGE_BEAT_S once the trainer has read all of `texts` and learns its merges,
    from a thread of its own (the library releases the GIL there); never while `texts` is still being read."""
    tokenizer = bloom_tokenizer()
    specials = [AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS]
    specials += [AddedToken(placeholder(i), special=True, normalized=False) for i in range(placeholders)]
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    beat = _Beat(merging)
    try:
        tokenizer.train_from_iterator(beat.after(texts), trainer=trainer)
    finally:
        beat.stop()
    return tokenizer


class _Beat:
    """Calls `beat(seconds since it began)` every MERGE_BEAT_S from a thread, from the end of an iterable on."""

    def __init__(self, beat: Callable[[float], None] | None) -> None:
        self.beat = beat
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def after(self, items: Iterable[str]) -> Iterator[str]:
        yield from items
        if self.beat is not None:
            self._thread = threading.Thread(target=self._run, args=(self.beat, time.monotonic()), daemon=True)
            self._thread.start()

    def _run(self, beat: Callable[[float], None], began: float) -> None:
        while not self._stop.wait(MERGE_BEAT_S):
            beat(time.monotonic() - began)

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()


def _reporting_bytes(texts: Iterable[str], report: Callable[[int], None]) -> Iterator[str]:
    """`texts` as they are, calling report(UTF-8 bytes so far) once per REPORT_EVERY_BYTES and at the end."""
    done = reported = 0
    for text in texts:
        done += len(text.encode("utf-8"))
        if done - reported >= REPORT_EVERY_BYTES:
            reported = done
            report(done)
        yield text
    report(done)


def _in_span(span: tuple[float, float], part: float) -> float:
    """The stage's fraction `part` (0 to 1) of the way through `span`."""
    return span[0] + (span[1] - span[0]) * min(max(part, 0.0), 1.0)


@dataclass
class LanguageSample:
    """One language's share of the tokenizer corpus."""

    corpus_bytes: int = 0
    train: list[str] = field(default_factory=list)
    held_out: list[str] = field(default_factory=list)
    train_bytes: int = 0
    held_out_bytes: int = 0


def language_sample(
    corpus_dir: Path, cap_bytes_per_lang: int | None, seed: int, on_progress: ProgressFn | None = None
) -> dict[str, LanguageSample]:
    """A language-balanced, deterministic sample: at most ~cap UTF-8 bytes of training text per language.

    Two streaming passes: the first counts each language's bytes, the second keeps each document with
    probability cap / language bytes (a seeded draw per document, in corpus order), so large languages are
    thinned evenly across all shards instead of cut after their first shard. cap=None caps every language at
    the median language's size (at most 64 MiB): small languages keep everything, large ones come down to the
    middle. on_progress(fraction of the two passes, message) hears of every MiB of shard lines read.
    """
    shard_bytes = sum(shard.stat().st_size for shard in list_shards(corpus_dir)) or 1
    done = [0, 0]  # shard bytes read, and as of the last report

    def read(pass_no: int, size: int, what: str) -> None:
        done[0] += size
        if on_progress is not None and done[0] - done[1] >= REPORT_EVERY_BYTES:
            done[1] = done[0]
            of_pass = min(done[0] - (pass_no - 1) * shard_bytes, shard_bytes)
            fraction = (pass_no - 1 + of_pass / shard_bytes) / 2
            on_progress(fraction, f"{what}: {of_pass / 1e6:.1f} of {shard_bytes / 1e6:.1f} MB")

    samples: dict[str, LanguageSample] = {}
    for lang, text, size in iter_corpus(corpus_dir):
        samples.setdefault(lang, LanguageSample()).corpus_bytes += len(text.encode("utf-8"))
        read(1, size, "counting each language's bytes")
    if not samples:
        raise BadInput(f"{corpus_dir}: the corpus holds no documents to train a tokenizer on")
    cap = cap_bytes_per_lang
    if cap is None:
        median = statistics.median_high(s.corpus_bytes for s in samples.values())
        cap = min(int(median), DEFAULT_CAP_CEILING_BYTES)
    if cap <= 0:
        raise BadInput(f"sample_bytes_per_lang must be positive, got {cap}")
    keep = {lang: min(1.0, cap / max(1, s.corpus_bytes)) for lang, s in samples.items()}

    rng = random.Random(seed)
    for lang, text, size in iter_corpus(corpus_dir):
        read(2, size, "drawing the sample")
        sample, nbytes = samples[lang], len(text.encode("utf-8"))
        held_draw, keep_draw = rng.random(), rng.random()  # two draws per document, always, for determinism
        if held_draw < HELD_OUT_SHARE and sample.held_out_bytes < HELD_OUT_CAP_BYTES:
            sample.held_out.append(text)
            sample.held_out_bytes += nbytes
        elif keep_draw < keep[lang]:
            sample.train.append(text)
            sample.train_bytes += nbytes
    for sample in samples.values():
        if not sample.train:  # a language of a handful of documents: train on all of it
            sample.train, sample.held_out = sample.held_out, []
            sample.train_bytes, sample.held_out_bytes = sample.held_out_bytes, 0
    return dict(sorted(samples.items()))


def claim_output(corpus_dir: Path, out_dir: Path, *, force: bool = False) -> OutputDir:
    """--out: new, empty or an earlier tokenizer output, and not the corpus; BadInput otherwise. Writes nothing."""
    return claim_dir(
        out_dir, "tokenizer", inputs={"--corpus": [corpus_dir]}, force=force, legacy=_earlier_tokenizer,
        writes=OUTPUT_NAMES,
    )  # fmt: skip


def _earlier_tokenizer(out_dir: Path) -> list[str] | None:
    """A tokenizer written before the marker existed: its fertility.json reads as one."""
    report = read_json_object(out_dir / FERTILITY_JSON)
    return matching(out_dir, OUTPUT_NAMES) if report is not None and "tokenizer" in report else None


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


def _transformers_config() -> dict[str, object]:
    """tokenizer_config.json, so AutoTokenizer.from_pretrained(out_dir) knows BLOOM's special tokens too."""
    unk, bos, eos, pad = SPECIAL_TOKENS
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "unk_token": unk,
        "bos_token": bos,
        "eos_token": eos,
        "pad_token": pad,
        "clean_up_tokenization_spaces": False,  # would turn " ." into "." and break the exact round trip
    }


def train_tokenizer(
    corpus_dir: Path,
    out_dir: Path,
    *,
    vocab_size: int,
    vocab_reasons: list[str] | None = None,
    tp_size: int = 1,
    placeholder_tokens: int | None = None,
    sample_bytes_per_lang: int | None = None,
    seed: int = 0,
    on_progress: ProgressFn | None = None,
    force: bool = False,
) -> Path:
    """Train BLOOM's tokenizer on corpus_dir; write out_dir/tokenizer.json and fertility.json.

    vocab_size counts what is trained: the 4 special tokens, the placeholders and the learned entries (BLOOM:
    250,680). The saved tokenizer is then padded with placeholders to padded_vocab_size(vocab_size, tp_size),
    the embedding's row count (also when the corpus is too small to learn vocab_size entries, so the model
    shape follows from the arguments alone). vocab_reasons (the plan's, planner/vocabulary.py) say why vocab_size;
    fertility.json records them. placeholder_tokens=None takes BLOOM's share (200 of 250,680, at least 8).
    on_progress(fraction, message) reports each part as it goes (the spans above): the passes over the corpus and
    the trainer's reading by bytes, the merges by a beat every MERGE_BEAT_S, the references by language. Returns the
    tokenizer.json path. out_dir must be new, empty or an earlier tokenizer output (appliance/output_dirs.py;
    `force`: write beside files it did not write).
    """
    corpus_dir, out_dir = Path(corpus_dir), Path(out_dir)
    out = claim_output(corpus_dir, out_dir, force=force)
    placeholders = default_placeholder_count(vocab_size) if placeholder_tokens is None else placeholder_tokens
    if placeholders < 0:
        raise BadInput(f"placeholder_tokens must be at least 0, got {placeholders}")
    if tp_size < 1:
        raise BadInput(f"tp_size must be at least 1, got {tp_size}")
    floor = len(SPECIAL_TOKENS) + placeholders + BYTE_ALPHABET
    if vocab_size <= floor:
        raise BadInput(
            f"--vocab-size {vocab_size} is too small: {len(SPECIAL_TOKENS)} special + {placeholders} placeholder "
            f"+ {BYTE_ALPHABET} byte tokens leave no room for merges"
        )

    def progress(fraction: float, message: str) -> None:
        if on_progress is not None:
            on_progress(fraction, message)

    progress(0.0, "sampling the corpus per language")
    samples = language_sample(
        corpus_dir, sample_bytes_per_lang, seed, lambda part, what: progress(_in_span(SAMPLING_SPAN, part), what)
    )
    sample_bytes = sum(s.train_bytes for s in samples.values())
    learned = f"{vocab_size:,}-entry BPE"
    progress(READING_SPAN[0], f"training a {learned} on {len(samples)} languages ({sample_bytes / 1e6:.1f} MB)")

    def reading(done: int) -> None:
        progress(
            _in_span(READING_SPAN, done / max(sample_bytes, 1)),
            f"the {learned} reading its sample: {done / 1e6:.1f} of {sample_bytes / 1e6:.1f} MB",
        )

    tokenizer = train_bpe(
        _reporting_bytes((t for s in samples.values() for t in s.train), reading),
        vocab_size,
        placeholders,
        merging=lambda seconds: progress(READING_SPAN[1], f"the {learned} learning its merges ({seconds:.0f} s)"),
    )
    trained = tokenizer.get_vocab_size(with_added_tokens=True)
    padded = pad_with_placeholders(tokenizer, tp_size, at_least=vocab_size)

    # Fertility: the same recipe trained on one language alone, for every language, with that language's
    # equal share of the learned vocabulary (fertility.py says why and gives the arithmetic).
    reference = reference_rule(trained, placeholders, len(samples))
    monolingual: dict[str, Tokenizer] = {}
    for i, (lang, sample) in enumerate(samples.items()):
        progress(_in_span(REFERENCES_SPAN, i / len(samples)), f"training the {lang}-only reference tokenizer")
        monolingual[lang] = train_bpe(sample.train, reference["vocab_size"], 0)
    progress(REFERENCES_SPAN[1], f"checking the fertility of {len(samples)} languages")
    held_out = {lang: s.held_out or s.train for lang, s in samples.items()}
    in_sample = {lang for lang, s in samples.items() if not s.held_out}
    report = fertility_report(tokenizer, monolingual, held_out, in_sample=in_sample, reference=reference)
    report["tokenizer"] = {
        "vocab_size_requested": vocab_size,
        "vocab_size_reasons": list(vocab_reasons) if vocab_reasons else ["as requested (--vocab-size)"],
        "vocab_size_trained": trained,
        "vocab_size_padded": padded,
        "tp_size": tp_size,
        "placeholder_tokens": placeholders,
        "seed": seed,
        "sample_bytes_per_lang": {lang: s.train_bytes for lang, s in samples.items()},
        "corpus_bytes_per_lang": {lang: s.corpus_bytes for lang, s in samples.items()},
    }
    # tokenizer.json last: its presence means the stage finished.
    out.begin(OUTPUT_NAMES)
    _write_atomic(out_dir / FERTILITY_JSON, json.dumps(report, indent=2, ensure_ascii=False) + "\n")
    _write_atomic(out_dir / "tokenizer_config.json", json.dumps(_transformers_config(), indent=2) + "\n")
    tokenizer_json = out_dir / "tokenizer.json"
    _write_atomic(tokenizer_json, tokenizer.to_str(pretty=True))
    out.mark(OUTPUT_NAMES)
    progress(1.0, f"tokenizer: {padded} entries, fertility checked on {len(samples)} languages")
    return tokenizer_json
