"""The systems the offline few-shot benchmark compares, behind one interface: greedy generation for a
list of prompts, and scoring a fixed set of continuations after each prompt.

Every system gets the same token ids and is timed from its first request to its last answer, with
model loading and one warm-up request left out. `cached_tokens` is how many prompt tokens a system
reused from earlier requests instead of computing them (None where the system has no such cache).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

WARMUP_PROMPT = "Question: What is 1 + 1?\nAnswer:"


class SystemUnavailable(RuntimeError):
    """An optional system that cannot run here; the benchmark reports it as skipped."""


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


class RadixlmSystem:
    """The offline Engine: prompts are submitted together and the scheduler batches them. A choice is
    scored as its own request (prompt + continuation, max_new_tokens=0, the continuation's prompt
    logprobs), the way the language's `select` does, so the radix cache serves the shared prompt. The
    no-cache variant sends exactly the same requests."""

    def __init__(self, disable_radix_cache: bool) -> None:
        import radixlm_runtime as rt

        self.engine = rt.Engine(disable_radix_cache=disable_radix_cache, log_level="warning")
        self.engine.generate(WARMUP_PROMPT, {"temperature": 0, "max_new_tokens": 4})
        self.engine.flush_cache()

    def generate(self, prompts: list[list[int]], max_new_tokens: int) -> GenRun:
        self.engine.flush_cache()
        t0 = time.perf_counter()
        outs = self.engine.generate(
            input_ids=prompts, sampling_params={"temperature": 0, "max_new_tokens": max_new_tokens}
        )
        wall = time.perf_counter() - t0
        return GenRun(
            output_ids=[o["output_ids"] for o in outs],
            texts=[o["text"] for o in outs],
            completion_tokens=sum(o["meta_info"]["completion_tokens"] for o in outs),
            wall_s=wall,
            prompt_tokens=sum(o["meta_info"]["prompt_tokens"] for o in outs),
            cached_tokens=sum(o["meta_info"]["cached_tokens"] for o in outs),
        )

    def score(self, prompts: list[list[int]], choices: list[list[int]]) -> ScoreRun:
        self.engine.flush_cache()
        zero = {"temperature": 0, "max_new_tokens": 0}
        t0 = time.perf_counter()
        # All prompts first, in one batch (as `select` sends the bare prompt first): the cache then
        # holds every prompt and each choice request computes only its own continuation. A call takes
        # a single logprob_start_len, so the choices go in one call per prompt.
        warm = self.engine.generate(input_ids=prompts, sampling_params=zero)
        outs = [
            self.engine.generate(
                input_ids=[p + c for c in choices],
                sampling_params=zero,
                return_logprob=True,
                logprob_start_len=len(p),
            )
            for p in prompts
        ]
        wall = time.perf_counter() - t0
        served = [o["meta_info"] for o in warm] + [o["meta_info"] for group in outs for o in group]
        return ScoreRun(
            logprobs=[
                [sum(lp for lp, _, _ in o["meta_info"]["input_token_logprobs"]) for o in group]
                for group in outs
            ],
            wall_s=wall,
            prompt_tokens=sum(m["prompt_tokens"] for m in served),
            cached_tokens=sum(m["cached_tokens"] for m in served),
        )

    def close(self) -> None:
        self.engine.shutdown()


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


class LlamaCppSystem:
    """llama.cpp through llama-cpp-python on the same GGUF file (so with its 4-bit weights), one request
    at a time, as its Python API serves them. Its prompt cache is on: each prompt reuses the KV of the
    longest prefix it shares with the previous one, and a LlamaRAMCache keeps the states of earlier
    prompts. Reused tokens are counted from what each request actually evaluates."""

    def __init__(self, gguf_path: Path, n_ctx: int = 2048) -> None:
        try:
            from llama_cpp import Llama, LlamaRAMCache, llama_get_logits_ith
        except ImportError:
            raise SystemUnavailable(
                "llama-cpp-python is not installed (pip install -e '.[llamacpp]'; it compiles llama.cpp)"
            ) from None
        self.llm = Llama(
            model_path=str(gguf_path), n_ctx=n_ctx, n_threads=os.cpu_count(), verbose=False, seed=0
        )
        self.llm.set_cache(LlamaRAMCache())
        self._last_logits = lambda: np.ctypeslib.as_array(
            llama_get_logits_ith(self.llm.ctx, -1), shape=(self.llm.n_vocab(),)
        )
        self._evaluated: list[int] = []
        inner_eval: Callable[[Sequence[int]], None] = self.llm.eval

        def counting_eval(tokens: Sequence[int]) -> None:
            self._evaluated.append(len(tokens))
            inner_eval(tokens)

        self.llm.eval = counting_eval  # type: ignore[method-assign]
        self.llm.create_completion(self.llm.tokenize(WARMUP_PROMPT.encode()), max_tokens=4, temperature=0.0)

    def _prompt_evaluated(self) -> int:
        """Prompt tokens the last request evaluated: its first eval call (decode steps come after)."""
        n = self._evaluated[0]
        self._evaluated.clear()
        return n

    def generate(self, prompts: list[list[int]], max_new_tokens: int) -> GenRun:
        texts, completion, evaluated = [], 0, 0
        t0 = time.perf_counter()
        for prompt in prompts:
            self._evaluated.clear()
            out = self.llm.create_completion(
                prompt, max_tokens=max_new_tokens, temperature=0.0, repeat_penalty=1.0
            )
            texts.append(out["choices"][0]["text"])
            completion += out["usage"]["completion_tokens"]
            evaluated += self._prompt_evaluated()
        wall = time.perf_counter() - t0
        total = sum(len(p) for p in prompts)
        return GenRun(None, texts, completion, wall, total, total - evaluated)

    def score(self, prompts: list[list[int]], choices: list[list[int]]) -> ScoreRun:
        if any(len(c) != 1 for c in choices):
            raise ValueError("the llama.cpp baseline scores single-token continuations only")
        choice_ids = [c[0] for c in choices]
        logprobs, evaluated = [], 0
        t0 = time.perf_counter()
        for prompt in prompts:
            self._evaluated.clear()
            # generate() evaluates the prompt (reusing the cached prefix) before it yields a token.
            tokens = self.llm.generate(prompt, temp=0.0, repeat_penalty=1.0)
            next(tokens)
            tokens.close()
            logits = self._last_logits().astype(np.float64)
            log_z = logits.max() + np.log(np.exp(logits - logits.max()).sum())
            logprobs.append([float(logits[c] - log_z) for c in choice_ids])
            evaluated += self._prompt_evaluated()
        wall = time.perf_counter() - t0
        total = sum(len(p) for p in prompts)
        return ScoreRun(logprobs, wall, total, total - evaluated)

    def close(self) -> None:
        self.llm.close()
