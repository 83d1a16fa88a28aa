"""The main job on the embedded default model (SmolLM2-135M-Instruct): start a local radixlm server,
run a radixlm program over a batch of questions sharing a system prompt, and show the same server
answering a plain HTTP request.

python examples/quickstart.py
"""

from __future__ import annotations

import time

import httpx

import radixlm as sgl

SYSTEM = (
    "You are a concise assistant for engineers who run language models in production. "
    "Answer every question in one short, factual sentence without lists or preamble."
)
QUESTIONS = ["What is a radix tree?", "Why reuse the KV cache across requests?", "What is greedy decoding?"]


@sgl.function
def assistant(s, question):
    s += sgl.system(SYSTEM)
    s += sgl.user(question)
    s += sgl.assistant(sgl.gen("answer", max_tokens=40))


def main() -> None:
    print("starting a radixlm server on the embedded default model ...")
    with sgl.Runtime() as runtime:
        print(f"server ready at {runtime.url}")
        t0 = time.perf_counter()
        states = assistant.run_batch([{"question": q} for q in QUESTIONS], backend=runtime, temperature=0)
        elapsed = time.perf_counter() - t0
        for q, state in zip(QUESTIONS, states):
            meta = state.get_meta_info("answer")
            cached = f"{meta['cached_tokens']}/{meta['prompt_tokens']}"
            print(f"{q!r} -> {state['answer'].strip()!r}  (prompt tokens from cache: {cached})")
        print(f"{len(QUESTIONS)} programs in {elapsed:.2f}s; the shared system prompt was prefilled once")

        params = {"temperature": 0, "max_new_tokens": 8}
        body = {"text": "The capital of France is", "sampling_params": params}
        print(f"\nPOST {runtime.url}/generate {body}")
        reply = httpx.post(f"{runtime.url}/generate", json=body, timeout=120).json()
        print(f"-> {reply['text']!r} {reply['meta_info']['finish_reason']}")


if __name__ == "__main__":
    main()
