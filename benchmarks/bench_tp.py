"""Tensor parallelism on the CPU: --tp-size 2 against 1, prefill and decode step times, and the time
rank 0 spends in the model's collectives (gloo all-reduces after the embedding and each o_proj and
down_proj, the gather of the logits) per step, with that time's share of the step.

On a 2-core machine two ranks take one core each (the cores / --tp-size by default), so TP2 does the
same arithmetic on the same cores as TP1 plus the communication: expect no speed-up; the figure that
matters is the communication share. Rank 0's collective time counts the time it waits in them for
rank 1 too (the ranks' work differs where the heads split unevenly: SmolLM2-135M's 3 KV heads go 2 + 1).
Both run the decoder layers in the one-call C++ decoder (under TP it calls the all-reduces back
between layers), or both from Python where it does not serve the model: the "decoder" column says.

Each step is timed around the scheduler's `step` (plan, forward on every rank, sampling, bookkeeping).
Prefill: one fresh prompt of --prompt-tokens tokens in one step; decode: --batch requests decoding
together (ignore_eos), the steps after their prefill.

    python benchmarks/bench_tp.py          # default model: 512-token prefill, decode at batch 1 and 8
    python benchmarks/bench_tp.py --tiny   # 32-token prefill, batch 1 and 2, a few steps
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from typing import Any

from common import (
    REPO_ROOT,
    BenchModel,
    Size,
    Table,
    add_list_flag,
    add_model_flag,
    bench_parser,
    fmt,
    list_flag,
    parse_sizes,
    pyplot,
    save_figure,
    save_result,
)

NAME = "tp"
SIZES = {
    "prompt_tokens": Size(512, 32, "prompt tokens of a prefill step", scales=False),
    "prefills": Size(5, 2, "prefill steps measured"),
    "steps": Size(32, 4, "decode steps measured per batch size"),
}
TP_SIZES = (1, 2)


class StepTimer:
    """Times each scheduler step, and rank 0's time in the collectives during it (tp > 1)."""

    def __init__(self, engine: Any) -> None:
        self.scheduler = engine.scheduler
        self.group = getattr(engine.runner, "group", None)
        self.steps: list[tuple[float, float, int]] = []  # (step s, collective s, collectives)
        inner = self.scheduler.step

        def step() -> Any:
            if self.group is not None:
                self.group.reset_timing()
            t0 = time.perf_counter()
            out = inner()
            elapsed = time.perf_counter() - t0
            comm = (self.group.comm_s, self.group.comm_calls) if self.group is not None else (0.0, 0)
            self.steps.append((elapsed, *comm))
            return out

        self.scheduler.step = step

    def take(self) -> list[tuple[float, float, int]]:
        steps, self.steps = self.steps, []
        return steps


def _summary(steps: list[tuple[float, float, int]]) -> dict[str, Any]:
    step = statistics.median(s for s, _, _ in steps)
    comm = statistics.median(c for _, c, _ in steps)
    return {
        "step_ms": step * 1e3,
        "comm_ms": comm * 1e3,
        "comm_share": comm / step,
        "collectives_per_step": statistics.median(n for _, _, n in steps),
        "steps": len(steps),
        "per_step_ms": [s * 1e3 for s, _, _ in steps],
    }


