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
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
from bench_serving import NATIVE, build_requests, poisson_arrivals, run_rate, summarize
from common import Size, Table, bench_parser, fmt, parse_sizes, save_result
from local_server import flush, running_server

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
        "load_average_before": load_before,
        "load_average_after": load_after,
    }
    save_result(Path(args.out_dir), NAME, data, [table], notes, [], sizes)


if __name__ == "__main__":
    main()
