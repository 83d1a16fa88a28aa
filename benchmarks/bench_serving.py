"""Serving: an async client drives the real HTTP server with Poisson arrivals over a prefix-sharing
workload, sweeping the request rate.

The workload interleaves few-shot GSM8K questions (one 5-shot prefix shared by all) with multi-turn
chats (one system prompt shared by all; each turn extends its conversation's history). Requests
stream from the native /generate (greedy, ignore_eos, so every request decodes the same number of
tokens). Per rate: achieved request and output-token throughput, time to first token (TTFT) and
inter-token latency (ITL) percentiles, and the share of prompt tokens served from the radix cache
(from each response's meta_info). The baseline is the same server with --disable-radix-cache, given the
same requests at the same arrival times; the cache is flushed before every rate.

    python benchmarks/bench_serving.py                  # rates 0.5, 1, 2, 4 req/s, 24 requests each
    python benchmarks/bench_serving.py --tiny
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import signal
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from common import (
    Size,
    Table,
    add_list_flag,
    bench_parser,
    fmt,
    list_flag,
    parse_sizes,
    percentiles,
    pyplot,
    save_figure,
    save_result,
)
from local_server import flush, running_server
from workloads import chat_prompts, gsm8k_prompts

from radixlm_runtime.io.tokenizer import load_tokenizer
from radixlm_runtime.models.loader import resolve_model_path

NAME = "serving"
SIZES = {
    "num_requests": Size(24, 4, "requests per rate"),
    "max_new_tokens": Size(24, 4, "tokens decoded per request", scales=False),
    "chat_turns": Size(3, 2, "turns per chat conversation", scales=False),
    "num_shots": Size(5, 1, "solved examples in the few-shot requests' shared prefix", scales=False),
}
DEFAULT_RATES = "0.5,1,2,4"
TINY_RATES = "4"
SERVERS = {"radixlm": [], "radixlm_no_cache": ["--disable-radix-cache"]}
LABELS = {"radixlm": "radixlm", "radixlm_no_cache": "radixlm, radix cache disabled"}


@dataclass
class Request:
    kind: str  # "fewshot" or "chat"
    text: str


@dataclass
class Outcome:
    kind: str
    start: float
    end: float
    ttft: float
    itls: list[float] = field(default_factory=list)
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0


def build_requests(num_requests: int, turns: int, num_shots: int) -> list[Request]:
    """Alternates few-shot and chat requests; chats go turn by turn across conversations, so a turn is
    sent after the earlier turns of its conversation."""
    num_fewshot = math.ceil(num_requests / 2)
    num_chat = num_requests - num_fewshot
    fewshot = [Request("fewshot", t) for t in gsm8k_prompts(num_fewshot, num_shots)[0]]
    convs = chat_prompts(load_tokenizer(resolve_model_path(None)), max(1, math.ceil(num_chat / turns)), turns)
    chat = [Request("chat", conv[t]) for t in range(turns) for conv in convs][:num_chat]
    mixed = [r for pair in zip(fewshot, chat) for r in pair]
    return mixed + fewshot[len(chat) :]


def poisson_arrivals(n: int, rate: float, seed: int) -> list[float]:
    rng = random.Random(seed)
    t, out = 0.0, []
    for _ in range(n):
        out.append(t)
        t += rng.expovariate(rate)
    return out


async def send(client: httpx.AsyncClient, url: str, req: Request, max_new_tokens: int) -> Outcome:
    """One streamed request; ITL is per token (a chunk carrying k new tokens counts its gap / k, k times)."""
    body = {
        "text": req.text,
        "sampling_params": {"temperature": 0, "max_new_tokens": max_new_tokens, "ignore_eos": True},
        "stream": True,
    }
    start = time.perf_counter()
    first: float | None = None
    last = start
    seen = 0
    out = Outcome(req.kind, start, start, 0.0)
    async with client.stream("POST", f"{url}/generate", json=body) as resp:
        if resp.status_code != 200:
            raise RuntimeError(f"/generate answered {resp.status_code}: {(await resp.aread())[:500]!r}")
        async for line in resp.aiter_lines():
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[len("data:") :])
            if "error" in chunk:
                raise RuntimeError(f"/generate streamed an error: {chunk}")
            now = time.perf_counter()
            new = len(chunk["output_ids"]) - seen
            if new > 0:
                if first is None:
                    first = now
                else:
                    out.itls.extend([(now - last) / new] * new)
                seen += new
                last = now
            meta = chunk["meta_info"]
            out.prompt_tokens, out.cached_tokens = meta["prompt_tokens"], meta["cached_tokens"]
            out.completion_tokens = meta["completion_tokens"]
    if first is None:
        raise RuntimeError("the stream ended without a token")
    out.ttft, out.end = first - start, time.perf_counter()
    return out


async def run_rate(
    url: str, reqs: list[Request], arrivals: list[float], max_new_tokens: int
) -> list[Outcome]:
    async with httpx.AsyncClient(timeout=None, limits=httpx.Limits(max_connections=None)) as client:
        t0 = time.perf_counter()

        async def at(req: Request, offset: float) -> Outcome:
            await asyncio.sleep(max(0.0, t0 + offset - time.perf_counter()))
            return await send(client, url, req, max_new_tokens)

        return await asyncio.gather(*(at(r, a) for r, a in zip(reqs, arrivals)))


def summarize(rate: float, outs: list[Outcome]) -> dict[str, Any]:
    duration = max(o.end for o in outs) - min(o.start for o in outs)
    completion = sum(o.completion_tokens for o in outs)
    ms = lambda values: {k: None if v is None else 1000 * v for k, v in percentiles(values).items()}

    def hit(kind: str | None) -> float:
        sel = [o for o in outs if kind is None or o.kind == kind]
        return sum(o.cached_tokens for o in sel) / sum(o.prompt_tokens for o in sel)

    return {
        "rate": rate,
        "num_requests": len(outs),
        "duration_s": duration,
        "request_throughput": len(outs) / duration,
        "output_tok_per_s": completion / duration,
        "ttft_ms": ms([o.ttft for o in outs]),
        "itl_ms": ms([x for o in outs for x in o.itls]),
        "e2e_ms": ms([o.end - o.start for o in outs]),
        "cache_hit_rate": hit(None),
        "cache_hit_rate_by_kind": {k: hit(k) for k in sorted({o.kind for o in outs})},
        "prompt_tokens": sum(o.prompt_tokens for o in outs),
        "completion_tokens": completion,
    }


def plot(path: Path, results: dict[str, list[dict[str, Any]]]) -> None:
    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for i, (server, points) in enumerate(results.items()):
        x = [p["request_throughput"] for p in points]
        for ax, key in zip(axes, ("ttft_ms", "itl_ms")):
            for q, style in (("p50", "-o"), ("p90", "--s")):
                ax.plot(
                    x,
                    [p[key][q] for p in points],
                    style,
                    color=f"C{i}",
                    label=f"{LABELS[server]} {q.upper()}",
                )
    for ax, title in zip(axes, ("time to first token", "inter-token latency")):
        ax.set_xlabel("achieved throughput (requests / s)")
        ax.set_ylabel(f"{title} (ms, log scale)")
        ax.set_yscale("log")
        ax.set_title(title)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    save_figure(fig, path)


def table(results: dict[str, list[dict[str, Any]]]) -> Table:
    headers = ["server", "offered req/s", "achieved req/s", "output tok/s"]
    headers += [f"TTFT {q} ms" for q in ("P50", "P90", "P99")] + [
        f"ITL {q} ms" for q in ("P50", "P90", "P99")
    ]
    headers.append("prompt tokens from cache")
    rows = []
    for server, points in results.items():
        for p in points:
            row = [
                LABELS[server],
                fmt(p["rate"], "g"),
                fmt(p["request_throughput"], ".2f"),
                fmt(p["output_tok_per_s"], ".1f"),
            ]
            row += [fmt(p["ttft_ms"][q], ".0f") for q in ("p50", "p90", "p99")]
            row += [fmt(p["itl_ms"][q], ".0f") for q in ("p50", "p90", "p99")]
            row.append(fmt(100 * p["cache_hit_rate"], ".1f", "%"))
            rows.append(row)
    return Table("Serving, Poisson arrivals, few-shot GSM8K + multi-turn chat", headers, rows)


def notes_for(results: dict[str, list[dict[str, Any]]]) -> list[str]:
    if "radixlm_no_cache" not in results:
        return []
    notes = []
    for on, off in zip(results["radixlm"], results["radixlm_no_cache"]):
        ttft_on, ttft_off = on["ttft_ms"]["p50"], off["ttft_ms"]["p50"]
        rps_on, rps_off = on["request_throughput"], off["request_throughput"]
        notes.append(
            f"at {on['rate']:g} req/s offered: TTFT P50 {ttft_on:.0f} ms vs {ttft_off:.0f} ms without the "
            f"radix cache (**{ttft_off / ttft_on:.1f}x** lower); achieved {rps_on:.2f} vs {rps_off:.2f} "
            f"req/s ({rps_on / rps_off:.2f}x)"
        )
    return notes


def main(argv: list[str] | None = None) -> None:
    ap = bench_parser(__doc__, SIZES)
    add_list_flag(ap, "--rates", "request rates", DEFAULT_RATES, TINY_RATES)
    ap.add_argument("--no-baseline", action="store_true", help="Skip the --disable-radix-cache server.")
    ap.add_argument("--seed", type=int, default=0, help="Seed of the arrival times.")
    args, sizes = parse_sizes(ap, argv, SIZES)
    # A SIGTERM must still run the `finally` that stops the server.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    rates = list_flag(args, "--rates", float)

    reqs = build_requests(sizes["num_requests"], sizes["chat_turns"], sizes["num_shots"])
    servers = {k: v for k, v in SERVERS.items() if not (args.no_baseline and k != "radixlm")}
    results: dict[str, list[dict[str, Any]]] = {}
    with tempfile.TemporaryDirectory() as logs:
        for server, extra in servers.items():
            with running_server(extra, Path(logs) / f"{server}.log") as url:
                asyncio.run(run_rate(url, reqs[:1], [0.0], 2))  # warm-up
                results[server] = []
                for rate in rates:
                    flush(url)
                    outs = asyncio.run(
                        run_rate(
                            url, reqs, poisson_arrivals(len(reqs), rate, args.seed), sizes["max_new_tokens"]
                        )
                    )
                    point = summarize(rate, outs)
                    results[server].append(point)
                    print(
                        f"{server} @ {rate:g} req/s: {point['request_throughput']:.2f} req/s, TTFT P50 "
                        f"{point['ttft_ms']['p50']:.0f} ms, hit {point['cache_hit_rate']:.2f}"
                    )
    figure = f"{NAME}.png"
    args.out_dir.mkdir(parents=True, exist_ok=True)
    plot(args.out_dir / figure, results)
    save_result(
        args.out_dir,
        NAME,
        {
            "rates": rates,
            "workload": {
                "fewshot_requests": sum(r.kind == "fewshot" for r in reqs),
                "chat_requests": sum(r.kind == "chat" for r in reqs),
                "chat_turns": sizes["chat_turns"],
            },
            "servers": results,
        },
        tables=[table(results)],
        notes=notes_for(results),
        figures=[figure],
        sizes=sizes,
    )


if __name__ == "__main__":
    main()
