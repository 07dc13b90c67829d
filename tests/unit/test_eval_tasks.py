"""Task files in lm-eval's local format: templates, choices, targets, few-shot prompts, and bad files."""

from __future__ import annotations

import inspect
import json
from pathlib import Path

import pytest

from appliance.data.blend import build_datasets
from appliance.errors import BadInput
from appliance.eval import build_tasks
from appliance.eval.tasks import SHIPPED_TASKS_DIR, FilterStep, load_task, load_tasks

DOCS = [
    {"question": "Two and two", "options": ["three", "four", "five"], "answer": 1, "gold": "four"},
    {"question": "The sky is", "options": ["blue", "green", "red"], "answer": 0, "gold": "blue"},
    {"question": "Snow is", "options": ["black", "white", "pink"], "answer": 1, "gold": "white"},
]


def write_task(folder: Path, yaml_text: str, docs: list[dict] = DOCS, name: str = "task.yaml") -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "test.jsonl").write_text("".join(json.dumps(d) + "\n" for d in docs))
    (folder / "train.jsonl").write_text("".join(json.dumps(d) + "\n" for d in reversed(docs)))
    path = folder / name
    path.write_text(yaml_text)
    return path


MC_YAML = """
task: quiz
dataset_path: json
dataset_kwargs:
  data_files: {test: test.jsonl, train: train.jsonl}
test_split: test
training_split: train
output_type: multiple_choice
doc_to_text: "Q: {{question}}?\\nA:"
doc_to_choice: "{{options}}"
doc_to_target: "{{answer}}"
"""


def test_templates_choices_and_targets_as_lm_eval_reads_them(tmp_path):
    task = load_task(write_task(tmp_path, MC_YAML))
    assert (task.name, task.output_type, len(task.docs), task.num_fewshot) == ("quiz", "multiple_choice", 3, 0)
    doc = task.docs[0]
    assert task.text(doc) == "Q: Two and two?\nA:"
    assert task.choices(doc) == ["three", "four", "five"]
    assert task.target(doc) == 1 and task.target_text(doc) == "four"
    assert task.context(0) == "Q: Two and two?\nA:"

    # A field name, a constant choice list, and a target given as the answer's text.
    variant = MC_YAML.replace('"{{options}}"', '["blue", "four", "white"]').replace('"{{answer}}"', "gold")
    task = load_task(write_task(tmp_path / "v", variant))
    assert task.choices(task.docs[2]) == ["blue", "four", "white"]
    assert [task.target(d, i) for i, d in enumerate(task.docs)] == [1, 0, 2]


def test_few_shot_context_is_lm_evals_layout_and_fixed_per_document(tmp_path):
    yaml_text = MC_YAML + 'num_fewshot: 2\ndescription: "Quiz.\\n\\n"\n'
    task = load_task(write_task(tmp_path, yaml_text))
    context = task.context(1)
    assert context.startswith("Quiz.\n\nQ: ") and context.endswith("\n\nQ: The sky is?\nA:")
    shots = context.removeprefix("Quiz.\n\n").split("\n\n")[:2]
    solved = {f"Q: {d['question']}?\nA: {d['gold']}" for d in DOCS}
    assert len(shots) == 2 and set(shots) <= solved
    assert task.context(1) == context  # same draw every time, whatever was asked before
    assert load_task(task.path).context(1) == context


def test_fewshot_from_the_test_split_never_shows_the_document_itself(tmp_path):
    yaml_text = MC_YAML.replace("training_split: train\n", "") + "num_fewshot: 2\n"
    task = load_task(write_task(tmp_path, yaml_text))
    for index, doc in enumerate(task.docs):
        shots = task.context(index).split("\n\n")[:-1]
        assert f"Q: {doc['question']}?\nA: {doc['gold']}" not in shots and len(shots) == 2


def test_generation_settings_filters_and_match_options(tmp_path):
    yaml_text = """
task: words
dataset_path: json
dataset_kwargs: {data_files: {test: test.jsonl}}
output_type: generate_until
test_split: test
doc_to_text: "{{question}} ="
doc_to_target: "{{gold}}"
generation_kwargs: {until: [".", "\\n"], max_gen_toks: 5, do_sample: false}
filter_list:
  - name: word
    filter:
      - {function: regex, regex_pattern: "(\\\\w+)"}
      - {function: lowercase}
      - {function: take_first}
metric_list:
  - {metric: exact_match, ignore_case: true, ignore_punctuation: true}
"""
    task = load_task(write_task(tmp_path, yaml_text))
    assert task.until == (".", "\n") and task.max_gen_toks == 5
    assert [f.function for f in task.filters] == ["regex", "lowercase", "take_first"]
    assert task.match_options == {"ignore_case": True, "ignore_punctuation": True}
    assert task.target(task.docs[1]) == "blue"
    answer = " Four apples"
    for step in task.filters:
        answer = step.apply(answer)
    assert answer == "four"
    assert FilterStep("regex", regex_pattern=r"#(\d+)").apply("no number") == "[invalid]"


