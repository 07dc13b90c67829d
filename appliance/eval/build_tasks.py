"""Build the shipped tasks from the held-out documents of the embedded sample corpus, offline and reproducibly.

    python -m appliance.eval.build_tasks [--out appliance/eval/tasks] [--corpus-dir PREPARED_CORPUS]

Held out means exactly the documents the default run keeps for validation: the sample corpus goes through
`prep` as the default run sends it, and each language's documents are split by the same seeded draw as
training's (data/gpt_dataset.train_valid_split with the default fraction and BLOOM's seed); paragraphs that
training documents also contain are dropped. So the default run never trains on a task's text. A change to
`prep` changes the split: rebuild then (a test fails when a shipped task's text reaches the training side).
From the held-out documents' prose paragraphs (sentence-final, mostly letters, in the document's own language
by language ID):

- lambada_sample (generate_until): a passage whose last word already appears earlier in it, as LAMBADA's
  target words mostly do; the model must produce that word. Languages written with spaces.
- cloze_sample (multiple_choice): a word in the middle of a sentence is blanked; choices are the true word and
  three words of similar length from other held-out text of the same language, each followed by the rest of
  the sentence. Languages written with spaces.
- xlang_choice (multiple_choice): the opening of a paragraph, and four continuations: its own and those of
  paragraphs in three other languages. All eleven natural languages.

Each task folder holds test.jsonl, fewshot.jsonl (disjoint paragraphs, for num_fewshot > 0) and <task>.yaml.
Documents interleave the languages, so the first N documents of a task (a limited run) cover every language.
Text keeps its source and license fields: it is the sample corpus's text, under the corpus's licenses (NOTICE).
"""

from __future__ import annotations

import argparse
import json
import random
import re
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

from appliance.data.gpt_dataset import train_valid_split
from appliance.data.langid import detect_language
from appliance.eval.tasks import SHIPPED_TASKS_DIR
from appliance.planner.recipe import BLOOM_SEED

VALID_FRACTION = 0.05  # build_datasets' default valid_fraction (a test checks they agree)
BUILD_SEED = 8  # the tasks' own draws (choices, distractors, order); any fixed number
SPACED_LANGS = ("ar", "de", "en", "es", "fr", "it", "pl", "pt", "ru")
UNSPACED_LANGS = ("ja", "zh")
TEST_PER_LANG = {"lambada_sample": 20, "cloze_sample": 20, "xlang_choice": 16}
FEWSHOT_PER_LANG = 2
SPACED_CHOICE_CHARS = 60
UNSPACED_CHOICE_CHARS = 24
MAX_PASSAGE_CHARS = 360  # about 110 tokens of the CPU model's tokenizer: prompt and answer fit its 128 window
_WORD = re.compile(r"^\w+$")
_SENTENCE_END = ".!?。！？"


# ---- held-out documents ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class CorpusSplit:
    held: dict[str, list[dict[str, Any]]]  # lang -> the documents training holds out for validation, in order
    training_text: str  # every other document, whitespace collapsed to single spaces


def collapse_spaces(text: str) -> str:
    return re.sub(r"\s+", " ", text)


def split_corpus(corpus_dir: Path, seed: int = BLOOM_SEED) -> CorpusSplit:
    """The prepared corpus split as training splits it (per language, documents indexed in corpus order)."""
    by_lang: dict[str, list[dict[str, Any]]] = {}
    for shard in sorted(corpus_dir.glob("shard-*.jsonl")):
        with open(shard, encoding="utf-8") as f:
            for line in f:
                if line.strip():
                    record = json.loads(line)
                    by_lang.setdefault(record["lang"], []).append(record)
    held, training = {}, []
    for lang, docs in sorted(by_lang.items()):
        # train_valid_split reads only len() of the dataset it splits.
        train, valid = train_valid_split(cast(Any, docs), VALID_FRACTION, seed)
        held[lang] = [docs[i] for i in valid.tolist()]
        training += [collapse_spaces(docs[i]["text"]) for i in train.tolist()]
    return CorpusSplit(held, "\n".join(training))


