"""Speculative decoding by prompt lookup: decode speed with K draft tokens per step against K = 0.

Single stream, greedy, through the offline engine on the default model, for each K: a RAG prompt
(a document, then a request to quote from it: lookup finds the answer in the prompt) and a chat
prompt (an open question: lookup rarely hits), each run from an empty radix cache. Time to first
token and decode tokens/s after it come from `generate_stream`; the acceptance figures from the
requests' `meta_info` (spec_accept_length = output tokens per decode forward). Then a batch of
few-shot GSM8K questions (continuous batching: drafts of many requests share each forward) for
output tokens/s. Every run's tokens are compared with K = 0's: speculation must not change them.

    python benchmarks/bench_speculative.py                      # K = 0,2,4,6; 128 tokens per stream
    python benchmarks/bench_speculative.py --draft-tokens 0,4   # fewer settings
    python benchmarks/bench_speculative.py --tiny               # K = 0,2; a few tokens
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

from common import (
    REPO_ROOT,
    Size,
    Table,
    add_list_flag,
    bench_parser,
    fmt,
    list_flag,
    parse_sizes,
    pyplot,
    save_figure,
    save_result,
)
from workloads import gsm8k_task

NAME = "speculative"
SIZES = {
    "max_new_tokens": Size(128, 12, "tokens generated per single-stream prompt", scales=False),
    "gsm8k_questions": Size(16, 2, "few-shot GSM8K questions generated as one batch"),
    "gsm8k_new_tokens": Size(48, 4, "tokens generated per GSM8K question", scales=False),
    "num_shots": Size(5, 1, "solved examples in every GSM8K prompt's shared prefix", scales=False),
}
DEFAULT_DRAFT_TOKENS = "0,2,4,6"
TINY_DRAFT_TOKENS = "0,2"

DOCUMENT = """\
Release notes, version 2.4

Caching. The server now keeps the attention keys and values of every prompt in a radix tree keyed by
token ids. A request whose prompt starts with text the server has already seen, such as a system
prompt, a few-shot header or an earlier turn of the same conversation, reuses the stored entries and
only computes the new part. Entries that no running request needs are evicted, least recently used
first, when memory runs short.

Scheduling. Waiting requests are ordered by the length of their cached prefix, so that requests
sharing a prefix run while it is still in memory. Long prompts are split into chunks of at most 1024
tokens, which keeps the decoding requests moving while a long prompt is read.

