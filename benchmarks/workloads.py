"""The prefix-sharing workloads the benchmarks run: few-shot GSM8K, few-shot MMLU and multi-turn chat.

Prompts are tokenized here, once, with the model's own tokenizer, and every system is given the same
token ids: systems that tokenized text themselves could split a prompt differently at the boundary of
an answer choice and would then not be scoring the same thing.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from radixlm.eval.data import (
    gsm8k_fewshot_prefix,
    gsm8k_question_suffix,
    load_gsm8k,
    load_mmlu,
    mmlu_subjects,
)
from radixlm.eval.tasks import MMLU_CHOICES, MMLU_LETTERS, mmlu_block, mmlu_fewshot_prefix


@dataclass
class GenTask:
    """Open-ended generation: each prompt is answered greedily and graded against its label."""

    prompts: list[list[int]]
    labels: list[str]


@dataclass
class ChoiceTask:
    """Multiple choice: the answer is the continuation with the highest total logprob after the prompt."""

    prompts: list[list[int]]
    choices: list[list[int]]  # the token ids of each continuation, the same for every prompt
    labels: list[int]  # index into choices


def gsm8k_prompts(num_questions: int, num_shots: int) -> tuple[list[str], list[str]]:
    """Test questions, each behind the same num_shots-example prefix from the train split, and their
    labels."""
    prefix = gsm8k_fewshot_prefix(num_shots)
    items = load_gsm8k("test", num_questions)
    return [prefix + gsm8k_question_suffix(it.question) for it in items], [it.label for it in items]


def gsm8k_task(tokenizer: Any, num_questions: int, num_shots: int) -> GenTask:
    texts, labels = gsm8k_prompts(num_questions, num_shots)
    return GenTask([tokenizer.encode(t) for t in texts], labels)


def mmlu_task(tokenizer: Any, num_subjects: int, per_subject: int, num_shots: int) -> ChoiceTask:
    """The classic MMLU k-shot format: per subject, a header and num_shots solved dev questions form the
    shared prefix; test questions follow it. The first num_subjects subjects in name order are used."""
    subjects = mmlu_subjects()[:num_subjects]
    if not subjects:
        raise FileNotFoundError("no MMLU subjects found (see radixlm.eval.data.default_data_dir)")
    # Continuations of the prompt: no BOS of their own (Gemma's tokenizer adds one to every encode).
    choices = [tokenizer.encode(c, add_special_tokens=False) for c in MMLU_CHOICES]
    if any(len(c) != 1 for c in choices):
        raise ValueError(f"expected single-token answer letters, got {choices}")
    prompts: list[list[int]] = []
    labels: list[int] = []
    for subject in subjects:
        prefix = mmlu_fewshot_prefix(subject, num_shots)
        for item in load_mmlu(subject, "test", per_subject):
            prompts.append(tokenizer.encode(prefix + mmlu_block(item.question, item.choices)))
            labels.append(MMLU_LETTERS.index(item.label))
    return ChoiceTask(prompts, choices, labels)


# Chat histories come from train items well clear of the few-shot examples at the start of the split.
_CHAT_FIRST_ITEM = 100
CHAT_SYSTEM_PROMPT = (
    "You are a patient maths tutor. Work through each word problem step by step, state the arithmetic "
    "you do, and finish with the final number on its own line."
)


def chat_prompts(tokenizer: Any, num_conversations: int, turns: int) -> list[list[str]]:
    """Multi-turn conversations sharing one system prompt; turn t's prompt holds the whole history of
    turns before it, so each turn extends a prefix the server has seen. The history's user questions
    and assistant answers are GSM8K train problems and solutions, fixed in advance, so the prompt of
    every turn is known before the run starts. Returns prompts[conversation][turn] as text."""
    items = load_gsm8k("train", _CHAT_FIRST_ITEM + num_conversations * turns)[_CHAT_FIRST_ITEM:]
    conversations: list[list[str]] = []
    for c in range(num_conversations):
        messages: list[dict[str, str]] = [{"role": "system", "content": CHAT_SYSTEM_PROMPT}]
        prompts: list[str] = []
        for item in items[c * turns : (c + 1) * turns]:
            messages.append({"role": "user", "content": item.question})
            prompts.append(
                tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
            )
            messages.append({"role": "assistant", "content": item.answer})
        conversations.append(prompts)
    return conversations
