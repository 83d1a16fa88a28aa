"""The CPU linear kernels of layers/linear_cpu.cpp on the default model's projection shapes: float32
panels against oneDNN's prepacked GEMM, and every kernel's throughput against this machine's measured
peak.

One pass is every linear of `--layers` decoder layers (qkv 576->960, o 576->576, gate_up 576->3072,
down 1536->576), plus the tied lm_head (576->49152) at decode row counts, where it is part of every
step: the weights a decode step streams.

First table: the float32 panel kernels against oneDNN's prepacked GEMM (torch.ops.mkldnn, what served
float linears before); both sides run in this process on the same weights and inputs, alternating,
best of `--repeats`; outputs are checked against each other first.

Then the peak of each instruction set on this machine, per thread count of `--threads`
(benchmarks/cpu_peak.cpp: fp32 FMA, bf16 dot products vdpbf16ps, int8 dot products, AMX tile products
where the CPU has them), and every kernel
against the peak of its own arithmetic at decode rows (`--kernel-rows` up to 64: `--layers` layers and
the lm_head, the weights streamed as in a decode step) and prefill rows (512 and 2,048 tokens:
`--prefill-layers` layers, no lm_head): fp32 panels (PANEL_GEMM), bf16 panels (BF16_GEMM: AMX-BF16
where the CPU has it, then also on AVX512-BF16 with AMX off, side by side),
int4 (GGUF Q4_1's numbers: quantize_int4) and int8 (Q8_0's: quantize_int8, groups of 32) weights with
float32 activations (QuantPanels, as the engine serves them: dequantized in registers below 20 rows,
into float32 panels from there; `int4_gguf`/`int8_gguf` beside them: the GGUF layout's row dots below
PANEL_GEMM_MIN_ROWS rows and its panel GEMM from there, what served them before), in bf16 (the GGUF
layout's panel GEMM from PANEL_GEMM_MIN_ROWS rows on) and with int8 activations (Act8Panels, VNNI or
AVX2; skipped where this radixlm or CPU lacks them). Rates count 2 x M x N x K operations (GFLOP/s;
GOP/s for int8 activations, against the int8 peak); a kernel in fp32 arithmetic is held against the
widest fp32 FMA peak, bf16
against vdpbf16ps' (tdpbf16ps' on AMX tiles), int8 activations against vpdpbusd's. Each kernel's
output is checked against the float32 product with the weight it holds (relative error under 1e-4 in
fp32, 3e-2 in bf16 or int8).

    python benchmarks/bench_linear_cpu.py                    # rows 1 .. 900, 30 layers; peaks at all cores
    python benchmarks/bench_linear_cpu.py --threads 1,2      # peaks and kernels at 1 and 2 threads
    ONEDNN_MAX_CPU_ISA=AVX2 python benchmarks/bench_linear_cpu.py --isa avx2   # both sides on AVX2
    python benchmarks/bench_linear_cpu.py --tiny
"""

from __future__ import annotations

import functools
import gc
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import cpu_peak
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

from radixlm_runtime.layers import linear_kernels
from radixlm_runtime.layers.linear_kernels import (
    BF16,
    FP32,
    NO_AMX,
    PANEL_GEMM_MIN_ROWS,
    ROW_DOT,
    ROW_DOT_512,
    BF16Panels,
    FloatPanels,
    QuantPanels,
    bf16_available,
    cpu_linear,
    kernel_mode,
)
from radixlm_runtime.layers.quantization import QuantizedWeight, quantize_int4, quantize_int8

