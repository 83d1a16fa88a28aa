"""Time from a fresh process to a ready engine on the embedded default model (GGUF conversion
already cached), the figure users feel on every restart.

    python benchmarks/bench_startup.py --runs 3
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys

_CHILD = (
    "import time; t0 = time.perf_counter(); import radixlm_runtime as rt; "
    "e = rt.Engine(log_level='warning'); print(time.perf_counter() - t0)"
)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=3)
    args = ap.parse_args()
    # The first start may convert the GGUF; it is not what this measures.
    subprocess.run([sys.executable, "-c", _CHILD], check=True, capture_output=True)
    times = []
    for _ in range(args.runs):
        out = subprocess.run([sys.executable, "-c", _CHILD], check=True, capture_output=True, text=True)
        times.append(float(out.stdout.strip().splitlines()[-1]))
    print(f"import + Engine() to ready: median {statistics.median(times):.2f}s over {args.runs} runs {times}")


if __name__ == "__main__":
    main()
