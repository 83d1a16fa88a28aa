"""What an open dashboard costs the server: the serving benchmark's workload (bench_serving.py's
few-shot and multi-turn chat requests, streamed from /generate at a saturating Poisson rate) run
side by side on one server with and without a client that polls the dashboard's feeds as an open
page would, in alternating rounds (off, on, on, off, ...) so drift in a shared machine's load falls on
both. The poller is harsher than the page: the page refreshes only the view in sight, this one asks
for the tree (up to --tree-nodes nodes), the requests, the programs and the metrics every
--poll-interval seconds.

    python benchmarks/bench_dashboard.py                 # 4 rounds of 24 requests per mode
    python benchmarks/bench_dashboard.py --tiny
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import statistics
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
from bench_serving import NATIVE, build_requests, poisson_arrivals, run_rate, summarize
from common import Size, Table, bench_parser, fmt, parse_sizes, save_result
from local_server import flush, running_server

from radixlm_runtime.io.messages import CallResult, DashboardReq, encode
from radixlm_runtime.kvcache.allocator import TokenAllocator
from radixlm_runtime.kvcache.radix_cache import RadixCache
from radixlm_runtime.server import dashboard_snapshot

NAME = "dashboard"
SIZES = {
    "num_requests": Size(16, 6, "requests per round and mode"),
    "rounds": Size(4, 2, "rounds; each runs both modes", scales=False),
    "max_new_tokens": Size(16, 4, "tokens decoded per request", scales=False),
    "num_shots": Size(1, 1, "solved examples in the few-shot requests' shared prefix", scales=False),
}
RATE = 8.0  # requests/s: above what the default model serves on a CPU, so throughput is the limit
FEEDS = ("tree?max_nodes={nodes}", "requests?max_recent=200", "programs", "metrics?since={since}")


async def poll_feeds(url: str, interval_s: float, nodes: int, stats: dict[str, float]) -> None:
    """Fetches every feed each interval until cancelled, as an open page (keeping up with metrics)."""
    since = 0.0
    async with httpx.AsyncClient(timeout=None) as client:
        while True:
            t0 = time.perf_counter()
            for feed in FEEDS:
                r = await client.get(f"{url}/dashboard/api/{feed.format(nodes=nodes, since=since)}")
                r.raise_for_status()
                stats["responses"] += 1
                stats["bytes"] += len(r.content)
                if feed.startswith("metrics") and (samples := r.json()["samples"]):
                    since = samples[-1]["t"]
            stats["seconds"] += time.perf_counter() - t0
            await asyncio.sleep(max(0.0, interval_s - (time.perf_counter() - t0)))


def snapshot_ms(num_nodes: int, repeats: int = 5) -> float:
    """Scheduler time (ms, median) to build and encode a tree snapshot of num_nodes nodes (100 shared
    prefixes with num_nodes / 100 branches each): what the scheduler loop spends per tree poll
    instead of stepping, measured here in-process on a tree built for it."""
    rng = random.Random(0)
    tree = RadixCache(TokenAllocator(num_nodes * 120))
    per = max(num_nodes // 100 - 1, 1)
    for a in range(100):
        shared = [a] + [rng.randrange(1000, 40000) for _ in range(40)]
        for b in range(per):
            key = shared + [b] + [rng.randrange(1000, 40000) for _ in range(60)]
            tree.insert(key, tree.allocator.alloc(len(key)))
    # The snapshot reads only these of the scheduler: its tree, sessions, pool and tier sizes and
    # constraints.
    sessions = SimpleNamespace(pinned_ids=frozenset)
    sizes = SimpleNamespace(max_total_tokens=tree.allocator.size, host_kv_tokens=0, disk_kv_tokens=0)
    scheduler = SimpleNamespace(
        cache=SimpleNamespace(tree=tree, sessions=sessions),
        runner_info=sizes,
        constraints=[],
    )
    log = dashboard_snapshot.RequestLog()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        snap = dashboard_snapshot.answer(scheduler, log, DashboardReq(0, "tree", max_nodes=num_nodes))  # type: ignore[arg-type]
        encode(CallResult(0, True, snap))
        times.append(1000 * (time.perf_counter() - t0))
    return statistics.median(times)


async def one_round(url: str, reqs: list[Any], max_new: int, poll: bool, args: Any) -> dict[str, Any]:
    stats = {"responses": 0.0, "bytes": 0.0, "seconds": 0.0}
    poller = (
        asyncio.create_task(poll_feeds(url, args.poll_interval, args.tree_nodes, stats)) if poll else None
    )
    try:
        outs = await run_rate(url, NATIVE, reqs, poisson_arrivals(len(reqs), RATE, seed=0), max_new)
    finally:
        if poller is not None:
            poller.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await poller
    return summarize(RATE, outs) | {"dashboard_polls": stats}


def main(argv: list[str] | None = None) -> None:
    ap = bench_parser(__doc__, SIZES)
    ap.add_argument(
        "--poll-interval", type=float, default=1.0, help="Seconds between two polls of all feeds."
    )
    ap.add_argument("--tree-nodes", type=int, default=2000, help="max_nodes of each tree poll.")
    args, sizes = parse_sizes(ap, argv, SIZES)
    reqs = build_requests(sizes["num_requests"], 2, sizes["num_shots"])
    load_before = os.getloadavg()
    rounds: dict[str, list[dict[str, Any]]] = {"closed": [], "open": []}
    with tempfile.TemporaryDirectory() as tmp, running_server([], Path(tmp) / "server.log") as url:
        asyncio.run(one_round(url, reqs[:2], 2, False, args))  # warm-up: kernels built, pages touched
        for i in range(sizes["rounds"]):
            order = ("closed", "open") if i % 2 == 0 else ("open", "closed")
            for mode in order:
                flush(url)
                result = asyncio.run(one_round(url, reqs, sizes["max_new_tokens"], mode == "open", args))
                rounds[mode].append(result)
                print(f"round {i} page {mode}: {result['output_tok_per_s']:.1f} output tok/s")
    load_after = os.getloadavg()
    snapshot_costs = {n: snapshot_ms(n) for n in (100, 2000, 10_000)}
    median = {m: statistics.median(r["output_tok_per_s"] for r in rs) for m, rs in rounds.items()}
    # Each round's two modes ran back to back: their ratio is what the page cost under that round's load.
    ratios = [o["output_tok_per_s"] / c["output_tok_per_s"] for o, c in zip(rounds["open"], rounds["closed"])]
    overhead = 1 - statistics.median(ratios)
    polls = [r["dashboard_polls"] for r in rounds["open"]]
    table = Table(
        "Serving with and without an open dashboard",
        ["dashboard page", "output tok/s (median)", "per round", "feed responses", "feed MB"],
        [
            [
                mode,
                fmt(median[mode], ".1f"),
                ", ".join(fmt(r["output_tok_per_s"], ".1f") for r in rs),
                str(int(sum(r["dashboard_polls"]["responses"] for r in rs))),
                fmt(sum(r["dashboard_polls"]["bytes"] for r in rs) / 1e6),
            ]
            for mode, rs in rounds.items()
        ],
    )
    notes = [
        f"Throughput cost of an open dashboard: {100 * overhead:.1f}% (median over {sizes['rounds']} rounds "
        f"of open / closed, the two modes back to back in alternating order; per round "
        f"{', '.join(f'{100 * (1 - r):.1f}%' for r in ratios)}), polling all four feeds every "
        f"{args.poll_interval:g} s.",
        "Scheduler time per tree snapshot (built and encoded): "
        + ", ".join(f"{n} nodes {ms:.1f} ms" for n, ms in snapshot_costs.items())
        + f"; at the page's defaults (2000 nodes, the Cache view refreshed every 2 s) that is "
        f"{snapshot_costs[2000] / 20:.1f}% of the scheduler's time, an upper bound on its throughput cost.",
        f"Load average (1, 5, 15 min) before {tuple(round(x, 2) for x in load_before)}, after "
        f"{tuple(round(x, 2) for x in load_after)}, on {os.cpu_count()} cores.",
    ]
    data = {
        "rounds": rounds,
        "median_output_tok_per_s": median,
        "overhead": overhead,
        "open_over_closed_per_round": ratios,
        "poll_interval_s": args.poll_interval,
        "tree_nodes": args.tree_nodes,
        "feed_seconds_per_round": [p["seconds"] for p in polls],
        "tree_snapshot_ms": snapshot_costs,
        "load_average_before": load_before,
        "load_average_after": load_after,
    }
    save_result(Path(args.out_dir), NAME, data, [table], notes, [], sizes)


if __name__ == "__main__":
    main()
