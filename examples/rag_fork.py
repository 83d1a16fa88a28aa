"""Retrieval-augmented generation with fork: retrieve passages, let one fork branch per passage
pull out what that passage says about the question (in parallel, sharing the question's KV), then
merge the notes into the final answer.

python examples/rag_fork.py [--url URL] [--question "..."]
"""

from __future__ import annotations

import argparse
import math
import re
from collections import Counter

import radixlm as sgl

CORPUS = [
    "The Eiffel Tower is a wrought-iron lattice tower in Paris, completed in 1889 for the World's Fair.",
    "Mount Everest, on the border of Nepal and China, is Earth's highest mountain above sea level.",
    "The Great Wall of China was built over centuries to protect Chinese states from northern raids.",
    "The Eiffel Tower is 330 metres tall and was the tallest man-made structure until 1930.",
    "Paris is the capital of France and is known for its museums, including the Louvre.",
    "The Amazon is the largest rainforest on Earth and spans nine countries in South America.",
]


def _words(text: str) -> list[str]:
    return re.findall(r"[a-z0-9]+", text.lower())


def retrieve(question: str, k: int = 3) -> list[str]:
    """TF-IDF overlap between the question and each passage: enough to rank a handful of passages."""
    docs = [Counter(_words(p)) for p in CORPUS]
    df = Counter(w for d in docs for w in d)
    query = set(_words(question))

    def score(doc: Counter) -> float:
        return sum(doc[w] * math.log(len(docs) / df[w]) for w in query if w in doc)

    ranked = sorted(range(len(CORPUS)), key=lambda i: score(docs[i]), reverse=True)
    return [CORPUS[i] for i in ranked[:k]]


@sgl.function
def rag(s, question, passages):
    s += "Use the passages to answer the question.\n"
    s += f"Question: {question}\n"
    forks = s.fork(len(passages))
    forks += lambda i: (
        f"Passage: {passages[i]}\nIn one sentence, this passage tells us that"
        + sgl.gen("note", max_tokens=32, stop="\n")
    )
    forks.join()
    for i, note in enumerate(s["note"]):
        s += f"Note {i + 1}:{note}\n"
    s += f"Question: {question}\nAnswer in one sentence: " + sgl.gen("answer", max_tokens=32, stop="\n")


def run(backend, question: str = "How tall is the Eiffel Tower?") -> dict:
    passages = retrieve(question)
    state = rag.run(question=question, passages=passages, backend=backend, temperature=0)
    return {"passages": passages, "notes": state["note"], "answer": state["answer"].strip()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", help="a running radixlm server; default: start one locally")
    parser.add_argument("--question", default="How tall is the Eiffel Tower?")
    args = parser.parse_args()
    backend = sgl.RuntimeEndpoint(args.url) if args.url else sgl.Runtime()
    try:
        result = run(backend, args.question)
        for passage, note in zip(result["passages"], result["notes"]):
            print(f"- {passage}\n  note:{note}")
        print("answer:", result["answer"])
    finally:
        backend.shutdown()


if __name__ == "__main__":
    main()
