"""Runs the offline engine on the embedded default model (SmolLM2-135M-Instruct).

python examples/quickstart.py
"""

import time

import radixlm_runtime as rt


def main() -> None:
    engine = rt.Engine()
    params = {"temperature": 0, "max_new_tokens": 48}

    out = engine.generate("The capital of France is", params)
    print("single:", repr(out["text"]))

    prefix = "You are a concise assistant. Answer in one short sentence.\n\n"
    questions = ["What is a radix tree?", "Why cache KV across requests?", "What is greedy decoding?"]
    t0 = time.perf_counter()
    outs = engine.generate([f"{prefix}Q: {q}\nA:" for q in questions], {**params, "stop": "\n"})
    elapsed = time.perf_counter() - t0
    for q, o in zip(questions, outs):
        meta = o["meta_info"]
        cached = f"{meta['cached_tokens']}/{meta['prompt_tokens']}"
        print(f"{q!r} -> {o['text'].strip()!r}  (cached {cached} prompt tokens)")
    print(f"batch of {len(questions)} in {elapsed:.2f}s; server info: {engine.get_server_info()}")
    engine.shutdown()


if __name__ == "__main__":
    main()
