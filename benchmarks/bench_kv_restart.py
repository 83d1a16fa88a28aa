"""KV restart: prefixes a server computed before a restart, served from its disk KV tier after it.

A server with --kv-disk-dir (write-through: every computed prefix is written there) answers a few
prompts, each a long document of its own (--prefix-tokens tokens of GSM8K questions in an order of
its own) and a question: a cold start, nothing cached. It is stopped, and a new server on the same
model and directory answers the same prompts: their prefixes come from disk (through the host tier)
instead of being recomputed. Per prompt: TTFT before and after the restart, the tokens cached, and
whether the generated tokens are the cold run's (greedy, computed without a cache). Target: TTFT
after the restart >= 5x lower for a 1,000-token prefix.

    python benchmarks/bench_kv_restart.py
    python benchmarks/bench_kv_restart.py --prefix-tokens 4000
    python benchmarks/bench_kv_restart.py --tiny
"""

from __future__ import annotations

import asyncio
import signal
import statistics
import sys
import tempfile
from dataclasses import replace
from pathlib import Path
from typing import Any

import httpx
from bench_serving import NATIVE, Outcome, Request, long_documents, send
from common import Size, Table, bench_parser, fmt, parse_sizes, pyplot, save_figure, save_result
from local_server import running_server

from radixlm_runtime.io.tokenizer import load_tokenizer
from radixlm_runtime.models.loader import resolve_model_path

NAME = "kv_restart"
SIZES = {
    "prefix_tokens": Size(1000, 200, "tokens of each prompt's document (its shared prefix)", scales=False),
    "prompts": Size(4, 2, "prompts, each with a document of its own"),
    "max_new_tokens": Size(16, 4, "tokens decoded per request", scales=False),
}
TARGET = 5.0


def documents(prompts: int, prefix_tokens: int) -> list[Request]:
    """Each prompt: a document of exactly prefix_tokens tokens of its own (bench_serving's long
    prompts), then a question about it, as token ids (so the prefix is exact)."""
    tokenizer = load_tokenizer(resolve_model_path(None))
    return [
        Request(
            "document",
            "",
            doc + tokenizer.encode(f"\n\nQuestion {i}: which is the hardest, and why?\nAnswer:"),
        )
        for i, doc in enumerate(long_documents(prompts, prefix_tokens))
    ]


async def serve(url: str, reqs: list[Request], max_new_tokens: int) -> list[tuple[Outcome, list[int]]]:
    """The requests one at a time (TTFT alone, nothing queued beside it), with the tokens each got."""
    results: list[tuple[Outcome, list[int]]] = []
    async with httpx.AsyncClient(timeout=None) as client:
        for req in reqs:
            tokens: list[int] = []

            def read(chunk: dict[str, Any], out: Outcome, tokens: list[int] = tokens) -> int:
                tokens[:] = chunk["output_ids"]
                return NATIVE.read(chunk, out)

            outcome = await send(client, url, replace(NATIVE, read=read), req, max_new_tokens)
            results.append((outcome, tokens))
    return results


def run_server(extra: list[str], log: Path, reqs: list[Request], max_new_tokens: int) -> dict[str, Any]:
    with running_server(extra, log) as url:
        asyncio.run(serve(url, [Request("warm", "Hello")], 2))
        results = asyncio.run(serve(url, reqs, max_new_tokens))
        info = httpx.get(f"{url}/server_info", timeout=30).json()
    return {
        "ttft_ms": [1000 * o.ttft for o, _ in results],
        "cached_tokens": [o.cached_tokens for o, _ in results],
        "prompt_tokens": [o.prompt_tokens for o, _ in results],
        "output_ids": [ids for _, ids in results],
        "disk_hit_tokens": info["disk_hit_tokens"],
        "disk_loaded_bytes": info["disk_loaded_bytes"],
        "disk_read_seconds": info["disk_read_seconds"],
        "disk_failed_tokens": info["disk_failed_tokens"],
    }


def plot(path: Path, cold: dict[str, Any], warm: dict[str, Any]) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6, 3.5))
    n = len(cold["ttft_ms"])
    xs = range(n)
    ax.bar([x - 0.2 for x in xs], cold["ttft_ms"], width=0.4, label="cold start (computed)")
    ax.bar([x + 0.2 for x in xs], warm["ttft_ms"], width=0.4, label="after restart (from disk)")
    ax.set_xticks(list(xs), [f"prompt {i}" for i in xs])
    ax.set_ylabel("TTFT ms")
    ax.legend(fontsize=8)
    fig.suptitle("A prefix seen before a restart: TTFT from the disk KV tier")
    save_figure(fig, path)


def main(argv: list[str] | None = None) -> None:
    ap = bench_parser(__doc__, SIZES)
    args, sizes = parse_sizes(ap, argv, SIZES)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # the `finally` that stops a server runs
    reqs = documents(sizes["prompts"], sizes["prefix_tokens"])
    longest = max(len(r.input_ids or ()) for r in reqs)
    with tempfile.TemporaryDirectory() as tmp:
        flags = ["--kv-host-tokens", str(2 * longest), "--kv-disk-dir", str(Path(tmp) / "kv")]
        cold = run_server(flags, Path(tmp) / "cold.log", reqs, sizes["max_new_tokens"])
        warm = run_server(flags, Path(tmp) / "restarted.log", reqs, sizes["max_new_tokens"])
    identical = [a == b for a, b in zip(cold["output_ids"], warm["output_ids"], strict=True)]
    speedup = statistics.median(cold["ttft_ms"]) / statistics.median(warm["ttft_ms"])
    rows = [
        [
            f"prompt {i}",
            str(cold["prompt_tokens"][i]),
            fmt(cold["ttft_ms"][i], ".0f"),
            fmt(warm["ttft_ms"][i], ".0f"),
            f"{cold['ttft_ms'][i] / warm['ttft_ms'][i]:.1f}x",
            str(warm["cached_tokens"][i]),
            "yes" if identical[i] else "NO",
        ]
        for i in range(len(reqs))
    ]
    table = Table(
        f"Restart: {len(reqs)} prompts with a {sizes['prefix_tokens']}-token document each, TTFT before "
        "(cold) and after a restart on the same --kv-disk-dir",
        ["prompt", "tokens", "TTFT cold ms", "TTFT restarted ms", "speedup", "cached after", "same tokens"],
        rows,
    )
    notes = [
        f"median TTFT {speedup:.1f}x lower after the restart (target {TARGET:.0f}x: "
        f"{'met' if speedup >= TARGET else 'not met'}); {warm['disk_hit_tokens']} prompt tokens from disk, "
        f"{warm['disk_loaded_bytes'] / 2**20:.1f} MiB read in {warm['disk_read_seconds']:.2f} s",
        f"generated tokens identical to the cold (uncached) run for {sum(identical)} of "
        f"{len(identical)} prompts",
    ]
    figure = f"{NAME}.png"
    args.out_dir.mkdir(parents=True, exist_ok=True)
    plot(args.out_dir / figure, cold, warm)
    save_result(
        args.out_dir,
        NAME,
        {"cold": cold, "restarted": warm, "identical": identical, "ttft_speedup": speedup},
        [table],
        notes,
        [figure],
        sizes,
    )


if __name__ == "__main__":
    main()
