"""Prompt formats and grading of the few-shot tasks, shared by the eval CLI and the benchmarks so
every system is asked exactly the same thing."""

from __future__ import annotations

from pathlib import Path

from radixlm.eval.data import extract_gsm8k_number, load_mmlu

MMLU_LETTERS = ("A", "B", "C", "D")
# What select chooses between after "Answer:" (single tokens in the default tokenizer).
MMLU_CHOICES = [f" {letter}" for letter in MMLU_LETTERS]
# A GSM8K answer ends where the model starts inventing the next question.
GSM8K_STOP = ["Question:"]


def gsm8k_answer(text: str) -> str | None:
    """The model's first answer: it tends to go on with a made-up next question."""
    return extract_gsm8k_number(text.split(GSM8K_STOP[0])[0])


def gsm8k_correct(text: str, label: str) -> bool:
    return gsm8k_answer(text) == label


def mmlu_block(question: str, choices: list[str]) -> str:
    options = "".join(f"\n{letter}. {text}" for letter, text in zip(MMLU_LETTERS, choices))
    return f"{question.strip()}{options}\nAnswer:"


def mmlu_fewshot_prefix(subject: str, num_shots: int, data_dir: Path | None = None) -> str:
    """The classic MMLU k-shot prefix: a subject header and num_shots solved dev questions."""
    header = (
        f"The following are multiple choice questions (with answers) about {subject.replace('_', ' ')}.\n\n"
    )
    shots = "".join(
        f"{mmlu_block(s.question, s.choices)} {s.label}\n\n"
        for s in load_mmlu(subject, "dev", num_shots, data_dir)
    )
    return header + shots