NAME = "linear_cpu"
SIZES = {
    "layers": Size(30, 1, "decoder layers of linears per pass", scales=False),
    "prefill_layers": Size(2, 1, "decoder layers per pass at prefill rows (past 64)", scales=False),
    "repeats": Size(5, 1, "timed passes per side and row count (best kept)", scales=False),
    "peak_ms": Size(200, 20, "length of one timed run of the peak micro-benchmark, ms", scales=False),
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


# A kernel's arithmetic -> the cpu_peak paths that measure its ceiling: the first this CPU runs (zmm
# where it has AVX-512, whatever width the kernel itself uses).
PEAK_PATHS = {
    "fp32": ("fp32_fma_zmm", "fp32_fma_ymm"),
    "bf16": ("bf16_dot_zmm",),
    "bf16_amx": ("bf16_amx",),
    "int8": ("int8_vnni_zmm", "int8_vnni_ymm", "int8_avx2_ymm"),
}
# Relative error allowed against the float32 product with the weight a kernel holds.
TOLERANCE = {"fp32": 1e-4, "bf16": 3e-2, "bf16_amx": 3e-2, "int8": 3e-2}
# The share of its peak a kernel is to reach at prefill rows, in percent.
PEAK_TARGET = 70.0


@dataclass(frozen=True)
class Kernel:
    """One CPU linear kernel of the peak comparison: the weight it reads, made from a float32 weight
    (`quantize`, then `pack`), and the arithmetic cpu_linear runs it in (the mode it picks per row
    count, as the engine calls it)."""

    name: str
    label: str
    quantize: Callable[[torch.Tensor], Any]
    pack: Callable[[Any], Any]
    compute: str  # linear_kernels.FP32 or BF16
    act8: bool = False
    no_amx: bool = False  # bf16 kept on the AVX512-BF16 kernel on a CPU with AMX-BF16 (set beside it)

    def arithmetic(self, rows: int) -> str:
        """fp32, bf16 (vdpbf16ps), bf16_amx (tdpbf16ps) or int8: what the kernel at `rows` rows
        multiplies in."""
        if self.act8:
            return "int8"
        if self.compute == BF16 and (self.pack == BF16Panels.pack or rows >= PANEL_GEMM_MIN_ROWS):
            amx = not self.no_amx and linear_kernels.bf16_path(rows, LAYER_SHAPES[0][1]) == "AMX-BF16"
            return "bf16_amx" if amx else "bf16"
        return "fp32"

    def mode(self, rows: int) -> int | None:
        """The mode cpu_linear runs it in: its own pick, or that pick kept off AMX tiles."""
        return kernel_mode(rows, self.compute) | NO_AMX if self.no_amx else None


def _int8(weight: torch.Tensor) -> QuantizedWeight:
    return quantize_int8(weight, group_size=32)  # GGUF Q8_0's numbers: a scale per 32 columns


def _act8(weight: QuantizedWeight) -> Any:
    return linear_kernels.Act8Panels.pack(weight)


def _same(weight: Any) -> Any:
    return weight


KERNELS = {
    k.name: k
    for k in (
        Kernel("fp32_panels", "float32 panels", _same, FloatPanels.pack, FP32),
        Kernel("bf16_panels", "bf16 panels", _same, BF16Panels.pack, BF16),
        Kernel(
            "bf16_panels_vdp", "bf16 panels, AVX512-BF16 (AMX off)", _same, BF16Panels.pack, BF16, no_amx=True
        ),
        Kernel("int4", "int4 weights, fp32 activations", quantize_int4, QuantPanels.pack, FP32),
        Kernel("int4_gguf", "int4 weights (GGUF layout), fp32 activations", quantize_int4, _same, FP32),
        Kernel("int4_bf16", "int4 weights, bf16 arithmetic", quantize_int4, _same, BF16),
        Kernel("int4_a8", "int4 weights, int8 activations", quantize_int4, _act8, FP32, act8=True),
        Kernel("int8", "int8 weights, fp32 activations", _int8, QuantPanels.pack, FP32),
        Kernel("int8_gguf", "int8 weights (GGUF layout), fp32 activations", _int8, _same, FP32),
        Kernel("int8_bf16", "int8 weights, bf16 arithmetic", _int8, _same, BF16),
        Kernel("int8_a8", "int8 weights, int8 activations", _int8, _act8, FP32, act8=True),
    )
}


def unavailable(kernel: Kernel) -> str | None:
    """Why `kernel` cannot run here (None: it can)."""
    if kernel.compute == BF16 and not bf16_available():
        return "this CPU has no AVX512-BF16 dot products"
    if kernel.no_amx and linear_kernels.bf16_path(64, LAYER_SHAPES[0][1]) != "AMX-BF16":
        return "this CPU has no AMX-BF16 tiles: the bf16 panels row is its AVX512-BF16 kernel"
    if kernel.act8:
        if not hasattr(linear_kernels, "Act8Panels"):
            return "this radixlm has no int8-activation kernels (linear_kernels.Act8Panels)"
        if not linear_kernels.act8_available():
            return "this CPU has no SIMD path for the int8-activation kernels"
    return None


def _weight_bytes(packed: Any) -> int:
    tensors = [v for v in vars(packed).values() if isinstance(v, torch.Tensor)]
    return sum(t.numel() * t.element_size() for t in tensors)


def _reference(held: Any, packed: Any) -> torch.Tensor:
    """The float32 [N, K] weight a kernel multiplies by: bf16 panels' rounded values, a quantized
    weight's dequantized ones, else the float32 weight itself."""
    if isinstance(packed, BF16Panels):
        return packed.dequantize()
    return held.dequantize() if isinstance(held, QuantizedWeight) else held


def _pass(packed: list[Any], inputs: dict[int, torch.Tensor], compute: str, mode: int | None) -> None:
    for w in packed:
        cpu_linear(inputs[w.in_features], w, mode=mode, compute=compute)


def measure_kernel(
    kernel: Kernel, weights: list[torch.Tensor], rows_list: list[int], repeats: int, peaks: dict[str, float]
) -> list[dict[str, Any]]:
    """One pass over `weights` through `kernel` at each row count: best time of `repeats`, its rate and
    the share of the measured peak of the kernel's arithmetic. Outputs are checked first."""
    held = [kernel.quantize(w) for w in weights]
    packed = [kernel.pack(h) for h in held]
    weight_bytes = sum(_weight_bytes(p) for p in packed)
    ops_per_row = 2 * sum(w.numel() for w in weights)
    out = []
    for rows in rows_list:
        torch.manual_seed(rows)
        inputs = {k: torch.randn(rows, k) for k in {w.shape[1] for w in weights}}
        checked: dict[tuple[int, int], float] = {}
        for h, w in zip(held, packed):
            shape = (w.out_features, w.in_features)
            if shape not in checked:
                x = inputs[w.in_features]
                want = x @ _reference(h, w).T
                got = cpu_linear(x, w, mode=kernel.mode(rows), compute=kernel.compute)
                checked[shape] = float((got - want).norm() / want.norm())
        arithmetic = kernel.arithmetic(rows)
        error = max(checked.values())
        if error > TOLERANCE[arithmetic]:
            raise AssertionError(f"{kernel.name} at {rows} rows: relative error {error:.2e} against float32")

        seconds = _best(functools.partial(_pass, packed, inputs, kernel.compute, kernel.mode(rows)), repeats)
        rate = ops_per_row * rows / seconds / 1e9
        path = next((p for p in PEAK_PATHS[arithmetic] if p in peaks), None)
        out.append(
            {
                "kernel": kernel.name,
                "rows": rows,
                "threads": torch.get_num_threads(),
                "arithmetic": arithmetic,
                "ms": seconds * 1e3,
                "rate": rate,
                "peak_path": path,
                "peak": peaks[path] if path else None,
                "percent_of_peak": 100 * rate / peaks[path] if path else None,
                "weight_gbps": weight_bytes / seconds / 1e9,
                "weight_mb": weight_bytes / 1e6,
                "relative_error": error,
            }
        )
        share = out[-1]["percent_of_peak"] or 0.0
        print(f"{kernel.name:12s} {rows:5d} rows: {rate:7.1f} G(FL)OP/s, {share:5.1f}% of peak")
    return out


def measure_against_peaks(
    threads: int, kernels: list[Kernel], rows: list[int], sizes: dict[str, int]
) -> tuple[dict[str, float], list[dict[str, Any]]]:
    """The peaks on `threads` threads, then every kernel at decode rows (--layers layers and the
    lm_head) and prefill rows (--prefill-layers layers)."""
    torch.set_num_threads(threads)
    peaks = cpu_peak.peaks(threads, seconds=sizes["peak_ms"] / 1e3)
    results: list[dict[str, Any]] = []
    decode = [r for r in rows if r <= DECODE_ROWS]
    prefill = [r for r in rows if r > DECODE_ROWS]
    for layers, part, head in ((sizes["layers"], decode, [LM_HEAD]), (sizes["prefill_layers"], prefill, [])):
        if not part:
            continue
        torch.manual_seed(layers)
        weights = [torch.randn(n, k) * k**-0.5 for n, k in LAYER_SHAPES * layers + head]
        for kernel in kernels:
            results += measure_kernel(kernel, weights, part, sizes["repeats"], peaks)
            gc.collect()
    return peaks, results


def peak_table(peaks: dict[int, dict[str, float]]) -> Table:
    rows = []
    for threads, found in peaks.items():
        for name, path in cpu_peak.PATHS.items():
            rate = found.get(name)
            shown = fmt(rate, ".1f", f" {path.unit}") if rate is not None else "- (this CPU lacks it)"
            rows.append([str(threads), path.instruction, shown])
    title = "Measured peak of this machine (benchmarks/cpu_peak.cpp)"
    return Table(title, ["threads", "instruction", "peak"], rows)


def kernel_table(results: list[dict[str, Any]]) -> Table:
    headers = ["threads", "kernel", "rows", "ms a pass", "GFLOP/s (GOP/s int8)", "% of peak", "peak"]
    headers.append("GB/s of weights")
    rows = [
        [
            str(r["threads"]),
            KERNELS[r["kernel"]].label,
            str(r["rows"]),
            fmt(r["ms"], ".2f"),
            fmt(r["rate"], ".1f"),
            fmt(r["percent_of_peak"], ".1f", "%"),
            cpu_peak.PATHS[r["peak_path"]].instruction if r["peak_path"] else "-",
            fmt(r["weight_gbps"], ".1f"),
        ]
        for r in results
    ]
    return Table("CPU linear kernels against the measured peak of their arithmetic", headers, rows)


def slots_table(slots: dict[str, float]) -> Table:
    """cpu_peak.vnni_slots: what each instruction of the int8-activation kernels' epilogue, nibble split
    and broadcasts costs the vpdpbusd beside it."""
    rows = [[name, fmt(taken, ".2f")] for name, taken in slots.items()]
    title = "vpdpbusd zmm slots one other instruction takes among them (1 thread; 1: a slot, 0: free)"
    return Table(title, ["instruction", "vpdpbusd slots"], rows)


def peak_notes(results: list[dict[str, Any]]) -> list[str]:
    """Per thread count and kernel, the share of its peak at prefill rows, against the 70 % target."""
    notes = []
    for threads in dict.fromkeys(r["threads"] for r in results):
        for name, kernel in KERNELS.items():
            mine = [r for r in results if r["threads"] == threads and r["kernel"] == name]
            prefill = [r for r in mine if r["rows"] > DECODE_ROWS]
            if not prefill or prefill[0]["percent_of_peak"] is None:
                continue
            shares = " / ".join(f"{r['percent_of_peak']:.0f}%" for r in prefill)
            counts = " / ".join(str(r["rows"]) for r in prefill)
            met = "met" if min(r["percent_of_peak"] for r in prefill) >= PEAK_TARGET else "not met"
            notes.append(
                f"{threads} thread(s), {kernel.label}: **{shares}** of the "
                f"{cpu_peak.PATHS[prefill[0]['peak_path']].instruction} peak at {counts} rows "
                f"(target >= {PEAK_TARGET:.0f}%: {met})"
            )
    return notes


def plot_peaks(path: Path, results: list[dict[str, Any]]) -> None:
    plt = pyplot()
    threads = results[0]["threads"]
    mine = [r for r in results if r["threads"] == threads]
    names = list(dict.fromkeys(r["kernel"] for r in mine))
    counts = list(dict.fromkeys(r["rows"] for r in mine))
    fig, ax = plt.subplots(figsize=(8, 3.6))
    width = 0.8 / len(counts)
    for i, rows in enumerate(counts):
        shares = [
            next((r["percent_of_peak"] or 0.0 for r in mine if r["kernel"] == n and r["rows"] == rows), 0.0)
            for n in names
        ]
        ax.bar([j + i * width for j in range(len(names))], shares, width, label=f"{rows} rows")
    ax.axhline(PEAK_TARGET, color="C3", linestyle="--", label=f"target {PEAK_TARGET:.0f}% (prefill)")
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(names))], names, fontsize=8, rotation=20)
    ax.set_ylabel("% of the measured peak")
    ax.set_title(f"CPU linear kernels, {threads} thread(s), against their arithmetic's peak")
    ax.legend(fontsize=7)
    save_figure(fig, path)


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
    add_list_flag(ap, "--rows", "row counts against oneDNN", "1,4,16,32,64,256,900", "1,16")
    add_list_flag(ap, "--kernel-rows", "row counts against the peak", "1,16,64,512,2048", "1,96")
    cores = str(os.cpu_count() or 1)
    add_list_flag(ap, "--threads", "thread counts of the peak comparison", cores, cores)
    add_list_flag(ap, "--kernels", f"kernels against the peak, of {', '.join(KERNELS)}", "all", "all")
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
    names = list_flag(args, "--kernels", str)
    names = list(KERNELS) if names == ["all"] else names
    if not set(names) <= set(KERNELS):
        ap.error(f"--kernels takes names among {list(KERNELS)}")
    results = [measure(m, sizes["layers"], sizes["repeats"], mode) for m in rows]

    skipped = {n: why for n in names if (why := unavailable(KERNELS[n])) is not None}
    for n, why in skipped.items():
        print(f"skipping {n}: {why}")
    kernels = [KERNELS[n] for n in names if n not in skipped]
    default_threads = torch.get_num_threads()
    peaks: dict[int, dict[str, float]] = {}
    kernel_results: list[dict[str, Any]] = []
    for threads in list_flag(args, "--threads", int):
        peaks[threads], found = measure_against_peaks(
            threads, kernels, list_flag(args, "--kernel-rows", int), sizes
        )
        kernel_results += found
    torch.set_num_threads(default_threads)
    slots = cpu_peak.vnni_slots(sizes["peak_ms"] / 2e3) if kernel_results else None
    tables = [peak_table(peaks), kernel_table(kernel_results)] + ([slots_table(slots)] if slots else [])

    args.out_dir.mkdir(parents=True, exist_ok=True)
    figure, peak_figure = f"{NAME}.png", f"{NAME}_peak.png"
    plot(args.out_dir / figure, results, args.isa)
    figures = [figure]
    if kernel_results:
        plot_peaks(args.out_dir / peak_figure, kernel_results)
        figures.append(peak_figure)
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
    notes = [f"{int(r['rows'])} rows: panels **{r['speedup']:.2f}x** oneDNN" for r in results]
    notes += peak_notes(kernel_results)
    notes += [f"{KERNELS[n].label} skipped: {why}" for n, why in skipped.items()]
    save_result(
        args.out_dir,
        NAME,
        {
            "isa": args.isa,
            "results": results,
            "peaks": {str(t): found for t, found in peaks.items()},
            "kernels": kernel_results,
            "skipped_kernels": skipped,
            "vnni_slots": slots,
        },
        tables=[table, *tables],
        notes=notes,
        figures=figures,
        sizes=sizes,
    )


if __name__ == "__main__":
    main()
