"""The local lm-eval task of benchmarks/bench_lmeval.py asks exactly what `radixlm.eval mmlu` asks:
its templates, rendered the way lm-eval renders them (Jinja over each CSV row), give the same
prompt and the same answer continuations, so the two evaluators' answers are comparable."""

from __future__ import annotations

import csv
import sys
from pathlib import Path

import jinja2
import yaml

from radixlm.eval.data import default_data_dir, load_mmlu
from radixlm.eval.tasks import MMLU_CHOICES, mmlu_block, mmlu_fewshot_prefix

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from bench_lmeval import NUM_SHOTS, task_yaml  # noqa: E402

SUBJECT = "high_school_geography"


def _rows(split: str) -> list[dict[str, str]]:
    path = default_data_dir() / "mmlu" / split / f"{SUBJECT}_{split}.csv"
    with path.open(newline="") as f:
        return [dict(zip(["question", "A", "B", "C", "D", "answer"], row)) for row in csv.reader(f)]


def test_local_task_renders_the_radixlm_eval_prompt() -> None:
    task = yaml.safe_load(task_yaml(SUBJECT, default_data_dir()))
    assert task["dataset_kwargs"]["data_files"]["test"].endswith(f"{SUBJECT}_test.csv")
    assert task["num_fewshot"] == NUM_SHOTS and task["fewshot_config"]["sampler"] == "first_n"
    text = jinja2.Template(task["doc_to_text"])
    target = jinja2.Template(task["doc_to_target"])
    choices = task["doc_to_choice"]

    def labeled(row: dict[str, str]) -> str:
        return text.render(**row) + task["target_delimiter"] + choices[int(target.render(**row))]

    shots = task["fewshot_delimiter"].join(labeled(row) for row in _rows("dev")[:NUM_SHOTS])
    test_rows = _rows("test")[:3]
    for row, item in zip(test_rows, load_mmlu(SUBJECT, "test", 3)):
        prompt = task["description"] + shots + task["fewshot_delimiter"] + text.render(**row)
        assert prompt == mmlu_fewshot_prefix(SUBJECT, NUM_SHOTS) + mmlu_block(item.question, item.choices)
        assert [task["target_delimiter"] + c for c in choices] == MMLU_CHOICES
