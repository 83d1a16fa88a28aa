"""Routing cost per token of the MoE layer (layers/moe.py, its CPU gather path) against a dense SwiGLU MLP
with the same active parameters: E experts of intermediate I, top-k of them per token, against one MLP
of intermediate k * I, on the same tokens, float32 on the CPU.

Timings per token count, in this process, three alternating rounds, best of `--repeats`:
- moe: the whole layer (router, sort and gather by expert, one matmul pair per active expert, the
  weighted rows gathered back and summed per token);
- experts: only its per-expert matmul pairs and SiLU-and-mul, on the same rows gathered beforehand;
- router: the gate, softmax and top-k alone (part of moe);
- dense: the MLP of intermediate k * I.
moe - experts is the routing overhead (router, gather, scatter, one Python step per active expert
besides its matmuls). The router's gate is prepacked as a loaded model has it; the experts and the
dense MLP both multiply through torch's F.linear, so the ratio shows routing, not a kernel choice.
Beyond decode sizes the MoE also streams more weights than the dense MLP: every expert a token picks.

    python benchmarks/bench_moe.py                     # T = 1, 16, 256; E=64, top-8, I=512, H=1024
    python benchmarks/bench_moe.py --threads 1       # steadier on a loaded machine
    python benchmarks/bench_moe.py --tiny
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from common import (
    Size,
    Table,
    add_list_flag,
    bench_parser,
    fmt,
    list_flag,
    parse_sizes,
    pyplot,
    save_figure,
    save_result,
)

from radixlm_runtime.layers.activation import SiluAndMul
from radixlm_runtime.layers.moe import MoE

NAME = "moe"
# The default shape is OLMoE's (64 experts, top-8) at half its width.
SIZES = {
    "hidden": Size(1024, 64, "hidden size", scales=False),
    "intermediate": Size(512, 32, "intermediate size of one expert", scales=False),
    "experts": Size(64, 8, "experts", scales=False),
    "top_k": Size(8, 2, "experts per token", scales=False),
    "repeats": Size(10, 2, "timed calls per side and token count (best kept)", scales=True),
}


def _best(fn: Callable[[], object], repeats: int) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def build_moe(hidden: int, inter: int, experts: int, top_k: int) -> MoE:
    moe = MoE(hidden, inter, experts, top_k, renormalize=True)
    with torch.no_grad():
        moe.gate.weight.normal_(std=hidden**-0.5)
        moe.w13.normal_(std=hidden**-0.5)
        moe.w2.normal_(std=inter**-0.5)
    moe.gate.prepack()
    return moe


def measure(
    moe: MoE, dense: tuple[torch.Tensor, torch.Tensor], tokens: int, repeats: int
) -> dict[str, float]:
    act = SiluAndMul()
    torch.manual_seed(tokens)
    x = torch.randn(tokens, moe.hidden_size)
    _, ids = moe.route(x)
    flat = ids.flatten()
    gathered = x[flat.argsort(stable=True) // moe.top_k]
    counts = torch.bincount(flat, minlength=moe.num_experts).tolist()
    starts = [sum(counts[:e]) for e in range(moe.num_experts)]
    active = [(e, gathered[starts[e] : starts[e] + n]) for e, n in enumerate(counts) if n]
    w13_dense, w2_dense = dense

    def run_experts() -> None:
        for e, rows in active:
            F.linear(act(F.linear(rows, moe.w13[e])), moe.w2[e])

    sides: dict[str, Callable[[], object]] = {
        "moe": lambda: moe(x),
        "experts": run_experts,
        "router": lambda: moe.route(x),
        "dense": lambda: F.linear(act(F.linear(x, w13_dense)), w2_dense),
    }
    times = dict.fromkeys(sides, float("inf"))
    for _ in range(3):  # alternating rounds: this machine's speed drifts
        for side, fn in sides.items():
            times[side] = min(times[side], _best(fn, repeats))
    us = {side: t / tokens * 1e6 for side, t in times.items()}
    overhead = times["moe"] - times["experts"]
    return {
        "tokens": tokens,
        "active_experts": len(active),
        "moe_us_per_token": us["moe"],
        "experts_us_per_token": us["experts"],
        "router_us_per_token": us["router"],
        "dense_us_per_token": us["dense"],
        "moe_over_dense": times["moe"] / times["dense"],
        "overhead_share": overhead / times["moe"],
        "router_share": times["router"] / times["moe"],
    }


def plot(path: Path, results: list[dict[str, float]]) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6, 3.4))
    labels = [str(int(r["tokens"])) for r in results]
    xs = range(len(results))
    width = 0.27
    for i, (key, label) in enumerate(
        [("dense", "dense, k*I"), ("experts", "MoE expert matmuls"), ("moe", "MoE layer")]
    ):
        ax.bar(
            [x + (i - 1) * width for x in xs], [r[f"{key}_us_per_token"] for r in results], width, label=label
        )
    ax.set_xticks(list(xs), labels)
    ax.set_yscale("log")
    ax.set_xlabel("tokens in the call")
    ax.set_ylabel("µs per token")
    ax.set_title("MoE layer vs dense SwiGLU of equal active parameters")
    ax.legend()
    save_figure(fig, path)


def main(argv: list[str] | None = None) -> None:
    ap = bench_parser(__doc__, SIZES)
    add_list_flag(ap, "--tokens", "token counts", "1,16,256", "1,16")
    ap.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch threads (default torch's: one per core); 1 steadies "
        "the figures on a loaded machine, where a second thread waits for a core at every parallel region",
    )
    args, sizes = parse_sizes(ap, argv, SIZES)
    if args.threads:
        torch.set_num_threads(args.threads)
    hidden, inter, experts, top_k = (sizes[k] for k in ("hidden", "intermediate", "experts", "top_k"))
    torch.manual_seed(0)
    moe = build_moe(hidden, inter, experts, top_k)
    dense_inter = top_k * inter
    dense = (
        torch.randn(2 * dense_inter, hidden) * hidden**-0.5,
        torch.randn(hidden, dense_inter) * dense_inter**-0.5,
    )
    with torch.inference_mode():
        results = [measure(moe, dense, t, sizes["repeats"]) for t in list_flag(args, "--tokens", int)]
    args.out_dir.mkdir(parents=True, exist_ok=True)
    figure = f"{NAME}.png"
    plot(args.out_dir / figure, results)
    table = Table(
        f"MoE ({experts} experts, top-{top_k}, I={inter}, H={hidden}) vs dense SwiGLU (I={dense_inter}), "
        f"float32 CPU, torch threads: {torch.get_num_threads()}",
        [
            "tokens",
            "active experts",
            "dense µs/token",
            "MoE µs/token",
            "MoE / dense",
            "expert matmuls µs/token",
            "routing overhead",
            "of which router",
        ],
        [
            [
                str(int(r["tokens"])),
                f"{int(r['active_experts'])}/{experts}",
                fmt(r["dense_us_per_token"], ".1f"),
                fmt(r["moe_us_per_token"], ".1f"),
                fmt(r["moe_over_dense"], ".2f", "x"),
                fmt(r["experts_us_per_token"], ".1f"),
                fmt(100 * r["overhead_share"], ".0f", " %"),
                fmt(100 * r["router_share"], ".0f", " %"),
            ]
            for r in results
        ],
    )
    save_result(
        args.out_dir,
        NAME,
        {
            "shape": {"hidden": hidden, "intermediate": inter, "experts": experts, "top_k": top_k},
            "results": results,
        },
        tables=[table],
        notes=[
            f"T={int(r['tokens'])}: MoE **{r['moe_over_dense']:.2f}x** the dense MLP's time per token, "
            f"{100 * r['overhead_share']:.0f} % of it routing overhead"
            for r in results
        ],
        figures=[figure],
        sizes=sizes,
    )


if __name__ == "__main__":
    main()
