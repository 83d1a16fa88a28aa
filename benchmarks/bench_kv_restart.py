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
    python benchmarks/bench_kv_restart.py --model-path gemma3-270m   # window slots on disk too

--prefetch-ab N: after the cold run, N times each (alternating which goes first), a server restarted
on a copy of its directory (the copy's pages dropped from the page cache, so it is read from the
device) with and without --disable-kv-disk-prefetch serves two long background generations and,
once they decode, every prompt at once. Reported per variant: the seconds the scheduler spent
blocked reading the disk tier (disk_read_seconds: the step that admits a prompt waits for them), the
background streams' longest gap between tokens, and the prompts' TTFT.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import statistics
import sys
import tempfile
from dataclasses import replace
from pathlib import Path
from typing import Any

import httpx
from bench_serving import NATIVE, Outcome, Request, long_documents, send
from common import (
    BenchModel,
    Size,
    Table,
    add_model_flag,
    bench_parser,
    fmt,
    parse_sizes,
    pyplot,
    save_figure,
    save_result,
)
from local_server import running_server

from radixlm_runtime.io.tokenizer import load_tokenizer

NAME = "kv_restart"
SIZES = {
    "prefix_tokens": Size(1000, 200, "tokens of each prompt's document (its shared prefix)", scales=False),
    "prompts": Size(4, 2, "prompts, each with a document of its own"),
    "max_new_tokens": Size(16, 4, "tokens decoded per request", scales=False),
}
TARGET = 5.0


def documents(prompts: int, prefix_tokens: int, model: BenchModel) -> list[Request]:
    """Each prompt: a document of exactly prefix_tokens tokens of its own (bench_serving's long
    prompts), then a question about it, as token ids (so the prefix is exact)."""
    tokenizer = load_tokenizer(model.hf_dir())
    return [
        Request(
            "document",
            "",
            doc + tokenizer.encode(f"\n\nQuestion {i}: which is the hardest, and why?\nAnswer:"),
        )
        for i, doc in enumerate(long_documents(prompts, prefix_tokens, tokenizer))
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


async def concurrent(url: str, reqs: list[Request], max_new_tokens: int) -> dict[str, Any]:
    """Two background generations, then (once both decode) every prompt at once."""
    decoding = [asyncio.Event(), asyncio.Event()]

    def api(started: asyncio.Event) -> Any:
        def read(chunk: dict[str, Any], out: Outcome) -> int:
            started.set()
            return NATIVE.read(chunk, out)

        return replace(NATIVE, read=read)

    async with httpx.AsyncClient(timeout=None) as client:
        stories = [Request("background", f"Story {i}: once upon a time") for i in range(len(decoding))]
        background = [
            asyncio.create_task(send(client, url, api(e), story, 8 * max_new_tokens))
            for story, e in zip(stories, decoding)
        ]
        for e in decoding:
            await e.wait()
        docs = await asyncio.gather(*(send(client, url, NATIVE, r, max_new_tokens) for r in reqs))
        streams = await asyncio.gather(*background)
    return {
        "ttft_ms": [1000 * o.ttft for o in docs],
        "background_max_gap_ms": max(1000 * max(o.itls) for o in streams),
    }


def uncached_copy(src: Path, dst: Path) -> None:
    """A copy of a disk tier directory, flushed and dropped from the page cache."""
    shutil.copytree(src, dst)
    for path in dst.rglob("*"):
        if path.is_file():
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def prefetch_ab(
    flags: list[str], disk_dir: Path, tmp: Path, reqs: list[Request], max_new_tokens: int, repeats: int
) -> dict[str, list[dict[str, Any]]]:
    """Restarts on copies of disk_dir, with and without reading ahead, `repeats` times each."""
    runs: dict[str, list[dict[str, Any]]] = {"prefetch": [], "no_prefetch": []}
    for r in range(repeats):
        for variant in ("prefetch", "no_prefetch") if r % 2 == 0 else ("no_prefetch", "prefetch"):
            kv = tmp / f"kv-{variant}-{r}"
            uncached_copy(disk_dir, kv)
            off = ["--disable-kv-disk-prefetch"] if variant == "no_prefetch" else []
            extra = [*flags[:-1], str(kv), *off]
            with running_server(extra, tmp / f"{variant}-{r}.log") as url:
                asyncio.run(serve(url, [Request("warm", "Hello")], 2))
                run = asyncio.run(concurrent(url, reqs, max_new_tokens))
                info = httpx.get(f"{url}/server_info", timeout=30).json()
            run.update({k: info[k] for k in ("disk_read_seconds", "disk_reads", "disk_hit_tokens")})
            runs[variant].append(run)
    return runs


def _spread(values: list[float], spec: str) -> str:
    """Median [min-max]."""
    return f"{fmt(statistics.median(values), spec)} [{fmt(min(values), spec)}-{fmt(max(values), spec)}]"


def prefetch_table(runs: dict[str, list[dict[str, Any]]]) -> Table:
    rows = [
        [
            variant,
            str(len(rs)),
            _spread([1000 * r["disk_read_seconds"] for r in rs], ".1f"),
            _spread([r["background_max_gap_ms"] for r in rs], ".0f"),
            _spread([statistics.median(r["ttft_ms"]) for r in rs], ".0f"),
            str(rs[0]["disk_hit_tokens"]),
        ]
        for variant, rs in runs.items()
    ]
    return Table(
        "After a restart, every prompt at once beside two background generations: disk reads ahead "
        "of admission (default) vs in the admitting step (--disable-kv-disk-prefetch); median [min-max]",
        ["variant", "runs", "blocked on disk ms", "background max gap ms", "median TTFT ms", "disk hits"],
        rows,
    )


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
    ap.add_argument("--prefetch-ab", type=int, default=0, metavar="N", help="see the module docstring")
    add_model_flag(ap)
    args, sizes = parse_sizes(ap, argv, SIZES)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # the `finally` that stops a server runs
    model = BenchModel(args.model_path)
    reqs = documents(sizes["prompts"], sizes["prefix_tokens"], model)
    longest = max(len(r.input_ids or ()) for r in reqs)
    with tempfile.TemporaryDirectory() as tmp:
        flags = ["--model-path", model.path] if model.path is not None else []
        # (--kv-disk-dir last: the read-ahead A/B replaces its value.)
        flags += ["--kv-host-tokens", str(2 * longest), "--kv-disk-dir", str(Path(tmp) / "kv")]
        cold = run_server(flags, Path(tmp) / "cold.log", reqs, sizes["max_new_tokens"])
        ab = {}
        if args.prefetch_ab:
            ab = prefetch_ab(
                flags, Path(tmp) / "kv", Path(tmp), reqs, sizes["max_new_tokens"], args.prefetch_ab
            )
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
    tables = [table, prefetch_table(ab)] if ab else [table]
    name = model.result_name(NAME)
    figure = f"{name}.png"
    args.out_dir.mkdir(parents=True, exist_ok=True)
    plot(args.out_dir / figure, cold, warm)
    save_result(
        args.out_dir,
        name,
        {"cold": cold, "restarted": warm, "identical": identical, "ttft_speedup": speedup}
        | ({"prefetch_ab": ab} if ab else {}),
        tables,
        notes,
        [figure],
        sizes,
        model,
    )


if __name__ == "__main__":
    main()
