"""BLOOM's tokenizer recipe: pipeline, special ids, padding, exact round trip, transformers loading, fertility."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
from tokenizers import Tokenizer

from appliance.errors import BadInput
from appliance.tokenizer.bpe import language_sample, train_tokenizer
from appliance.tokenizer.vocab import (
    BLOOM_SPLIT_REGEX,
    SPECIAL_TOKENS,
    default_placeholder_count,
    padded_vocab_size,
)

SENTENCES = {
    "en": [
        "The quick brown fox jumps over the lazy dog.",
        "Training large language models needs careful data preparation.",
        "She sells sea shells by the sea shore, doesn't she?",
        "Open science lets everyone inspect how a model was built!",
    ],
    "fr": [
        "Le renard brun rapide saute par-dessus le chien paresseux.",
        "L'entraînement des grands modèles de langue exige des données propres.",
        "Où est la bibliothèque ? Elle est à côté de l'école.",
        "La science ouverte permet à chacun de comprendre le modèle.",
    ],
    "zh": [
        "敏捷的棕色狐狸跳过了懒狗。",
        "训练大型语言模型需要仔细准备数据。",
        "开放科学让每个人都能检查模型是如何构建的。",
        "今天天气很好，我们去公园散步吧！",
    ],
    "ar": [
        "الثعلب البني السريع يقفز فوق الكلب الكسول.",
        "يتطلب تدريب النماذج اللغوية الكبيرة إعداد البيانات بعناية.",
        "العلم المفتوح يسمح للجميع بفحص كيفية بناء النموذج،",
        "أين المكتبة؟ إنها بجانب المدرسة.",
    ],
    "hi": [
        "तेज़ भूरी लोमड़ी आलसी कुत्ते के ऊपर कूदती है।",
        "बड़े भाषा मॉडल को प्रशिक्षित करने के लिए डेटा की सावधानीपूर्वक तैयारी आवश्यक है।",
        "खुला विज्ञान सभी को यह देखने देता है कि मॉडल कैसे बनाया गया।",
        "आज मौसम बहुत अच्छा है, चलो पार्क चलते हैं!",
    ],
}
ROUND_TRIP = [
    "",
    " leading space",
    "   three leading spaces and trailing   ",
    "Hello, world! Ünïcödé façade — naïve café.",
    "中文，日本語のテキスト、한국어 텍스트。",
    "العربية: مرحبا بالعالم، كيف حالك؟",
    "हिन्दी में पाठ। বাংলা লেখা। தமிழ் உரை.",
    "emoji 😀👩‍👩‍👧‍👦🇫🇷 and ZWJ\u200d, BOM\ufeff, RTL\u202e mark",
    "control \x00\x01\x07\x1b[31m red \x7f and \r\n CRLF \t tabs\x0b\x0c",
    "literal special strings <s> </s> <pad> <unk> <placeholder_0> stay text",
    "math ∑∫√∞ ≠ ≤ and combining e\u0301 a\u0308 and astral 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 \U0010fffd",
    "(x|y) [a.b,c!d?e] …。，、।۔، punctuation the split regex isolates",
]


def write_corpus(root: Path, docs_per_lang: dict[str, int], seed: int = 0) -> Path:
    """Shards in prep's format: documents of 2-6 sentences of one language, shuffled over 2 shards."""
    rng = random.Random(seed)
    docs = []
    for lang, n in docs_per_lang.items():
        for _ in range(n):
            text = " ".join(rng.choice(SENTENCES[lang]) for _ in range(rng.randint(2, 6)))
            docs.append({"text": text, "lang": lang, "source": "test"})
    rng.shuffle(docs)
    root.mkdir(parents=True, exist_ok=True)
    for shard in range(2):
        lines = [json.dumps(d, ensure_ascii=False) for d in docs[shard::2]]
        (root / f"shard-{shard:05d}.jsonl").write_text("\n".join(lines) + "\n", encoding="utf-8")
    return root


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("tok")
    corpus = write_corpus(root / "corpus", {lang: 60 for lang in SENTENCES})
    progress: list[float] = []
    path = train_tokenizer(
        corpus,
        root / "out",
        vocab_size=1000,
        vocab_reasons=["vocabulary: 1,000 entries, as this test asks"],
        tp_size=2,
        on_progress=lambda f, _msg: progress.append(f),
    )
    assert progress[0] == 0.0 and progress[-1] == 1.0 and progress == sorted(progress)
    return path


def test_vocab_padding_follows_megatron() -> None:
    assert padded_vocab_size(250_680, 4) == 250_880  # BLOOM-176B: 128 x TP 4 = 512
    assert padded_vocab_size(8000, 1) == 8064
    assert padded_vocab_size(8192, 1) == 8192
    assert default_placeholder_count(250_680) == 200
    assert default_placeholder_count(8192) == 8


