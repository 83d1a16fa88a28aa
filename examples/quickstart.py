"""Runs the offline engine on the embedded default model (SmolLM2-135M-Instruct).

python examples/quickstart.py
"""

import time

import radixlm_runtime as rt

SYSTEM = (
    "You are a concise assistant for engineers who run language models in production. "
    "Answer every question in one short, factual sentence without lists or preamble."
)
QUESTIONS = ["What is a radix tree?", "Why reuse the KV cache across requests?", "What is greedy decoding?"]


def main() -> None:
    engine = rt.Engine()
    params = {"temperature": 0, "max_new_tokens": 40}

    out = engine.generate("The capital of France is", {**params, "max_new_tokens": 8})
    print("completion:", repr(out["text"]))

    # Chat prompts sharing one system prompt: the first request's prefill is reused by the others.
    prompts = [
        engine.tokenizer.apply_chat_template(
            [{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}],
            tokenize=False,
            add_generation_prompt=True,
        )
        for q in QUESTIONS
    ]
    t0 = time.perf_counter()
    outs = engine.generate(prompts, params)
    elapsed = time.perf_counter() - t0
    for q, o in zip(QUESTIONS, outs):
        meta = o["meta_info"]
        cached = f"{meta['cached_tokens']}/{meta['prompt_tokens']}"
        print(f"{q!r} -> {o['text'].strip()!r}  (prompt tokens from cache: {cached})")
    print(f"batch of {len(QUESTIONS)} in {elapsed:.2f}s")
    engine.shutdown()


if __name__ == "__main__":
    main()
