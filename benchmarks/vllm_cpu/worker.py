"""Runs vLLM's CPU build for the benchmarks, inside vLLM's own virtual environment.

The benchmark process (radixlm's environment) starts this script with that environment's Python and
talks to it in JSON lines: one command per line on stdin, one answer per line on the original stdout.
Everything vLLM prints goes to stderr, so the answer channel stays clean. Token ids in, token ids out:
both engines see exactly the same prompts.

Commands:
    {"op": "generate", "prompts": [[ids]], "max_new_tokens": n, "ignore_eos": false}
        -> {"output_ids": [[ids]], "texts": [...], "wall_s": s, "prompt_tokens": n, "cached_tokens": n}
    {"op": "score", "prompts": [[ids]], "choices": [[ids]]}
        -> {"logprobs": [[lp per choice]], "wall_s": s, "prompt_tokens": n, "cached_tokens": n}
    {"op": "reset"} -> {"ok": true}   (empties the prefix cache)
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any


def _answer_channel() -> Any:
    """The original stdout for answers; fd 1 then points at stderr for whatever vLLM prints."""
    out = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--no-prefix-cache", action="store_true")
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--dtype", default="float32", help="float32, or bfloat16 (AVX512-BF16 CPUs)")
    args = parser.parse_args()
    answers = _answer_channel()

    from vllm import LLM, SamplingParams, TokensPrompt

    t0 = time.perf_counter()
    llm = LLM(
        model=args.model,
        dtype=args.dtype,
        enable_prefix_caching=not args.no_prefix_cache,
        max_model_len=args.max_model_len,
        seed=0,
    )
    answers.write(json.dumps({"ready": True, "startup_s": time.perf_counter() - t0}) + "\n")

    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["op"] == "reset":
            llm.reset_prefix_cache()
            answers.write(json.dumps({"ok": True}) + "\n")
            continue
        if cmd["op"] == "generate":
            params = SamplingParams(
                temperature=0.0, max_tokens=cmd["max_new_tokens"], ignore_eos=cmd.get("ignore_eos", False)
            )
            prompts = [TokensPrompt(prompt_token_ids=p) for p in cmd["prompts"]]
            start = time.perf_counter()
            outs = llm.generate(prompts, params, use_tqdm=False)
            wall = time.perf_counter() - start
            answer: dict[str, Any] = {
                "output_ids": [list(o.outputs[0].token_ids) for o in outs],
                "texts": [o.outputs[0].text for o in outs],
            }
        elif cmd["op"] == "score":
            # A choice is scored as its own request (prompt + continuation) from the continuation's
            # prompt logprobs, as radixlm's benchmark system does.
            params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0)
            prompts = [TokensPrompt(prompt_token_ids=p + c) for p in cmd["prompts"] for c in cmd["choices"]]
            start = time.perf_counter()
            outs = llm.generate(prompts, params, use_tqdm=False)
            wall = time.perf_counter() - start
            lps = []
            for o in outs:
                n = len(o.prompt_token_ids)
                k = n - len(cmd["choices"][len(lps) % len(cmd["choices"])])
                lps.append(sum(o.prompt_logprobs[i][o.prompt_token_ids[i]].logprob for i in range(k, n)))
            width = len(cmd["choices"])
            answer = {"logprobs": [lps[i : i + width] for i in range(0, len(lps), width)]}
        else:
            raise ValueError(f"unknown op {cmd['op']!r}")
        answer["wall_s"] = wall
        answer["prompt_tokens"] = sum(len(o.prompt_token_ids) for o in outs)
        answer["cached_tokens"] = sum(o.num_cached_tokens or 0 for o in outs)
        answers.write(json.dumps(answer) + "\n")


if __name__ == "__main__":
    main()
