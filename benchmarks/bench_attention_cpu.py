"""The C++ CPU attention alone (attention/cpu_attention.cpp) on the default model's shapes (9 query and 3
kv heads of 64): a prefill step of `--requests` prompts of `--tokens` tokens each, whole, causal, over
each KV pool the kernels read and each path this CPU has, against the peak of its arithmetic.

Rows: a float32 pool (float32 FMAs on the rows-as-lanes path, AVX-512 or AVX2); a bf16 pool read
widened to float32 (the bits of a float32 pool holding the rounded values) and, where the CPU has
AVX512-BF16, on path 3 (the scores and P.V by `vdpbf16ps`, the weights rounded to bf16: what
`--kv-cache-dtype bfloat16` and `--dtype bfloat16` run where it pays) and, where the CPU has AMX-BF16, on
path 4 (both products on AMX tiles, the default there); an int8 pool (codes converted per block,
float32 FMAs). Rates count the causal
work, 2 x 2 x n (c + (n + 1) / 2) x D operations per query head and prompt of n new tokens after c
cached ones (Q.K and P.V), against this
machine's measured peak of the instruction the row multiplies with (benchmarks/cpu_peak.py). Every row's
output is checked against the float32 pool's (largest difference shown; bf16 and int8 K/V move it).

    python benchmarks/bench_attention_cpu.py          # 16 prompts x 620 tokens (the few-shot GSM8K batch)
    python benchmarks/bench_attention_cpu.py --requests 1 --tokens 4 --context 3900 --repeats 50
                                                      # a long prompt's smallest chunk beside decodes
    python benchmarks/bench_attention_cpu.py --tiny
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import torch
from common import Size, Table, bench_parser, fmt, parse_sizes, pyplot, save_figure, save_result
from cpu_peak import PATHS, measure

from radixlm_runtime.attention.cpu_backend import (
    AMX_BF16,
    AVX2,
    AVX512,
    AVX512_BF16,
    StepRequests,
    decode_attention,
    kernel_path,
)
from radixlm_runtime.kvcache.pool import KVPool

NAME = "attention_cpu"
SIZES = {
    "requests": Size(16, 2, "prompts prefilled in the step"),
    "tokens": Size(620, 64, "tokens per prompt", scales=False),
    "context": Size(0, 32, "cached tokens before each prompt's (a chunk of a longer prompt)", scales=False),
    "repeats": Size(5, 1, "timed calls per row (best kept)"),
}
Q_HEADS, KV_HEADS, HEAD_DIM = 9, 3, 64


@dataclass(frozen=True)
class Row:
    label: str
    dtype: torch.dtype
    mode: int  # the widest path asked for; the CPU may run a narrower one (float32 FMAs either way)


ROWS = [
    Row("float32 pool", torch.float32, AVX512),
    Row("bf16 pool, widened", torch.bfloat16, AVX512),
    Row("bf16 pool, vdpbf16ps", torch.bfloat16, AVX512_BF16),
    Row("bf16 pool, AMX tiles", torch.bfloat16, AMX_BF16),
    Row("int8 pool", torch.int8, AVX512),
]
# What the bf16 rows' paths need of the CPU (without it they run the widened row's path, skipped here).
NEEDS = {AVX512_BF16: "AVX512-BF16", AMX_BF16: "AMX-BF16"}
# The cpu_peak.PATHS instruction each kernel path multiplies with (the scalar path: none measured).
PATH_PEAKS = {AVX2: "fp32_fma_ymm", AVX512: "fp32_fma_zmm", AVX512_BF16: "bf16_dot_zmm", AMX_BF16: "bf16_amx"}


def run_row(row: Row, requests: int, tokens: int, context: int, repeats: int) -> tuple[float, torch.Tensor]:
    """(best seconds of one call, the output) for the step over a pool of row.dtype: each request's
    `tokens` new ones after `context` cached ones."""
    gen = torch.Generator().manual_seed(0)
    seq = context + tokens
    pool = KVPool(requests * seq + 1, 1, KV_HEADS, HEAD_DIM, row.dtype, "cpu")
    table = torch.arange(1, requests * seq + 1).view(requests, seq)
    q = torch.randn(requests * tokens, Q_HEADS, HEAD_DIM, generator=gen)
    k = torch.randn(requests * seq, KV_HEADS, HEAD_DIM, generator=gen)
    v = torch.randn(requests * seq, KV_HEADS, HEAD_DIM, generator=gen)
    pool.set_kv(0, table.flatten(), k, v)
    lists = [
        list(range(requests)),
        [seq] * requests,
        [r * tokens for r in range(requests)],
        [tokens] * requests,
    ]
    step = StepRequests(torch.tensor(lists, dtype=torch.int64))
    out = torch.empty_like(q)
    best = float("inf")
    for _ in range(repeats + 1):  # the first call warms the threads and the scratch up
        t0 = time.perf_counter()
        decode_attention(q, out, pool, 0, table, step, HEAD_DIM**-0.5, row.mode)
        best = min(best, time.perf_counter() - t0)
    return best, out


def plot(path: Path, labels: list[str], rates: list[float], shares: list[float | None]) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 3.4))
    bars = ax.barh(labels, rates, color="C0")
    for bar, share in zip(bars, shares):
        if share is not None:
            ax.text(
                bar.get_width(), bar.get_y() + bar.get_height() / 2, f" {share:.0f} % of peak", va="center"
            )
    ax.set_xlabel("GFLOP/s (causal Q.K + P.V)")
    ax.set_title("CPU prefill attention by KV pool and path")
    ax.invert_yaxis()
    save_figure(fig, path)


def main(argv: list[str] | None = None) -> None:
    ap = bench_parser(__doc__, SIZES)
    args, sizes = parse_sizes(ap, argv, SIZES)
    requests, tokens, context = sizes["requests"], sizes["tokens"], sizes["context"]
    flops = 4 * requests * Q_HEADS * HEAD_DIM * tokens * (context + (tokens + 1) / 2)
    threads = torch.get_num_threads()
    results, skipped, reference = [], {}, None
    peaks: dict[str, float | None] = {}
    for row in ROWS:
        path = kernel_path(HEAD_DIM, row.mode)
        if row.mode in NEEDS and path != row.mode:
            skipped[row.label] = f"this CPU has no {NEEDS[row.mode]}: the widened row is what it runs"
            continue
        seconds, out = run_row(row, requests, tokens, context, sizes["repeats"])
        reference = out if reference is None else reference
        name = PATH_PEAKS.get(path)
        if name is not None and name not in peaks:
            peaks[name] = measure(name, threads)
        rate = flops / seconds / 1e9
        peak = None if name is None else peaks[name]
        results.append(
            {
                "label": f"{row.label} (path {path})",
                "path": path,
                "ms": seconds * 1e3,
                "gflops": rate,
                "peak": "-" if name is None else PATHS[name].instruction,
                "peak_gflops": peak,
                "share_of_peak": None if not peak else 100 * rate / peak,
                "max_diff_vs_float32": float((out - reference).abs().max()),
            }
        )
    base = results[0]["ms"]
    table = Table(
        f"Prefill attention: {requests} prompts x {tokens} tokens"
        + (f" after {context} cached" if context else "")
        + f", {Q_HEADS}/{KV_HEADS} heads of {HEAD_DIM}, {threads} thread(s)",
        ["KV pool, path", "ms", "GFLOP/s", "% of peak", "peak of", "speed-up", "largest diff vs float32"],
        [
            [
                r["label"],
                fmt(r["ms"]),
                fmt(r["gflops"], ".0f"),
                fmt(r["share_of_peak"], ".0f"),
                r["peak"],
                fmt(base / r["ms"], ".2f", "x"),
                fmt(r["max_diff_vs_float32"], ".1e"),
            ]
            for r in results
        ],
    )
    notes = [f"{r['label']}: **{base / r['ms']:.2f}x** the float32 pool" for r in results[1:]]
    notes += [f"{label}: skipped ({why})" for label, why in skipped.items()]
    args.out_dir.mkdir(parents=True, exist_ok=True)
    figure = f"{NAME}.png"
    plot(
        args.out_dir / figure,
        [r["label"] for r in results],
        [r["gflops"] for r in results],
        [r["share_of_peak"] for r in results],
    )
    save_result(
        args.out_dir,
        NAME,
        {"results": results, "skipped": skipped, "threads": threads, "flops": flops},
        tables=[table],
        notes=notes,
        figures=[figure],
        sizes=sizes,
    )


if __name__ == "__main__":
    main()
