"""Few-shot benchmark data (GSM8K, MMLU) read from the shared data folder beside the project."""

from __future__ import annotations

import csv
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path


def default_data_dir() -> Path:
    """$RADIXLM_DATA_DIR, else ../shared/data next to the project checkout."""
    env = os.environ.get("RADIXLM_DATA_DIR")
    if env:
        return Path(env)
    return Path(__file__).resolve().parents[3] / "shared" / "data"


@dataclass
class Gsm8kItem:
    question: str
    answer: str  # full worked solution ending with "#### <number>"

    @property
    def label(self) -> str:
        return extract_gsm8k_number(self.answer.split("####")[-1]) or ""


def load_gsm8k(split: str, limit: int | None = None, data_dir: Path | None = None) -> list[Gsm8kItem]:
    path = (data_dir or default_data_dir()) / "gsm8k" / f"{split}.jsonl"
    if not path.exists():
        raise FileNotFoundError(
            f"GSM8K {split} split not found at {path} (set --data-dir or RADIXLM_DATA_DIR)"
        )
    items: list[Gsm8kItem] = []
    with path.open() as f:
        for line in f:
            if limit is not None and len(items) >= limit:
                break
            row = json.loads(line)
            items.append(Gsm8kItem(row["question"], row["answer"]))
    return items


def gsm8k_fewshot_prefix(num_shots: int, data_dir: Path | None = None) -> str:
    """The shared prefix every question is appended to: the first num_shots train examples."""
    shots = load_gsm8k("train", num_shots, data_dir)
    return "".join(f"Question: {s.question}\nAnswer: {_clean_solution(s.answer)}\n\n" for s in shots)


def gsm8k_question_suffix(question: str) -> str:
    return f"Question: {question}\nAnswer:"


def _clean_solution(answer: str) -> str:
    """Drops the calculator annotations (<<48/2=24>>) that GSM8K solutions carry."""
    return re.sub(r"<<[^>]*>>", "", answer)


_NUMBER = re.compile(r"-?[\d,]*\.?\d+")


def extract_gsm8k_number(text: str) -> str | None:
    """The answer a model gave: the number after '####' if present, else the last number."""
    if "####" in text:
        text = text.split("####", 1)[1]
        found = _NUMBER.findall(text)
        return _normalise(found[0]) if found else None
    found = _NUMBER.findall(text)
    return _normalise(found[-1]) if found else None


def _normalise(num: str) -> str:
    num = num.replace(",", "").rstrip(".")
    if "." in num:
        num = num.rstrip("0").rstrip(".")
    return num


@dataclass
class MmluItem:
    question: str
    choices: list[str]
    label: str  # "A" .. "D"


def load_mmlu(
    subject: str, split: str, limit: int | None = None, data_dir: Path | None = None
) -> list[MmluItem]:
    path = (data_dir or default_data_dir()) / "mmlu" / split / f"{subject}_{split}.csv"
    if not path.exists():
        raise FileNotFoundError(f"MMLU {subject}/{split} not found at {path}")
    items: list[MmluItem] = []
    with path.open(newline="") as f:
        for row in csv.reader(f):
            if limit is not None and len(items) >= limit:
                break
            items.append(MmluItem(row[0], row[1:5], row[5].strip()))
    return items


def mmlu_subjects(data_dir: Path | None = None) -> list[str]:
    test_dir = (data_dir or default_data_dir()) / "mmlu" / "test"
    return sorted(p.name.removesuffix("_test.csv") for p in test_dir.glob("*_test.csv"))