def measure(model: BenchModel, tp: int, sizes: dict[str, int], batches: list[int]) -> dict[str, Any]:
    import radixlm_runtime as rt

    prompt_tokens = sizes["prompt_tokens"]
    engine = rt.Engine(
        model.path,
        tp_size=tp,
        log_level="warning",
        max_running_requests=max(batches),
        chunked_prefill_size=max(1024, prompt_tokens),
        prefill_step_target_ms=0,  # a prompt prefills in one step
        max_total_tokens=max(4096, 2 * prompt_tokens + max(batches) * (sizes["steps"] + 64)),
    )
    try:
        vocab = engine.runner.info.vocab_size
        decoder = "C++ one call" if _runner(engine).model.cpu_decoder is not None else "Python"
        layers = _runner(engine).config.num_layers
        # Warm-up: a prefill of the measured length, then a few decode steps.
        engine.generate(input_ids=[[7] * prompt_tokens] * 2, sampling_params={"max_new_tokens": 4})
        timer = StepTimer(engine)
        # Prefill: distinct prompts (no radix hit), one token sampled, so each is one step.
        for i in range(sizes["prefills"]):
            ids = [(i * 7919 + j * 31) % (vocab - 100) + 50 for j in range(prompt_tokens)]
            engine.generate(input_ids=ids, sampling_params={"max_new_tokens": 1})
        prefill = _summary(timer.take())
        decode = {}
        for b in batches:
            prompts = [[(b * 1000 + i * 13 + j) % (vocab - 100) + 50 for j in range(8)] for i in range(b)]
            params = {"max_new_tokens": sizes["steps"] + 1, "ignore_eos": True, "temperature": 0}
            engine.generate(input_ids=prompts, sampling_params=params)
            decode[str(b)] = _summary(timer.take()[1:])  # the first step is the batch's prefill
    finally:
        engine.shutdown()
    return {"tp": tp, "decoder": decoder, "layers": layers, "prefill": prefill, "decode": decode}


def _runner(engine: Any) -> Any:
    """The process's ModelRunner (rank 0's under TP)."""
    return getattr(engine.runner, "runner", engine.runner)


def main(argv: list[str] | None = None) -> None:
    ap = bench_parser(__doc__, SIZES)
    add_model_flag(ap)
    add_list_flag(ap, "--batches", "decode batch sizes", "1,8", "1,2")
    args, sizes = parse_sizes(ap, argv, SIZES)
    batches = list_flag(args, "--batches", int)
    if str(REPO_ROOT) not in sys.path:
        sys.path.insert(0, str(REPO_ROOT))
    model = BenchModel(args.model_path)
    load = os.getloadavg()
    results = [measure(model, tp, sizes, batches) for tp in TP_SIZES]

    rows, labels, compute, comm = [], [], [], []
    for r in results:
        phases = [(f"prefill {sizes['prompt_tokens']} tokens", r["prefill"])]
        phases += [(f"decode batch {b}", s) for b, s in r["decode"].items()]
        for phase, s in phases:
            rows.append(
                [
                    str(r["tp"]),
                    phase,
                    r["decoder"],
                    fmt(s["step_ms"]),
                    fmt(s["comm_ms"]),
                    fmt(100 * s["comm_share"], ".1f", "%"),
                    f"{s['collectives_per_step']:g}",
                ]
            )
            labels.append(f"TP{r['tp']}\n{phase}")
            compute.append(s["step_ms"] - s["comm_ms"])
            comm.append(s["comm_ms"])
    table = Table(
        "TP2 against TP1 on the CPU: median step time and rank 0's time in collectives",
        ["tp", "step", "decoder", "step ms", "collectives ms", "collectives share", "collectives / step"],
        rows,
    )
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(max(6, 1.3 * len(labels)), 4))
    ax.bar(labels, compute, label="compute (rest of the step)")
    ax.bar(labels, comm, bottom=compute, label="collectives (rank 0)")
    ax.set_ylabel("ms per step (median)")
    ax.set_title("Tensor parallelism on CPU (gloo): step time and its communication")
    ax.legend()
    ax.tick_params(axis="x", labelsize=7)
    figure = f"{NAME}.png"
    save_figure(fig, args.out_dir / figure)
    layers = results[0]["layers"]
    notes = [
        f"Load average when it started: {load[0]:.2f} / {load[1]:.2f} / {load[2]:.2f} (1/5/15 min) on "
        f"{os.cpu_count()} logical cores; each rank runs on cores / tp threads.",
        f"Collectives per step under TP: {2 * layers + 2} ({layers} layers: one all-reduce after each "
        "attention and each MLP block, one after the vocab-parallel embedding, one gather of the logits).",
        "Rank 0's collective time includes its wait for the other rank to reach each collective.",
    ]
    save_result(
        args.out_dir,
        model.result_name(NAME),
        {"results": results, "batches": batches},
        [table],
        notes,
        [figure],
        sizes,
        model,
    )


if __name__ == "__main__":
    main()
