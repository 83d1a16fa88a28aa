"""Data parallelism: two radixlm replicas behind the router, under each --router-policy.

The workload is bench_kv_tiers.py's multi-tenant one (each tenant its own few-shot prefix and chats,
requests round the tenants), and each replica's KV pool holds about half of the tenants' prefixes
(beside the requests in flight), so where a tenant's requests land decides whether its prefix is
still cached there. The same requests,
in the same order, from --concurrency clients in a closed loop, go through the router under
`round_robin`, `least_load` and `cache_aware`, both replicas' caches flushed before each. Per policy:
throughput, TTFT P50/P99 and the cache hit rate (prompt tokens served from the replicas' radix caches,
from their /server_info counters). Each replica runs on --replica-threads threads.

    python benchmarks/bench_router.py
    python benchmarks/bench_router.py --tiny
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
from bench_kv_tiers import SIZES as KV_TIERS_SIZES
from bench_kv_tiers import closed_loop, tenant_requests
from bench_serving import Request
from common import Size, Table, bench_parser, fmt, parse_sizes, percentiles, pyplot, save_figure, save_result
from local_server import running_router, running_server

from radixlm_runtime.config import ROUTER_POLICIES
from radixlm_runtime.io.tokenizer import load_tokenizer
from radixlm_runtime.models.loader import resolve_model_path

NAME = "router"
# bench_kv_tiers.py's workload, with fewer tenants: two pools hold about half of them.
SIZES = KV_TIERS_SIZES | {
    "tenants": Size(8, 4, "tenants, each with its own few-shot prefix and chat system prompt"),
}
REPLICAS = 2


def cached_tokens(urls: list[str]) -> int:
    return sum(httpx.get(f"{u}/server_info", timeout=30).json()["cached_tokens"] for u in urls)


def plot(path: Path, results: dict[str, dict[str, Any]]) -> None:
    plt = pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(10, 3.2))
    names = list(results)
    for ax, (key, label) in zip(
        axes,
        (
            ("hit_rate", "cache hit rate"),
            ("request_throughput", "requests/s"),
            ("ttft_p50_ms", "TTFT P50 ms"),
        ),
    ):
        ax.bar(names, [results[n][key] for n in names])
        ax.set_title(label, fontsize=9)
        ax.tick_params(axis="x", labelsize=8)
    fig.suptitle(f"{REPLICAS} replicas behind the router, by policy")
    save_figure(fig, path)


def main(argv: list[str] | None = None) -> None:
    ap = bench_parser(__doc__, SIZES)
    ap.add_argument("--replica-threads", type=int, default=1, help="torch threads of each replica.")
    args, sizes = parse_sizes(ap, argv, SIZES)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # the `finally` that stops servers runs
    tokenizer = load_tokenizer(resolve_model_path(None))
    reqs = tenant_requests(tokenizer, sizes["tenants"], sizes["rounds"], sizes["num_shots"])
    prefix_tokens = sum(len(tokenizer.encode(r.text)) for r in reqs[: sizes["tenants"]])
    longest = max(len(tokenizer.encode(r.text)) for r in reqs)
    # Half the tenants' prefixes, cached, beside the requests in flight (all of them may land on one
    # replica): without that room the running requests' KV evicts what the router placed there.
    pool = prefix_tokens // 2 + sizes["concurrency"] * (longest + sizes["max_new_tokens"])
    replica_flags = ["--max-total-tokens", str(pool), "--num-threads", str(args.replica_threads)]
    print(
        f"{len(reqs)} requests, first-round prompts {prefix_tokens} tokens, KV pool {pool} tokens per replica"
    )
    results: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory() as logs, contextlib.ExitStack() as stack:
        urls = [
            stack.enter_context(running_server(replica_flags, Path(logs) / f"replica{i}.log"))
            for i in range(REPLICAS)
        ]
        for policy in ROUTER_POLICIES:
            with running_router(
                urls, ["--router-policy", policy], Path(logs) / f"router-{policy}.log"
            ) as url:
                asyncio.run(closed_loop(url, [Request("warm", "Hello")], 1, 2))
                httpx.post(f"{url}/flush_cache", timeout=60).raise_for_status()
                before = cached_tokens(urls)
                t0 = time.perf_counter()
                outs = asyncio.run(closed_loop(url, reqs, sizes["concurrency"], sizes["max_new_tokens"]))
                wall = time.perf_counter() - t0
                prompt = sum(o.prompt_tokens for o in outs)
                ttft = percentiles([o.ttft for o in outs])
                results[policy] = {
                    "requests": len(outs),
                    "wall_s": wall,
                    "request_throughput": len(outs) / wall,
                    "ttft_p50_ms": 1000 * (ttft["p50"] or 0.0),
                    "ttft_p99_ms": 1000 * (ttft["p99"] or 0.0),
                    "prompt_tokens": prompt,
                    "hit_rate": (cached_tokens(urls) - before) / prompt,
                    "routed": [
                        r["routed"] for r in httpx.get(f"{url}/server_info", timeout=30).json()["replicas"]
                    ],
                }
                r = results[policy]
                print(
                    f"{policy}: hit {r['hit_rate']:.0%}, {r['request_throughput']:.2f} req/s, "
                    f"TTFT P50 {r['ttft_p50_ms']:.0f} ms"
                )
    table = Table(
        f"{REPLICAS} replicas (KV pool {pool} tokens each: half the tenants' prefixes beside the requests "
        "in flight), "
        f"{sizes['tenants']} tenants x {sizes['rounds']} requests, concurrency {sizes['concurrency']}",
        ["policy", "cache hit rate", "req/s", "TTFT P50 ms", "TTFT P99 ms", "requests per replica"],
        [
            [
                p,
                f"{r['hit_rate']:.0%}",
                fmt(r["request_throughput"]),
                fmt(r["ttft_p50_ms"], ".0f"),
                fmt(r["ttft_p99_ms"], ".0f"),
                " / ".join(map(str, r["routed"])),
            ]
            for p, r in results.items()
        ],
    )
    rr, ca = results["round_robin"], results["cache_aware"]
    notes = [
        f"cache_aware against round_robin: hit rate {ca['hit_rate'] / max(rr['hit_rate'], 1e-9):.2f}x, "
        f"throughput {ca['request_throughput'] / rr['request_throughput']:.2f}x (targets: 1.5x and 1.3x)"
    ]
    figure = f"{NAME}.png"
    args.out_dir.mkdir(parents=True, exist_ok=True)
    plot(args.out_dir / figure, results)
    save_result(
        args.out_dir, NAME, {"pool_tokens": pool, "policies": results}, [table], notes, [figure], sizes
    )


if __name__ == "__main__":
    main()