def prose_paragraph(block: str, lang: str) -> str | None:
    """The block as one line if it reads as running text in `lang` (sentence-final, mostly letters), else None."""
    lines = [line.strip() for line in block.splitlines() if line.strip()]
    if not lines or any(line.startswith(("-", "*", "•", "#", "$", "/", "<")) for line in lines):
        return None  # option lists, bullets, commands and markup are not prose
    paragraph = collapse_spaces(" ".join(lines))
    if not 40 <= len(paragraph) <= MAX_PASSAGE_CHARS or paragraph[-1] not in _SENTENCE_END:
        return None
    visible = [c for c in paragraph if not c.isspace()]
    if sum(c.isalpha() for c in visible) < 0.8 * len(visible):
        return None
    return paragraph if detect_language(paragraph) == lang else None


Paragraph = tuple[str, str, dict[str, str]]  # (paragraph, the paragraph right before it or "", {source, license})


def _paragraphs(split: CorpusSplit) -> dict[str, list[Paragraph]]:
    """lang -> every prose paragraph of the held-out documents (first occurrence), with the paragraph right
    before it when that one is prose too.

    A paragraph that training documents also contain (boilerplate shared by several pages) is left out: held out
    means the text, not only the document."""
    out: dict[str, list[Paragraph]] = {}
    for lang, docs in split.held.items():
        seen: set[str] = set()
        for doc in docs:
            origin = {"source": str(doc.get("source", "")), "license": str(doc.get("license", ""))}
            previous = ""
            for block in re.split(r"\n\s*\n", doc["text"]):
                paragraph = prose_paragraph(block, lang)
                if paragraph is None or paragraph in split.training_text:
                    previous = ""
                    continue
                if paragraph not in seen:
                    seen.add(paragraph)
                    out.setdefault(lang, []).append((paragraph, previous, origin))
                previous = paragraph
    return out


# ---- the three tasks ---------------------------------------------------------------------------------------
def lambada_item(paragraph: str, previous: str) -> dict[str, str] | None:
    """The paragraph, after the one before it when both fit, without its last word and final mark."""
    passage = (
        f"{previous} {paragraph}" if previous and len(previous) + len(paragraph) < MAX_PASSAGE_CHARS else paragraph
    )
    words = passage[:-1].split(" ")
    if len(words) < 8 or not _WORD.match(words[-1]) or len(words[-1]) < 3 or not words[-1].isalpha():
        return None
    target, context = words[-1], " ".join(words[:-1])
    # LAMBADA's words are guessable from the passage: keep targets that the passage already used.
    if target.lower() not in {w.strip(".,;:!?()«»\"'").lower() for w in words[:-1]}:
        return None
    return {"context": context, "word": target}


