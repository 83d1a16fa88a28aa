"""Few-shot question answering: one shared prefix of worked examples, many questions.

python examples/few_shot_qa.py [--url http://127.0.0.1:30000]   (no --url: starts a local server)
"""

from __future__ import annotations

import argparse

import radixlm as sgl

EXAMPLES = [
    ("What is the capital of France?", "Paris"),
    ("What is the capital of Germany?", "Berlin"),
    ("What is the capital of Italy?", "Rome"),
    ("What is the capital of Japan?", "Tokyo"),
]
QUESTIONS = [
    "What is the capital of Spain?",
    "What is the capital of Egypt?",
    "What is the capital of Canada?",
    "What is the capital of Russia?",
]


@sgl.function
def few_shot_qa(s, question):
    s += "Answer each question with one word.\n\n"
    for q, a in EXAMPLES:
        s += f"Q: {q}\nA: {a}\n"
    s += f"Q: {question}\nA:" + sgl.gen("answer", max_tokens=8, stop="\n")


def run(backend) -> list[dict]:
    states = few_shot_qa.run_batch([{"question": q} for q in QUESTIONS], backend=backend, temperature=0)
    return [
        {
            "question": q,
            "answer": s["answer"].strip(),
            "cached_tokens": s.get_meta_info("answer")["cached_tokens"],
            "prompt_tokens": s.get_meta_info("answer")["prompt_tokens"],
        }
        for q, s in zip(QUESTIONS, states)
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", help="a running radixlm server; default: start one locally")
    args = parser.parse_args()
    backend = sgl.RuntimeEndpoint(args.url) if args.url else sgl.Runtime()
    try:
        for row in run(backend):
            cached = f"{row['cached_tokens']}/{row['prompt_tokens']}"
            print(f"{row['question']} -> {row['answer']}  (prompt tokens from cache: {cached})")
    finally:
        backend.shutdown()


if __name__ == "__main__":
    main()
