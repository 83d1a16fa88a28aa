"""Host overhead of a pure-decode step: how much of one scheduler step is spent outside the model's
forward, and how many times the step reads tensor data back to the host.

B requests (distinct short prompts, greedy, ignore_eos) are prefilled together and then decode
together; only steps whose single forward holds exactly B tokens (every request decoding one token)
are kept. Per step: wall time of `engine.scheduler.step`, time inside `engine.runner.forward` (the
model's forward, or the replay of its CUDA graph), the difference (host overhead: batch building,
sampling, bookkeeping) and the number of host reads: calls of `Tensor.tolist`, `.item`, `.__bool__`,
`.__int__`, `.__float__`, `.__index__` and `.numpy`, plus `.cpu` / `.to` copies from another device
to the CPU. On CUDA each of those is a device-to-host synchronization, so the count says how many
times a step would stall the GPU pipeline; on CPU they are only counted.

Only those two hooks are used (scheduler.step and the executor's forward), wrapped on the instances,
so the benchmark survives changes to what happens between them. On CUDA the forward is timed to the
end of its kernels, so steps do not overlap while measured.

    python benchmarks/bench_host_overhead.py                      # B = 8, 32, 128; 24 decode steps each
    python benchmarks/bench_host_overhead.py --verbose            # + the top 10 call sites of host reads
    python benchmarks/bench_host_overhead.py --tiny               # B = 2, 4; a few steps
    python benchmarks/bench_host_overhead.py --device cuda --model $RADIXLM_GPU_MODEL --batch-sizes 8,64,256
"""

from __future__ import annotations