Limits. Each request may ask for at most 128 samples. Stop strings are limited to 64 per request and
512 characters each. Requests beyond the queue limit receive an error asking them to retry later.
"""
PROMPTS = {
    "rag": (
        "<|im_start|>system\nYou answer questions about the document the user gives, quoting it "
        "where you can.<|im_end|>\n<|im_start|>user\n" + DOCUMENT + "\nQuote the paragraph about "
        "caching from the release notes above, word for word.<|im_end|>\n<|im_start|>assistant\n"
    ),
    "chat": (
        "<|im_start|>user\nWhat are three good habits for staying healthy? Explain each one in a "
        "few sentences.<|im_end|>\n<|im_start|>assistant\n"
    ),
}


def single_stream(engine: Any, prompt: str, max_new_tokens: int) -> dict[str, Any]:
    """One greedy request from an empty cache: TTFT, decode tokens/s after it, acceptance."""
    engine.flush_cache()
    params = {"temperature": 0, "max_new_tokens": max_new_tokens, "ignore_eos": True}
    t0 = time.perf_counter()
    first = last = None
    chunks: list[dict[str, Any]] = []
    for chunk in engine.generate_stream(prompt, params):
        last = time.perf_counter()
        first = first or last
        chunks[:] = [chunk]
    assert first is not None and last is not None
    out = chunks[0]
    meta = out["meta_info"]
    n = meta["completion_tokens"]
    return {
        "ttft_s": first - t0,
        "decode_tok_per_s": (n - 1) / (last - first) if last > first else None,
        "completion_tokens": n,
        "accept_length": meta.get("spec_accept_length", 1.0),
        "accept_rate": meta.get("spec_accept_rate"),
        "output_ids": out["output_ids"],
    }


def gsm8k_batch(engine: Any, prompts: list[list[int]], max_new_tokens: int) -> dict[str, Any]:
    engine.flush_cache()
    params = {"temperature": 0, "max_new_tokens": max_new_tokens}
    t0 = time.perf_counter()
    outs = engine.generate(input_ids=prompts, sampling_params=params)
    wall = time.perf_counter() - t0
    tokens = sum(o["meta_info"]["completion_tokens"] for o in outs)
    verify_steps = sum(o["meta_info"].get("spec_verify_ct", 0) for o in outs)
    return {
        "wall_s": wall,
        "completion_tokens": tokens,
        "output_tok_per_s": tokens / wall,
        "accept_length": tokens / verify_steps if verify_steps else 1.0,
        "output_ids": [o["output_ids"] for o in outs],
    }


def plot(path: Path, runs: dict[int, dict[str, Any]]) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6.5, 3.5))
    ks = sorted(runs)
    base = runs[ks[0]]
    series = {
        "RAG single stream": [
            runs[k]["rag"]["decode_tok_per_s"] / base["rag"]["decode_tok_per_s"] for k in ks
        ],
        "chat single stream": [
            runs[k]["chat"]["decode_tok_per_s"] / base["chat"]["decode_tok_per_s"] for k in ks
        ],
        "GSM8K batch": [runs[k]["gsm8k"]["output_tok_per_s"] / base["gsm8k"]["output_tok_per_s"] for k in ks],
    }
    width = 0.8 / len(series)
    for i, (label, values) in enumerate(series.items()):
        ax.bar([x + i * width for x in range(len(ks))], values, width, label=label)
    ax.axhline(1.0, color="grey", linewidth=0.8)
    ax.set_xticks([x + width for x in range(len(ks))], [f"K={k}" for k in ks])
    ax.set_ylabel(f"decode speed / K={ks[0]}")
    ax.set_title("Prompt-lookup speculative decoding")
    ax.legend(fontsize=8)
    save_figure(fig, path)


def main(argv: list[str] | None = None) -> None:
    ap = bench_parser(__doc__, SIZES)
    add_list_flag(ap, "--draft-tokens", "K values", DEFAULT_DRAFT_TOKENS, TINY_DRAFT_TOKENS)
    args, sizes = parse_sizes(ap, argv, SIZES)
    ks = list_flag(args, "--draft-tokens", int)
    if not ks or min(ks) < 0 or ks[0] != 0:
        ap.error("--draft-tokens takes K values >= 0, starting with the baseline 0")
    if str(REPO_ROOT) not in sys.path:
        sys.path.insert(0, str(REPO_ROOT))
    import radixlm_runtime as rt

    runs: dict[int, dict[str, Any]] = {}
    for k in ks:
        engine = rt.Engine(speculative_num_draft_tokens=k, log_level="warning")
        try:
            engine.generate(PROMPTS["chat"], {"max_new_tokens": 4})  # warm-up
            task = gsm8k_task(engine.tokenizer, sizes["gsm8k_questions"], sizes["num_shots"])
            runs[k] = {name: single_stream(engine, p, sizes["max_new_tokens"]) for name, p in PROMPTS.items()}
            runs[k]["gsm8k"] = gsm8k_batch(engine, task.prompts, sizes["gsm8k_new_tokens"])
        finally:
            engine.shutdown()
        for name in (*PROMPTS, "gsm8k"):
            runs[k][name]["same_tokens_as_k0"] = runs[k][name]["output_ids"] == runs[0][name]["output_ids"]
        r = runs[k]
        print(
            f"K={k}: rag {r['rag']['decode_tok_per_s']:.1f} tok/s (accept length "
            f"{r['rag']['accept_length']:.2f}), chat {r['chat']['decode_tok_per_s']:.1f} tok/s, "
            f"gsm8k batch {r['gsm8k']['output_tok_per_s']:.1f} tok/s",
            flush=True,
        )
    base = runs[0]

    def speed(k: int, name: str, key: str) -> str:
        return f"{fmt(runs[k][name][key], '.1f')} ({runs[k][name][key] / base[name][key]:.2f}x)"

    table = Table(
        "Greedy decode speed by draft tokens K (ratios to K = 0)",
        [
            "K",
            "RAG decode tok/s",
            "RAG accept length",
            "RAG TTFT s",
            "chat decode tok/s",
            "chat accept length",
            "GSM8K batch tok/s",
            "GSM8K accept length",
            "same tokens as K=0",
        ],
        [
            [
                str(k),
                speed(k, "rag", "decode_tok_per_s"),
                fmt(runs[k]["rag"]["accept_length"]),
                fmt(runs[k]["rag"]["ttft_s"], ".3f"),
                speed(k, "chat", "decode_tok_per_s"),
                fmt(runs[k]["chat"]["accept_length"]),
                speed(k, "gsm8k", "output_tok_per_s"),
                fmt(runs[k]["gsm8k"]["accept_length"]),
                "yes" if all(runs[k][n]["same_tokens_as_k0"] for n in (*PROMPTS, "gsm8k")) else "NO",
            ]
            for k in ks
        ],
    )
    best = max(ks, key=lambda k: runs[k]["rag"]["decode_tok_per_s"])

    def ratio(name: str, key: str) -> float:
        return runs[best][name][key] / base[name][key]

    notes = [
        f"RAG: K={best} decodes {ratio('rag', 'decode_tok_per_s'):.2f}x as fast as K=0 "
        f"({runs[best]['rag']['accept_length']:.2f} tokens per forward); chat at that K: "
        f"{ratio('chat', 'decode_tok_per_s'):.2f}x; GSM8K batch: {ratio('gsm8k', 'output_tok_per_s'):.2f}x"
    ]
    figure = f"{NAME}.png"
    plot(args.out_dir / figure, runs)
    save_result(
        args.out_dir,
        NAME,
        {"draft_tokens": ks, "runs": {str(k): r for k, r in runs.items()}},
        [table],
        notes,
        [figure],
        sizes,
    )


if __name__ == "__main__":
    main()
