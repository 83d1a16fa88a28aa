"""Time from a fresh process to a ready engine on the embedded default model (GGUF conversion already
cached), the figure users feel on every restart.

    python benchmarks/bench_startup.py              # median of 3 fresh processes
    python benchmarks/bench_startup.py --tiny       # one
"""

from __future__ import annotations

import statistics
import subprocess
import sys
from pathlib import Path

from common import Size, Table, bench_parser, child_env, fmt, parse_sizes, pyplot, save_figure, save_result

NAME = "startup"
SIZES = {"runs": Size(3, 1, "fresh processes timed")}
TARGET_S = 5.0
_CHILD = (
    "import time; t0 = time.perf_counter(); import radixlm_runtime as rt; "
    "e = rt.Engine(log_level='warning'); print(time.perf_counter() - t0)"
)


def time_child() -> float:
    out = subprocess.run(
        [sys.executable, "-c", _CHILD], check=True, capture_output=True, text=True, env=child_env()
    )
    return float(out.stdout.strip().splitlines()[-1])


def plot(path: Path, times: list[float]) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(5, 3.2))
    ax.bar([str(i + 1) for i in range(len(times))], times, color="C0")
    ax.axhline(TARGET_S, color="C3", linestyle="--", label=f"target {TARGET_S:g} s")
    ax.set_xlabel("fresh process")
    ax.set_ylabel("import + Engine() to ready (s)")
    ax.set_title("Start-up, GGUF conversion cached")
    ax.legend()
    save_figure(fig, path)


def main(argv: list[str] | None = None) -> None:
    ap = bench_parser(__doc__, SIZES)
    args, sizes = parse_sizes(ap, argv, SIZES)
    # The first start may convert the GGUF; that one-off cost is not what this measures.
    first = time_child()
    times = [time_child() for _ in range(sizes["runs"])]
    median = statistics.median(times)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    figure = f"{NAME}.png"
    plot(args.out_dir / figure, times)
    table = Table(
        "Start-up: fresh process to a ready Engine()",
        ["median s", "min s", "max s", "runs", "target s"],
        [[fmt(median), fmt(min(times)), fmt(max(times)), str(len(times)), fmt(TARGET_S, "g")]],
    )
    save_result(
        args.out_dir,
        NAME,
        {"times_s": times, "median_s": median, "first_start_s": first, "target_s": TARGET_S},
        tables=[table],
        notes=[
            f"median start-up **{median:.2f} s** over {len(times)} fresh processes (target < {TARGET_S:g} s)"
        ],
        figures=[figure],
        sizes=sizes,
    )


if __name__ == "__main__":
    main()