import functools
import statistics
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from common import (
    REPO_ROOT,
    BenchModel,
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

NAME = "host_overhead"
SIZES = {
    "steps": Size(24, 4, "pure-decode steps measured per batch size"),
}
DEFAULT_BATCH_SIZES = "8,32,128"
TINY_BATCH_SIZES = "2,4"
PROMPT = "Count to one hundred: {i}"
TOP_SITES = 10

# Methods that read tensor data back to the host (always counted), and copies that count only when
# they move data from another device to the CPU.
READ_METHODS = ("tolist", "item", "__bool__", "__int__", "__float__", "__index__", "numpy")
COPY_METHODS = ("cpu", "to")
_TORCH_DIR = str(Path(torch.__file__).resolve().parent)
_THIS_FILE = str(Path(__file__).resolve())


@dataclass
class ReadCounter:
    """Counts host reads made by one thread while `patched()` is active. Calls nested inside a
    counted call (`tolist` calling `__index__`, `__array__` calling `numpy`) are not counted again."""

    sites: bool = False  # also record the caller's file:line (slower: walks the stack)
    count: int = 0
    by_method: Counter[str] = field(default_factory=Counter)
    by_site: Counter[str] = field(default_factory=Counter)
    _depth: int = 0
    _thread: int | None = None

    def reset(self) -> None:
        self.count = 0
        self.by_method = Counter()
        self.by_site = Counter()

    def _record(self, name: str) -> None:
        self.count += 1
        self.by_method[name] += 1
        if self.sites:
            self.by_site[_call_site()] += 1

    def _wrap(self, name: str, original: Callable[..., Any]) -> Callable[..., Any]:
        is_copy = name in COPY_METHODS

        @functools.wraps(original)
        def wrapper(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            if self._depth or threading.get_ident() != self._thread:
                return original(tensor, *args, **kwargs)
            self._depth += 1
            try:
                result = original(tensor, *args, **kwargs)
            finally:
                self._depth -= 1
            if not is_copy:
                self._record(name)
            elif (
                tensor.device.type != "cpu"
                and isinstance(result, torch.Tensor)
                and result.device.type == "cpu"
            ):
                self._record(f"{name} (to cpu)")
            return result

        return wrapper

    @contextmanager
    def patched(self) -> Iterator[None]:
        """Patches torch.Tensor for the duration of the block only, restoring it even on error."""
        saved: dict[str, Any] = {}
        self._thread = threading.get_ident()
        try:
            for name in READ_METHODS + COPY_METHODS:
                saved[name] = torch.Tensor.__dict__.get(name)
                setattr(torch.Tensor, name, self._wrap(name, getattr(torch.Tensor, name)))
            yield
        finally:
            for name, original in saved.items():
                if original is None:
                    delattr(torch.Tensor, name)  # inherited from torch._C.TensorBase
                else:
                    setattr(torch.Tensor, name, original)
            self._thread = None


def _call_site() -> str:
    """file:line of the first frame outside torch and this file: the code that asked for the read."""
    frame = sys._getframe(2)
    while frame is not None and (
        frame.f_code.co_filename.startswith(_TORCH_DIR) or frame.f_code.co_filename == _THIS_FILE
    ):
        frame = frame.f_back
    if frame is None:
        return "?"
    path = Path(frame.f_code.co_filename)
    shown = path.relative_to(REPO_ROOT).as_posix() if path.is_relative_to(REPO_ROOT) else path.name
    return f"{shown}:{frame.f_lineno} ({frame.f_code.co_name})"


@dataclass
class StepRecord:
    step_ms: float
    forward_ms: float
    forward_tokens: list[int]  # tokens of each forward the step ran (one, for a normal step)
    host_reads: int
    reads_in_forward: int
    by_method: dict[str, int]
    by_site: dict[str, int]


class StepProbe:
    """Wraps `engine.scheduler.step` and `engine.runner.forward` on the instances and records
    every step while `recording` is set."""

    def __init__(self, engine: Any, sites: bool) -> None:
        self.engine = engine
        self.reads = ReadCounter(sites=sites)
        self.records: list[StepRecord] = []
        self.recording = False
        self._forward_s = 0.0
        self._forward_tokens: list[int] = []
        self._forward_reads = 0
        scheduler, runner = engine.scheduler, engine.runner
        self._step: Callable[[], Any] = scheduler.step
        self._forward: Callable[..., Any] = runner.forward
        self._cuda = runner.device.type == "cuda"
        scheduler.step = self.step
        runner.forward = self.forward

    def close(self) -> None:
        """Removes the instance attributes, so the class methods are used again."""
        del self.engine.scheduler.step
        del self.engine.runner.forward

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if not self.recording:
            return self._forward(*args, **kwargs)
        reads_before = self.reads.count
        self._forward_tokens.append(int(args[0].input_ids.numel()))
        if self._cuda:  # time the forward's kernels, not only their launch
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        try:
            out = self._forward(*args, **kwargs)
            if self._cuda:
                torch.cuda.synchronize()
        finally:
            self._forward_s += time.perf_counter() - t0
            self._forward_reads += self.reads.count - reads_before
        return out

    def step(self) -> Any:
        if not self.recording:
            return self._step()
        self.reads.reset()
        self._forward_s, self._forward_tokens, self._forward_reads = 0.0, [], 0
        with self.reads.patched():
            t0 = time.perf_counter()
            out = self._step()
            wall = time.perf_counter() - t0
        self.records.append(
            StepRecord(
                step_ms=1e3 * wall,
                forward_ms=1e3 * self._forward_s,
                forward_tokens=self._forward_tokens,
                host_reads=self.reads.count,
                reads_in_forward=self._forward_reads,
                by_method=dict(self.reads.by_method),
                by_site=dict(self.reads.by_site),
            )
        )
        return out


def measure(engine: Any, probe: StepProbe, batch_size: int, steps: int) -> dict[str, Any]:
    """Runs B requests that decode together for `steps` steps after their prefill; summarizes the
    steps whose one forward held exactly B tokens."""
    engine.flush_cache()
    # The prefill step samples each request's first token; every later token is one decode step.
    params = {"temperature": 0, "max_new_tokens": steps + 1, "ignore_eos": True}
    probe.records = []
    probe.recording = True
    try:
        outs = engine.generate(prompt=[PROMPT.format(i=i) for i in range(batch_size)], sampling_params=params)
    finally:
        probe.recording = False
    assert all(o["meta_info"]["completion_tokens"] == steps + 1 for o in outs)
    kept = [r for r in probe.records if r.forward_tokens == [batch_size]]
    if not kept:
        raise RuntimeError(f"B={batch_size}: no pure-decode step ran (were all requests admitted at once?)")
    overhead = [r.step_ms - r.forward_ms for r in kept]
    reads = [r.host_reads for r in kept]
    by_method: Counter[str] = Counter()
    by_site: Counter[str] = Counter()
    for r in kept:
        by_method.update(r.by_method)
        by_site.update(r.by_site)
    return {
        "batch_size": batch_size,
        "steps_total": len(probe.records),
        "steps_kept": len(kept),
        "step_ms": statistics.median(r.step_ms for r in kept),
        "forward_ms": statistics.median(r.forward_ms for r in kept),
        "host_overhead_ms": statistics.median(overhead),
        "host_share": statistics.median(o / r.step_ms for o, r in zip(overhead, kept)),
        "host_reads_median": statistics.median(reads),
        "host_reads_max": max(reads),
        "host_reads_in_forward_median": statistics.median(r.reads_in_forward for r in kept),
        # Totals over the kept steps; divide by steps_kept for a per-step figure.
        "host_reads_by_method": dict(by_method.most_common()),
        "host_reads_by_site": dict(by_site.most_common(TOP_SITES)),
        "per_step": {
            "step_ms": [r.step_ms for r in kept],
            "forward_ms": [r.forward_ms for r in kept],
            "host_reads": reads,
        },
    }


def plot(path: Path, results: list[dict[str, Any]]) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6, 3.5))
    xs = range(len(results))
    fwd = [r["forward_ms"] for r in results]
    host = [r["host_overhead_ms"] for r in results]
    ax.bar(xs, fwd, label="model forward")
    ax.bar(xs, host, bottom=fwd, label="host overhead")
    for x, r in zip(xs, results):
        ax.annotate(
            f"{r['host_share']:.0%} host\n{r['host_reads_median']:g} reads",
            (x, r["forward_ms"] + r["host_overhead_ms"]),
            ha="center",
            va="bottom",
            fontsize=8,
        )
    ax.set_xticks(list(xs), [f"B={r['batch_size']}" for r in results])
    ax.set_ylabel("ms per decode step (median)")
    ax.set_title("Pure-decode step: model forward vs host overhead")
    ax.margins(y=0.25)
    ax.legend(fontsize=8)
    save_figure(fig, path)