def cloze_item(paragraph: str, vocabulary: list[str], rng: random.Random) -> dict[str, Any] | None:
    words = paragraph.split(" ")
    if len(words) < 8:
        return None
    middle = [i for i in range(len(words) // 3, 2 * len(words) // 3) if words[i].isalpha() and len(words[i]) >= 4]
    if not middle:
        return None
    blank = middle[len(middle) // 2]
    answer, rest = words[blank], " ".join(words[blank + 1 :])
    used = {w.lower() for w in words}
    close = [w for w in vocabulary if w.lower() not in used and abs(len(w) - len(answer)) <= 2]
    if len(set(close)) < 3:
        return None
    distractors = rng.sample(sorted(set(close)), 3)
    choices = [answer, *distractors]
    rng.shuffle(choices)
    return {
        "context": " ".join(words[:blank]),
        "choices": [f"{c} {rest}" for c in choices],
        "label": choices.index(answer),
    }


def _split_opening(paragraph: str, lang: str) -> tuple[str, str] | None:
    """(opening, continuation) at about 60% of the paragraph: at a space, or at any character without spaces."""
    if lang in UNSPACED_LANGS:
        cut = int(len(paragraph) * 0.6)
        while cut < len(paragraph) and (paragraph[cut].isspace() or paragraph[cut - 1].isspace()):
            cut += 1  # not next to a space (embedded Latin words): both halves read the same once stripped
        return (paragraph[:cut], paragraph[cut:]) if len(paragraph) - cut >= 8 else None
    words = paragraph.split(" ")
    if len(words) < 8:
        return None
    cut = int(len(words) * 0.6)
    return " ".join(words[:cut]), " ".join(words[cut:])


def _clip(text: str, lang: str) -> str:
    """A continuation cut to a similar amount of text in every script, without its sentence-final mark, so
    neither its length nor its ending tells the answer."""
    text = text.strip()
    if lang in UNSPACED_LANGS:
        text = text[:UNSPACED_CHOICE_CHARS]
    else:
        words, kept = text.split(" "), list[str]()
        for word in words:
            if kept and len(" ".join([*kept, word])) > SPACED_CHOICE_CHARS:
                break
            kept.append(word)
        text = " ".join(kept)
    return text.rstrip(_SENTENCE_END + ",;:")


def xlang_item(lang: str, paragraph: str, pool: dict[str, list[str]], rng: random.Random) -> dict[str, Any] | None:
    split = _split_opening(paragraph, lang)
    others = [other for other in sorted(pool) if other != lang and pool[other]]
    if split is None or len(others) < 3:
        return None
    opening, own = split
    langs = [lang, *rng.sample(others, 3)]
    continuations = [own] + [rng.choice(pool[other]) for other in langs[1:]]
    # One spacing convention for all four, the opening's: a leading space would otherwise give the answer away.
    lead = "" if lang in UNSPACED_LANGS else " "
    choices = [lead + _clip(text, text_lang) for text, text_lang in zip(continuations, langs, strict=True)]
    order = list(range(4))
    rng.shuffle(order)
    return {
        "context": opening,
        "choices": [choices[k] for k in order],
        "label": order.index(0),
        "choice_langs": [langs[k] for k in order],
    }


def _interleave(per_lang: dict[str, list[dict[str, Any]]]) -> list[dict[str, Any]]:
    out = []
    for row in range(max((len(v) for v in per_lang.values()), default=0)):
        out += [items[row] for _, items in sorted(per_lang.items()) if row < len(items)]
    return out


def build_items(split: CorpusSplit) -> dict[str, tuple[list[dict[str, Any]], list[dict[str, Any]]]]:
    """task name -> (test documents, few-shot documents), deterministic for a given corpus split."""
    paragraphs = _paragraphs(split)
    rng = random.Random(BUILD_SEED)
    tasks: dict[str, tuple[list[dict[str, Any]], list[dict[str, Any]]]] = {}
    vocabulary = {
        lang: sorted({w for p, _, _ in paragraphs.get(lang, []) for w in p.split(" ") if w.isalpha() and len(w) >= 4})
        for lang in SPACED_LANGS
    }
    continuation_pool = {
        lang: [s[1] for p, _, _ in paragraphs.get(lang, []) if (s := _split_opening(p, lang))]
        for lang in SPACED_LANGS + UNSPACED_LANGS
    }
    makers = {
        "lambada_sample": (SPACED_LANGS, lambda lang, p, before: lambada_item(p, before)),
        "cloze_sample": (SPACED_LANGS, lambda lang, p, before: cloze_item(p, vocabulary[lang], rng)),
        "xlang_choice": (
            SPACED_LANGS + UNSPACED_LANGS,
            lambda lang, p, before: xlang_item(lang, p, continuation_pool, rng),
        ),
    }
    for name, (langs, make) in makers.items():
        test: dict[str, list[dict[str, Any]]] = {}
        fewshot: dict[str, list[dict[str, Any]]] = {}
        for lang in langs:
            candidates = list(paragraphs.get(lang, []))
            rng.shuffle(candidates)
            records = []
            for paragraph, before, origin in candidates:
                item = make(lang, paragraph, before)
                if item is not None:
                    records.append({**item, "lang": lang, **origin})
            # A quarter at most goes to the few-shot examples, so a scarce language still has test documents.
            shots = min(FEWSHOT_PER_LANG, len(records) // 4)
            fewshot[lang] = records[:shots]
            test[lang] = records[shots : shots + TEST_PER_LANG[name]]
        tasks[name] = (_interleave(test), _interleave(fewshot))
    return tasks


# ---- files -------------------------------------------------------------------------------------------------
def task_yaml(name: str) -> dict[str, Any]:
    """The lm-eval task file of a shipped task (its data files sit beside it)."""
    common: dict[str, Any] = {
        "task": name,
        "dataset_path": "json",
        "dataset_kwargs": {"data_files": {"test": "test.jsonl", "validation": "fewshot.jsonl"}},
        "test_split": "test",
        "fewshot_split": "validation",
        "num_fewshot": 0,
        "doc_to_text": "{{context}}",
    }
    if name == "lambada_sample":
        return common | {
            "output_type": "generate_until",
            "doc_to_target": "{{word}}",
            "generation_kwargs": {"until": ["\n"], "max_gen_toks": 8, "do_sample": False},
            # The answer is the first word generated (lm-eval's regex filter, then its take_first).
            "filter_list": [
                {
                    "name": "first_word",
                    "filter": [{"function": "regex", "regex_pattern": r"^\s*(\w+)"}, {"function": "take_first"}],
                }
            ],
            "metric_list": [{"metric": "exact_match", "aggregation": "mean", "higher_is_better": True}],
            "metadata": {"version": 1.0},
        }
    mc = common | {
        "output_type": "multiple_choice",
        "doc_to_choice": "{{choices}}",
        "doc_to_target": "{{label}}",
        "metric_list": [
            {"metric": "acc", "aggregation": "mean", "higher_is_better": True},
            {"metric": "acc_norm", "aggregation": "mean", "higher_is_better": True},
        ],
        "metadata": {"version": 1.0},
    }
    # xlang choices carry their own leading space (none after Chinese or Japanese), so no delimiter is added.
    return mc | {"target_delimiter": ""} if name == "xlang_choice" else mc


def _yaml_text(value: Any, indent: int = 0) -> str:
    """Block-style YAML whose scalars are JSON (a YAML subset): "\\n" stays readable, quoting stays exact."""
    pad = " " * indent
    if isinstance(value, dict):
        lines = []
        for key, item in value.items():
            if isinstance(item, dict) or (isinstance(item, list) and any(isinstance(i, dict) for i in item)):
                lines.append(f"{pad}{key}:\n{_yaml_text(item, indent + 2)}")
            else:
                lines.append(f"{pad}{key}: {json.dumps(item, ensure_ascii=False)}\n")
        return "".join(lines)
    # A list of mappings: each item's first key on the dash line, the others aligned under it.
    return "".join(f"{pad}- {_yaml_text(item, indent + 2)[indent + 2 :]}" for item in value)


def _jsonl(records: list[dict[str, Any]]) -> str:
    return "".join(json.dumps(r, ensure_ascii=False, sort_keys=True) + "\n" for r in records)


def write_tasks(tasks: dict[str, tuple[list[dict[str, Any]], list[dict[str, Any]]]], out_dir: Path) -> list[Path]:
    written = []
    for name, (test, fewshot) in sorted(tasks.items()):
        folder = out_dir / name
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "test.jsonl").write_text(_jsonl(test), encoding="utf-8")
        (folder / "fewshot.jsonl").write_text(_jsonl(fewshot), encoding="utf-8")
        header = "# Built by appliance/eval/build_tasks.py from the sample corpus's held-out documents; do not edit.\n"
        (folder / f"{name}.yaml").write_text(header + _yaml_text(task_yaml(name)), encoding="utf-8")
        written += [folder / "test.jsonl", folder / "fewshot.jsonl", folder / f"{name}.yaml"]
    return written


def build(out_dir: Path = SHIPPED_TASKS_DIR, corpus_dir: Path | None = None) -> list[Path]:
    """Prepare the sample corpus (unless corpus_dir holds it prepared already) and write the tasks to out_dir."""
    if corpus_dir is not None:
        return write_tasks(build_items(split_corpus(corpus_dir)), out_dir)
    from appliance.data.prep import prepare_corpus
    from appliance.data.sample_corpus import SAMPLE_CORPUS_DIR

    with tempfile.TemporaryDirectory(prefix="build-tasks-") as tmp:
        prepared = Path(tmp) / "corpus"
        prepare_corpus([SAMPLE_CORPUS_DIR], prepared, workers=1)
        return write_tasks(build_items(split_corpus(prepared)), out_dir)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m appliance.eval.build_tasks", description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=SHIPPED_TASKS_DIR)
    parser.add_argument("--corpus-dir", type=Path, help="the sample corpus already prepared (e.g. a run's corpus/)")
    args = parser.parse_args(argv)
    for path in build(args.out, args.corpus_dir):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
