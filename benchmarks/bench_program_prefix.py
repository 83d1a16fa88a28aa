"""Language-level caching: a two-call few-shot program over many items with run_batch, with the
call-graph prefix warming and per-run KV pinning (sessions) on versus off, on one server.

With it off, the items race to prefill the shared few-shot prefix and, when KV is tight, a run's
first call can be evicted before its second call arrives. With it on, the prefix is prefilled once
before the fan-out, and each run's history stays pinned until the run ends.

python benchmarks/bench_program_prefix.py [--tiny] [--scale S] [--num-items N]
"""

from __future__ import annotations

import time
from typing import Any

from common import Size, Table, bench_parser, fmt, parse_sizes, pyplot, save_figure, save_result

import radixlm as sgl
from radixlm.eval.data import gsm8k_fewshot_prefix, gsm8k_question_suffix, load_gsm8k

SIZES = {
    "num_items": Size(64, 6, "program runs in the batch"),
    "num_shots": Size(5, 2, "few-shot examples in the shared prefix", scales=False),
    "max_new_tokens": Size(48, 8, "tokens per gen call", scales=False),
    "kv_tokens": Size(
        12000, 6000, "server KV pool size in tokens (tight, so eviction happens)", scales=False
    ),
}


@sgl.function
def solve_then_check(s, prefix, question, max_new_tokens):
    s += prefix + gsm8k_question_suffix(question)
    s += sgl.gen("answer", max_tokens=max_new_tokens, stop="Question:")
    s += "\nDouble-check the arithmetic in one sentence:"
    s += sgl.gen("check", max_tokens=max_new_tokens, stop="\n")


def run_mode(runtime: sgl.Runtime, items: list[dict[str, Any]], optimized: bool) -> dict[str, Any]:
    backend = sgl.RuntimeEndpoint(runtime.url, use_sessions=optimized)
    backend.flush_cache()
    before = backend.get_server_info()
    t0 = time.perf_counter()
    states = solve_then_check.run_batch(items, backend=backend, temperature=0, warm_prefix=optimized)
    wall = time.perf_counter() - t0
    after = backend.get_server_info()
    delta = {k: after[k] - before[k] for k in ("prompt_tokens", "cached_tokens", "generated_tokens")}
    check_metas = [s.get_meta_info("check") for s in states]
    backend.shutdown()
    return {
        "optimized": optimized,
        "wall_s": wall,
        "programs_per_s": len(items) / wall,
        "output_tokens_per_s": delta["generated_tokens"] / wall,
        "cache_hit_rate": delta["cached_tokens"] / max(delta["prompt_tokens"], 1),
        "computed_prompt_tokens": delta["prompt_tokens"] - delta["cached_tokens"],
        # How much of each second call's prompt (the whole first call) came from the cache.
        "second_call_hit_rate": sum(m["cached_tokens"] for m in check_metas)
        / max(sum(m["prompt_tokens"] for m in check_metas), 1),
        "outputs": [[s["answer"], s["check"]] for s in states],
        "pinned_tokens_after": after["pinned_tokens"],
    }


def main(argv: list[str] | None = None) -> None:
    ap = bench_parser(__doc__, SIZES)
    args, sizes = parse_sizes(ap, argv, SIZES)
    prefix = gsm8k_fewshot_prefix(sizes["num_shots"])
    items = [
        {"prefix": prefix, "question": it.question, "max_new_tokens": sizes["max_new_tokens"]}
        for it in load_gsm8k("test", sizes["num_items"])
    ]
    with sgl.Runtime(max_total_tokens=sizes["kv_tokens"], log_level="warning") as runtime:
        # One warm-up run so neither mode pays for first-call start-up costs.
        solve_then_check.run(**(items[0] | {"max_new_tokens": 2}), backend=runtime, temperature=0).sync()
        modes = [run_mode(runtime, items, optimized) for optimized in (False, True)]
    off, on = modes
    identical = sum(a == b for a, b in zip(off["outputs"], on["outputs"]))
    table = Table(
        f"run_batch over {len(items)} two-call programs ({sizes['num_shots']}-shot prefix, "
        f"KV pool {sizes['kv_tokens']} tokens)",
        [
            "mode",
            "wall s",
            "programs/s",
            "output tok/s",
            "cache hit rate",
            "2nd-call hit rate",
            "prefill tokens",
        ],
    )
    for name, m in (("plain run_batch", off), ("prefix warming + pinning", on)):
        table.rows.append(
            [
                name,
                fmt(m["wall_s"], ".1f"),
                fmt(m["programs_per_s"]),
                fmt(m["output_tokens_per_s"], ".1f"),
                fmt(m["cache_hit_rate"], ".3f"),
                fmt(m["second_call_hit_rate"], ".3f"),
                str(m["computed_prompt_tokens"]),
            ]
        )
    saved = off["computed_prompt_tokens"] / max(on["computed_prompt_tokens"], 1)
    notes = [
        f"warming + pinning: {off['wall_s'] / on['wall_s']:.2f}x throughput, "
        f"{saved:.2f}x fewer prompt tokens computed",
        f"greedy outputs identical in both modes for {identical}/{len(items)} programs",
    ]
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(5, 3.2))
    ax.bar(["plain", "warm + pin"], [off["programs_per_s"], on["programs_per_s"]], color=["#999", "#2a7"])
    ax.set_ylabel("programs / s")
    ax.set_title("run_batch throughput")
    save_figure(fig, args.out_dir / "program_prefix.png")
    save_result(
        args.out_dir,
        "program_prefix",
        {"modes": modes, "identical_outputs": identical, "num_items": len(items)},
        [table],
        notes,
        ["program_prefix.png"],
        sizes,
    )


if __name__ == "__main__":
    main()
