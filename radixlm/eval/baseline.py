"""The plain `transformers` baseline the eval CLI and the benchmarks compare radixlm with: the same
token ids, greedy, batched, no state kept between batches."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import torch

WARMUP_PROMPT = "Question: What is 1 + 1?\nAnswer:"


@dataclass
class GenRun:
    output_ids: list[list[int]] | None  # None where the system returns text only
    texts: list[str]
    completion_tokens: int
    wall_s: float
    prompt_tokens: int
    cached_tokens: int | None


@dataclass
class ScoreRun:
    logprobs: list[list[float]]  # [prompt][choice]: the continuation's total logprob
    wall_s: float
    prompt_tokens: int
    cached_tokens: int | None


class TransformersSystem:
    """A plain `transformers` loop: left-padded batches through `model.generate` (greedy) for
    generation, and one forward pass per batch of prompts for choices, reading every continuation's
    logprob from the last position. No state is kept between batches."""

    def __init__(self, model_dir: Path, batch_size: int) -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
        self.pad_id = (
            self.tokenizer.pad_token_id
            if self.tokenizer.pad_token_id is not None
            else self.tokenizer.eos_token_id
        )
        self.model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
        self.batch_size = batch_size
        self.generate([self.tokenizer.encode(WARMUP_PROMPT)], 4)

    def _batch(self, prompts: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        width = max(len(p) for p in prompts)
        ids = torch.tensor([[self.pad_id] * (width - len(p)) + p for p in prompts])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
        return ids, mask

    def generate(self, prompts: list[list[int]], max_new_tokens: int) -> GenRun:
        eos = self.tokenizer.eos_token_id
        output_ids: list[list[int]] = []
        t0 = time.perf_counter()
        for i in range(0, len(prompts), self.batch_size):
            ids, mask = self._batch(prompts[i : i + self.batch_size])
            with torch.inference_mode():
                out = self.model.generate(
                    input_ids=ids,
                    attention_mask=mask,
                    max_new_tokens=max_new_tokens,
                    do_sample=False,
                    pad_token_id=self.pad_id,
                )
            for row in out[:, ids.shape[1] :].tolist():
                output_ids.append(row[: row.index(eos) + 1] if eos in row else row)
        wall = time.perf_counter() - t0
        return GenRun(
            output_ids=output_ids,
            texts=[self.tokenizer.decode(ids, skip_special_tokens=True) for ids in output_ids],
            completion_tokens=sum(len(ids) for ids in output_ids),
            wall_s=wall,
            prompt_tokens=sum(len(p) for p in prompts),
            cached_tokens=None,
        )

    def score(self, prompts: list[list[int]], choices: list[list[int]]) -> ScoreRun:
        if any(len(c) != 1 for c in choices):
            raise ValueError("the transformers baseline scores single-token continuations only")
        choice_ids = torch.tensor([c[0] for c in choices])
        logprobs: list[list[float]] = []
        t0 = time.perf_counter()
        for i in range(0, len(prompts), self.batch_size):
            ids, mask = self._batch(prompts[i : i + self.batch_size])
            # Positions count real tokens only, as generate() does for left-padded rows.
            positions = (mask.cumsum(-1) - 1).clamp(min=0)
            with torch.inference_mode():
                logits = self.model(
                    input_ids=ids, attention_mask=mask, position_ids=positions, logits_to_keep=1
                ).logits[:, -1]
            logprobs.extend(torch.log_softmax(logits.float(), dim=-1)[:, choice_ids].tolist())
        wall = time.perf_counter() - t0
        return ScoreRun(logprobs, wall, sum(len(p) for p in prompts), None)

    def close(self) -> None:
        del self.model