def test_pipeline_is_blooms(trained: Path) -> None:
    spec = json.loads(trained.read_text(encoding="utf-8"))
    assert spec["normalizer"] is None
    split, byte_level = spec["pre_tokenizer"]["pretokenizers"]
    assert split["type"] == "Split" and split["pattern"] == {"Regex": BLOOM_SPLIT_REGEX}
    assert split["behavior"] == "Isolated" and split["invert"] is False
    assert byte_level["type"] == "ByteLevel"
    assert byte_level["add_prefix_space"] is False and byte_level["use_regex"] is False
    assert spec["decoder"]["type"] == "ByteLevel"
    assert spec["model"]["type"] == "BPE"
    # The full byte-level alphabet: every byte of every UTF-8 string has a symbol.
    from tokenizers.pre_tokenizers import ByteLevel

    assert set(ByteLevel.alphabet()) <= set(spec["model"]["vocab"])


def test_loads_in_transformers_with_blooms_special_ids(trained: Path) -> None:
    from transformers import PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast(tokenizer_file=str(trained))
    assert tok.convert_ids_to_tokens([0, 1, 2, 3]) == list(SPECIAL_TOKENS)
    assert len(tok) == 1024 and len(tok) % (128 * 2) == 0  # vocab_size 1000 padded for TP 2
    placeholders = [f"<placeholder_{i}>" for i in range(8)]
    assert tok.convert_tokens_to_ids(placeholders) == list(range(4, 12))
    # The padding rows are placeholders too, so every id decodes.
    assert tok.convert_ids_to_tokens(len(tok) - 1).startswith("<placeholder_")
    added = {t.content for t in Tokenizer.from_file(str(trained)).get_added_tokens_decoder().values()}
    assert len(added) == len(SPECIAL_TOKENS) + 8 + (1024 - 1000)
    # tokenizer_config.json lets AutoTokenizer pick up the special tokens.
    from transformers import AutoTokenizer

    auto = AutoTokenizer.from_pretrained(str(trained.parent))
    assert (auto.unk_token_id, auto.bos_token_id, auto.eos_token_id, auto.pad_token_id) == (0, 1, 2, 3)


def test_round_trips_multilingual_text(trained: Path) -> None:
    from transformers import PreTrainedTokenizerFast

    raw = Tokenizer.from_file(str(trained))
    hf = PreTrainedTokenizerFast(tokenizer_file=str(trained))
    for text in ROUND_TRIP + [s for sents in SENTENCES.values() for s in sents]:
        ids = raw.encode(text, add_special_tokens=False).ids
        assert raw.decode(ids, skip_special_tokens=False) == text
        assert hf.decode(hf.encode(text, add_special_tokens=False)) == text
    plain = "".join(t for t in ROUND_TRIP if "<unk>" not in t)
    assert 0 not in raw.encode(plain).ids  # byte-level: <unk> never comes out


def test_round_trips_random_unicode(trained: Path) -> None:
    raw = Tokenizer.from_file(str(trained))
    rng = random.Random(1234)
    ranges = [(0x00, 0x7F), (0x80, 0x7FF), (0x800, 0xD7FF), (0xE000, 0xFFFF), (0x10000, 0x10FFFF)]
    texts = []
    for _ in range(300):
        chars = []
        for _ in range(rng.randint(1, 40)):
            lo, hi = rng.choice(ranges)
            chars.append(chr(rng.randint(lo, hi)))
        texts.append("".join(chars))
    for text, enc in zip(texts, raw.encode_batch(texts, add_special_tokens=False), strict=True):
        assert raw.decode(enc.ids, skip_special_tokens=False) == text


def test_fertility_report(trained: Path) -> None:
    report = json.loads((trained.parent / "fertility.json").read_text(encoding="utf-8"))
    assert set(report["languages"]) == set(SENTENCES)
    assert report["threshold_points"] == 10.0
    for lang, entry in report["languages"].items():
        assert entry["words"] > 0 and entry["tokens"] > 0, lang
        expected = 100 * (entry["tokens"] / entry["monolingual_tokens"] - 1)
        assert entry["points_worse"] == pytest.approx(expected, abs=0.01)
        assert entry["flagged"] == (entry["points_worse"] > 10.0)
    assert report["flagged"] == [lang for lang, e in report["languages"].items() if e["flagged"]]
    assert report["ok"] == (not report["flagged"])
    assert report["tokenizer"]["vocab_size_padded"] == 1024
    assert report["tokenizer"]["vocab_size_reasons"] == ["vocabulary: 1,000 entries, as this test asks"]
    # The references get an equal share of the learned entries: (1000 - 4 - 8 - 256) / 5 languages = 146.
    reference = report["reference"]
    assert reference["rule"] == "equal share of the learned vocabulary" and reference["languages"] == 5
    assert reference["vocab_size"] == 4 + 256 + 146
    assert reference["arithmetic"].endswith("= 146 learned entries each; + 4 special + 256 byte = 406")
    assert "250,220 learned) / 59 languages = 4,241 learned entries each" in reference["bloom_setting"]


