"""Batch evaluation: 5-shot GSM8K written as a radixlm program, run over many questions at once with
run_batch (the few-shot prefix is prefilled once and shared). `python -m radixlm.eval` is the full
CLI; this is the same thing in a few lines.

python examples/batch_eval.py [--url URL] [--num-questions 16]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import radixlm as sgl
from radixlm.eval.cli import evaluate, gsm8k_items


def run(backend, num_questions: int = 16, output: Path | None = None) -> dict:
    settings = argparse.Namespace(num_shots=5, num_questions=num_questions, max_new_tokens=192, data_dir=None)
    result = evaluate("gsm8k", gsm8k_items(settings), backend, parallel=64)
    if output is not None:
        output.write_text(json.dumps(result, indent=2))
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", help="a running radixlm server; default: start one locally")
    parser.add_argument("--num-questions", type=int, default=16)
    args = parser.parse_args()
    backend = sgl.RuntimeEndpoint(args.url) if args.url else sgl.Runtime()
    try:
        result = run(backend, args.num_questions)
    finally:
        backend.shutdown()
    print(
        f"GSM8K 5-shot: accuracy {result['accuracy']:.3f} over {result['num_questions']} questions, "
        f"{result['questions_per_s']:.2f} questions/s, cache hit rate {result['cache_hit_rate']:.2f}"
    )


if __name__ == "__main__":
    main()
