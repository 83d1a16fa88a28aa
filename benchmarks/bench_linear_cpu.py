"""Float32 linears on the CPU: the panel kernels of layers/linear_cpu.cpp against oneDNN's prepacked
GEMM (torch.ops.mkldnn, what served float linears before), on the default model's projection shapes.

One pass is every linear of `--layers` decoder layers (qkv 576->960, o 576->576, gate_up 576->3072,
down 1536->576), plus the tied lm_head (576->49152) at decode row counts, where it is part of every
step: the weights a decode step streams. Both sides run in this process on the same weights and
inputs, alternating, best of `--repeats`; outputs are checked against each other first.

    python benchmarks/bench_linear_cpu.py                    # rows 1 .. 900, 30 layers
    ONEDNN_MAX_CPU_ISA=AVX2 python benchmarks/bench_linear_cpu.py --isa avx2   # both sides on AVX2
    python benchmarks/bench_linear_cpu.py --tiny
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path

import torch
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

from radixlm_runtime.layers.linear_kernels import ROW_DOT, ROW_DOT_512, FloatPanels, cpu_linear

NAME = "linear_cpu"
SIZES = {
    "layers": Size(30, 1, "decoder layers of linears per pass", scales=False),
    "repeats": Size(5, 1, "timed passes per side and row count (best kept)", scales=False),
}
LAYER_SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # (out, in) of qkv, o, gate_up, down
LM_HEAD = (49152, 576)
# Up to this many rows (a decode step's batch) a pass includes the lm_head.
DECODE_ROWS = 64


def _best(fn: Callable[[], None], repeats: int) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def measure(rows: int, layers: int, repeats: int, mode: int) -> dict[str, float]:
    shapes = LAYER_SHAPES * layers + ([LM_HEAD] if rows <= DECODE_ROWS else [])
    torch.manual_seed(rows)
    weights = [torch.randn(n, k) * k**-0.5 for n, k in shapes]
    onednn = [torch.ops.mkldnn._reorder_linear_weight(w) for w in weights]
    panels = [FloatPanels.pack(w) for w in weights]
    inputs = {k: torch.randn(rows, k) for _, k in shapes}
    for (_, k), packed, panel in zip(shapes, onednn, panels):
        want = torch.ops.mkldnn._linear_pointwise(inputs[k], packed, None, "none", [], "")
        torch.testing.assert_close(cpu_linear(inputs[k], panel, mode=mode), want, rtol=1e-4, atol=1e-4)

    def run_onednn() -> None:
        for (_, k), packed in zip(shapes, onednn):
            torch.ops.mkldnn._linear_pointwise(inputs[k], packed, None, "none", [], "")

    def run_panels() -> None:
        for (_, k), panel in zip(shapes, panels):
            cpu_linear(inputs[k], panel, mode=mode)

    times = {"onednn": float("inf"), "panels": float("inf")}
    for _ in range(2):  # alternating rounds: this machine's speed drifts
        times["onednn"] = min(times["onednn"], _best(run_onednn, repeats))
        times["panels"] = min(times["panels"], _best(run_panels, repeats))
    weight_bytes = sum(w.numel() * 4 for w in weights)
    return {
        "rows": rows,
        "onednn_ms": times["onednn"] * 1e3,
        "panels_ms": times["panels"] * 1e3,
        "speedup": times["onednn"] / times["panels"],
        "panels_gflops": 2 * rows * weight_bytes / 4 / times["panels"] / 1e9,
        "panels_gbps": weight_bytes / times["panels"] / 1e9,
        "weight_mb": weight_bytes / 1e6,
    }


def plot(path: Path, results: list[dict[str, float]], isa: str) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6, 3.4))
    labels = [str(int(r["rows"])) for r in results]
    ax.bar(labels, [r["speedup"] for r in results], color="C0")
    ax.axhline(1.0, color="C3", linestyle="--", label="oneDNN")
    ax.set_xlabel("rows of activations (decode batch / prefill tokens)")
    ax.set_ylabel("panel kernels speed-up")
    ax.set_title(f"float32 linears, {isa}: panels vs oneDNN prepacked")
    ax.legend()
    save_figure(fig, path)


def main(argv: list[str] | None = None) -> None:
    ap = bench_parser(__doc__, SIZES)
    add_list_flag(ap, "--rows", "row counts", "1,4,16,32,64,256,900", "1,16")
    ap.add_argument(
        "--isa",
        choices=("native", "avx2"),
        default="native",
        help="native: each side's widest path; avx2: both on AVX2 (needs ONEDNN_MAX_CPU_ISA=AVX2 set)",
    )
    args, sizes = parse_sizes(ap, argv, SIZES)
    if args.isa == "avx2" and os.environ.get("ONEDNN_MAX_CPU_ISA", "").upper() != "AVX2":
        ap.error("--isa avx2 compares like with like only with ONEDNN_MAX_CPU_ISA=AVX2 in the environment")
    mode = ROW_DOT if args.isa == "avx2" else ROW_DOT_512
    rows = list_flag(args, "--rows", int)
    results = [measure(m, sizes["layers"], sizes["repeats"], mode) for m in rows]
    args.out_dir.mkdir(parents=True, exist_ok=True)
    figure = f"{NAME}.png"
    plot(args.out_dir / figure, results, args.isa)
    table = Table(
        f"float32 linears ({args.isa}), {sizes['layers']} layers a pass (+ lm_head to {DECODE_ROWS} rows)",
        ["rows", "oneDNN ms", "panels ms", "speed-up", "panels GFLOP/s", "panels GB/s of weights"],
        [
            [
                str(int(r["rows"])),
                fmt(r["onednn_ms"], ".1f"),
                fmt(r["panels_ms"], ".1f"),
                fmt(r["speedup"], ".2f", "x"),
                fmt(r["panels_gflops"], ".0f"),
                fmt(r["panels_gbps"], ".1f"),
            ]
            for r in results
        ],
    )
    save_result(
        args.out_dir,
        NAME,
        {"isa": args.isa, "results": results},
        tables=[table],
        notes=[f"{int(r['rows'])} rows: panels **{r['speedup']:.2f}x** oneDNN" for r in results],
        figures=[figure],
        sizes=sizes,
    )


if __name__ == "__main__":
    main()