# Five made-up languages, each in its own script, with a Zipfian vocabulary of 300 words: their fertility is
# set by how many vocabulary entries each language gets, nothing else.
SCRIPTS = {
    "ru": "абвгдежзийклмнопрстуфхцчшщыэюя",
    "el": "αβγδεζηθικλμνξοπρστυφχψω",
    "hy": "աբգդեզէըթժիլխծկհձղճմյնշոչպջռսվտրցւփքօֆ",
    "ka": "აბგდევზთიკლმნოპჟრსტუფქღყშჩცძწჭხჯჰ",
    "he": "אבגדהוזחטיכלמנסעפצקרשת",
}


def _pseudo_language(letters: str, docs: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    words = ["".join(rng.choice(letters) for _ in range(rng.randint(3, 9))) for _ in range(300)]
    zipf = [1 / rank for rank in range(1, len(words) + 1)]
    return [" ".join(rng.choices(words, zipf, k=80)) + "." for _ in range(docs)]


def test_fertility_flags_an_under_served_language_only(tmp_path: Path) -> None:
    # Hebrew is planted with a tenth of the others' text: the shared vocabulary learns little of it, while its
    # reference learns its full equal share from that same text (here 64 points worse). The
    # other four, with equal text, come out within a few points of their references: served fairly.
    docs = {
        lang: _pseudo_language(letters, 6 if lang == "he" else 60, seed=i)
        for i, (lang, letters) in enumerate(SCRIPTS.items())
    }
    root = tmp_path / "corpus"
    root.mkdir()
    lines = [
        json.dumps({"text": t, "lang": lang, "source": "test"}, ensure_ascii=False) for lang in docs for t in docs[lang]
    ]
    (root / "shard-00000.jsonl").write_text("\n".join(lines) + "\n", encoding="utf-8")
    train_tokenizer(root, tmp_path / "out", vocab_size=1400)
    report = json.loads((tmp_path / "out" / "fertility.json").read_text(encoding="utf-8"))
    languages = report["languages"]
    assert report["flagged"] == ["he"] and report["ok"] is False
    assert languages["he"]["points_worse"] > 10.0
    assert all(languages[lang]["points_worse"] <= 10.0 for lang in SCRIPTS if lang != "he")


def test_training_is_deterministic(tmp_path: Path) -> None:
    corpus = write_corpus(tmp_path / "corpus", {"en": 30, "zh": 30})
    a = train_tokenizer(corpus, tmp_path / "a", vocab_size=600, seed=3)
    b = train_tokenizer(corpus, tmp_path / "b", vocab_size=600, seed=3)
    assert a.read_bytes() == b.read_bytes()
    assert (tmp_path / "a" / "fertility.json").read_bytes() == (tmp_path / "b" / "fertility.json").read_bytes()


def test_sample_is_language_balanced_and_seeded(tmp_path: Path) -> None:
    corpus = write_corpus(tmp_path / "corpus", {"en": 400, "fr": 40, "hi": 40})
    sample = language_sample(corpus, None, seed=0)
    # Default cap: the median language's bytes. English (10x larger) comes down to about that size.
    assert sample["en"].corpus_bytes > 5 * sample["fr"].corpus_bytes
    assert sample["en"].train_bytes < 2 * max(sample["fr"].corpus_bytes, sample["hi"].corpus_bytes)
    assert sample["fr"].train_bytes + sample["fr"].held_out_bytes == sample["fr"].corpus_bytes
    capped = language_sample(corpus, 2000, seed=0)
    assert all(s.train_bytes < 2000 + 1000 for s in capped.values())  # a document may cross the cap
    again = language_sample(corpus, 2000, seed=0)
    assert [s.train for s in capped.values()] == [s.train for s in again.values()]
    other = language_sample(corpus, 2000, seed=1)
    assert [s.train for s in capped.values()] != [s.train for s in other.values()]


def test_bad_input_names_the_problem(tmp_path: Path) -> None:
    corpus = write_corpus(tmp_path / "corpus", {"en": 5})
    with pytest.raises(BadInput, match="--vocab-size 200"):
        train_tokenizer(corpus, tmp_path / "out", vocab_size=200)
    with pytest.raises(BadInput, match="nowhere"):
        train_tokenizer(tmp_path / "nowhere", tmp_path / "out", vocab_size=1000)
    with open(corpus / "shard-00001.jsonl", "a", encoding="utf-8") as f:
        f.write("{not json\n")
    with pytest.raises(BadInput, match=r"shard-00001\.jsonl:\d+"):
        train_tokenizer(corpus, tmp_path / "out", vocab_size=1000)