def main(argv: list[str] | None = None) -> None:
    ap = bench_parser(__doc__, SIZES)
    add_list_flag(ap, "--batch-sizes", "batch sizes", DEFAULT_BATCH_SIZES, TINY_BATCH_SIZES)
    ap.add_argument("--device", default="cpu", help="Engine device (the figures in the README: cpu).")
    ap.add_argument(
        "--model",
        default=None,
        help="Model directory or .gguf (default: the embedded model). A tiny random model makes the "
        "forward small so the host path shows; on a GPU, $RADIXLM_GPU_MODEL.",
    )
    ap.add_argument("--verbose", action="store_true", help=f"Print the top {TOP_SITES} host-read call sites.")
    args, sizes = parse_sizes(ap, argv, SIZES)
    batch_sizes = list_flag(args, "--batch-sizes", int)
    if not batch_sizes or min(batch_sizes) < 1:
        ap.error("--batch-sizes takes positive integers")

    # Measure the runtime beside this script even when another checkout is the installed one (as
    # run_all's child_env does for its children).
    if str(REPO_ROOT) not in sys.path:
        sys.path.insert(0, str(REPO_ROOT))
    import radixlm_runtime as rt

    largest = max(batch_sizes)
    engine = rt.Engine(
        args.model,
        device=args.device,
        log_level="warning",
        max_running_requests=largest,
        # Every prompt is a handful of tokens: all of them prefill in one step, whatever the step
        # times measured so far (a loaded machine's would size the prefill steps smaller).
        chunked_prefill_size=max(1024, 32 * largest),
        prefill_step_target_ms=0,
    )
    # Warm-up outside the hooks: first-call allocations and kernel selection.
    engine.generate(prompt=[PROMPT.format(i=i) for i in range(4)], sampling_params={"max_new_tokens": 4})
    probe = StepProbe(engine, sites=args.verbose)
    results: list[dict[str, Any]] = []
    try:
        for b in batch_sizes:
            r = measure(engine, probe, b, sizes["steps"])
            results.append(r)
            print(
                f"B={b}: step {r['step_ms']:.2f} ms, forward {r['forward_ms']:.2f} ms, host "
                f"{r['host_overhead_ms']:.2f} ms ({r['host_share']:.0%}), {r['host_reads_median']:g} "
                f"host reads/step ({r['steps_kept']} of {r['steps_total']} steps kept)",
                flush=True,
            )
            if args.verbose:
                print(f"  host reads per step by call site (top {TOP_SITES}):")
                for site, n in r["host_reads_by_site"].items():
                    print(f"    {n / r['steps_kept']:7.2f}  {site}")
                methods = ", ".join(
                    f"{m} {n / r['steps_kept']:.2f}" for m, n in r["host_reads_by_method"].items()
                )
                print(f"  by method: {methods}")
    finally:
        probe.close()
        engine.shutdown()
    table = Table(
        f"Pure-decode step on {args.device}: median of {sizes['steps']} steps per batch size",
        [
            "batch size",
            "step ms",
            "model forward ms",
            "host overhead ms",
            "host share",
            "host reads / step (median)",
            "host reads / step (max)",
        ],
        [
            [
                str(r["batch_size"]),
                fmt(r["step_ms"]),
                fmt(r["forward_ms"]),
                fmt(r["host_overhead_ms"]),
                fmt(100 * r["host_share"], ".0f", "%"),
                fmt(r["host_reads_median"], "g"),
                str(r["host_reads_max"]),
            ]
            for r in results
        ],
    )
    print("\n" + table.markdown())
    notes = [
        f"B={r['batch_size']}: host overhead {r['host_overhead_ms']:.2f} ms of a {r['step_ms']:.2f} ms step "
        f"({r['host_share']:.0%}); {r['host_reads_median']:g} host reads per step "
        f"({r['host_reads_in_forward_median']:g} inside the model forward)"
        for r in results
    ]
    figure = f"{NAME}.png"
    plot(args.out_dir / figure, results)
    save_result(
        args.out_dir,
        NAME,
        {
            "batch_sizes": batch_sizes,
            "device": args.device,
            "model": args.model,
            "runtime_path": str(Path(rt.__file__).parent),
            "results": results,
        },
        [table],
        notes,
        [figure],
        sizes,
        BenchModel(args.model),
    )


if __name__ == "__main__":
    main()