@pytest.mark.parametrize(
    ("yaml_text", "message"),
    [
        ("task: [unclosed\n", "not valid YAML"),
        ("task: x\nprocess_docs: !function utils.process_docs\n", "YAML tag"),
        ("- just\n- a list\n", "expected a mapping"),
        (MC_YAML + "process_results: foo\n", "process_results not supported"),
        (MC_YAML + "doc_to_txet: oops\n", "unknown key"),
        (MC_YAML.replace("task: quiz", ""), "needs a task name"),
        (MC_YAML.replace("multiple_choice", "loglikelihood_rolling"), "output_type"),
        (MC_YAML.replace('doc_to_text: "Q: {{question}}?\\nA:"', 'doc_to_text: "{{question"'), "not a valid template"),
        (MC_YAML.replace("dataset_path: json", "dataset_path: EleutherAI/lambada_openai"), "nothing is downloaded"),
        (MC_YAML.replace("test.jsonl, train", "missing.jsonl, train"), "missing.jsonl not found"),
        (MC_YAML + "num_fewshot: 5\n", "only 3 example"),
        (
            MC_YAML.replace("output_type: multiple_choice", "output_type: generate_until")
            + "generation_kwargs: {do_sample: true}\n",
            "sampling",
        ),
        (MC_YAML + "filter_list: [{name: x, filter: [{function: majority_vote}]}]\n", "not supported"),
    ],
)
def test_bad_task_files_name_the_file(tmp_path, yaml_text, message):
    path = write_task(tmp_path, yaml_text)
    with pytest.raises(BadInput, match=message) as info:
        load_task(path)
    assert str(path) in str(info.value)


def test_bad_documents_name_the_file_and_document(tmp_path):
    path = write_task(tmp_path, MC_YAML)
    (tmp_path / "test.jsonl").write_text('{"question": "ok"}\nnot json\n')
    with pytest.raises(BadInput, match=r"test.jsonl:2: not a JSON line"):
        load_task(path)
    write_task(tmp_path, MC_YAML, docs=[{"question": "q", "options": ["a"], "answer": 3}])
    task = load_task(path)
    with pytest.raises(BadInput, match=r"task.yaml: doc_to_target of document 0 is 3, outside its 1 choices"):
        task.target(task.docs[0], 0)
    write_task(tmp_path, MC_YAML, docs=[{"options": ["a"], "answer": 0}])
    task = load_task(path)
    with pytest.raises(BadInput, match=r"task.yaml: doc_to_text of document 0: 'question' is undefined"):
        task.context(0)


def test_task_names_must_be_unique(tmp_path):
    write_task(tmp_path / "a", MC_YAML)
    write_task(tmp_path / "b", MC_YAML)
    with pytest.raises(BadInput, match="also used by"):
        load_tasks([tmp_path])
    with pytest.raises(BadInput, match="no such task file"):
        load_tasks([tmp_path / "nowhere"])


def test_shipped_tasks_load_and_cover_their_languages():
    tasks = {t.name: t for t in load_tasks()}
    assert set(tasks) == {"lambada_sample", "cloze_sample", "xlang_choice"}
    assert tasks["lambada_sample"].output_type == "generate_until"
    assert tasks["cloze_sample"].output_type == tasks["xlang_choice"].output_type == "multiple_choice"
    for task in tasks.values():
        assert len(task.docs) >= 30 and task.fewshot_docs and task.num_fewshot == 0
        for i, doc in enumerate(task.docs):
            task.context(i)
            assert task.target_text(doc, i)
    # Languages interleave: the first 32 documents (the CPU default) reach every language of the task.
    assert {d["lang"] for d in tasks["xlang_choice"].docs[:32]} == set(
        build_tasks.SPACED_LANGS + build_tasks.UNSPACED_LANGS
    )
    assert {d["lang"] for d in tasks["cloze_sample"].docs[:32]} == set(build_tasks.SPACED_LANGS)
    for doc in tasks["xlang_choice"].docs:  # the true continuation is the only one in the prompt's language
        assert doc["choice_langs"].count(doc["lang"]) == 1 and doc["choice_langs"][doc["label"]] == doc["lang"]
    for i, doc in enumerate(tasks["lambada_sample"].docs):
        assert doc["word"].lower() in tasks["lambada_sample"].context(i).lower()


def test_held_out_split_is_trainings_validation_split():
    assert inspect.signature(build_datasets).parameters["valid_fraction"].default == build_tasks.VALID_FRACTION
    assert SHIPPED_TASKS_DIR.is_dir()
