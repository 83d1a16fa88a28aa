"""Batch and cache invariance: whether a request's greedy tokens and logprobs depend on what it is
batched with and on whether its prefix came from the radix cache, by default and under
`--deterministic`, on the CPU or a GPU (issue 14 asks it of CUDA: 100 % under `--deterministic`).

N prompts share one P-token prefix. An engine per (dtype, mode) runs each variant in turn:
  alone, uncached   each prompt alone, the cache flushed before it: the reference
  alone, cached     each prompt alone again, its prefix (the last one: its whole prompt) cached
  batched           all prompts in one call
  reversed          all prompts in one call, in reverse order
and the table counts, per variant, the prompts whose tokens (and tokens and logprobs, bit for bit)
equal the reference. The batched call's wall time is kept, so the cost of `--deterministic` shows.

    python benchmarks/bench_invariance.py                          # float32 on CPU; bf16 + fp32 on CUDA
    python benchmarks/bench_invariance.py --dtypes bfloat16 --model $RADIXLM_GPU_MODEL
    python benchmarks/bench_invariance.py --tiny

The model is --model, else $RADIXLM_GPU_MODEL, else the embedded default model.
"""

from __future__ import annotations

import gc
import os
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from common import (
    REPO_ROOT,
    BenchModel,
    Size,
    Table,
    add_list_flag,
    bench_parser,
    list_flag,
    parse_sizes,
    pyplot,
    save_figure,
    save_result,
)

NAME = "invariance"
SIZES = {
    "prompts": Size(12, 3, "prompts sharing the prefix"),
    "prefix_tokens": Size(300, 32, "tokens of the shared prefix", scales=False),
    "new_tokens": Size(48, 4, "greedy tokens per prompt", scales=False),
}
MODES = {"default": {}, "deterministic": {"deterministic": True}}
VARIANTS = ("alone, uncached", "alone, cached", "batched", "reversed")
PREFIX_TEXT = (
    "You are a careful assistant. Read the notes below, then answer the question after them in one "
    "short sentence, exactly and without repeating the question. Notes: a radix tree keeps the key "
    "and value cache of every prompt, so requests that share a prefix reuse it instead of computing "
    "it again; the scheduler orders waiting requests so that those hits happen as often as possible. "
)

# (token ids, logprobs) of one prompt's output.
Output = tuple[list[int], list[float]]
# Each variant's outputs (in prompt order) and wall time in seconds.
Runs = dict[str, tuple[list[Output], float]]


@dataclass
class VariantResult:
    dtype: str
    mode: str
    variant: str
    same_tokens: int
    same_logprobs: int  # tokens and logprobs both equal the reference's
    prompts: int
    wall_s: float  # of the whole variant


def build_prompts(tokenizer: Any, prompts: int, prefix_tokens: int) -> list[list[int]]:
    prefix: list[int] = []
    while len(prefix) < prefix_tokens:
        prefix += tokenizer.encode(PREFIX_TEXT, add_special_tokens=False)
    prefix = prefix[:prefix_tokens]
    return [
        prefix + tokenizer.encode(f" Question {i}: what is {i + 2} times {i + 7}?", add_special_tokens=False)
        for i in range(prompts)
    ]


def outputs(engine: Any, prompts: list[list[int]], new_tokens: int) -> list[Output]:
    params = {"max_new_tokens": new_tokens, "temperature": 0, "ignore_eos": True}
    outs = engine.generate(input_ids=prompts, sampling_params=params, return_logprob=True)
    return [
        (
            [tok for _, tok, _ in o["meta_info"]["output_token_logprobs"]],
            [lp for lp, _, _ in o["meta_info"]["output_token_logprobs"]],
        )
        for o in outs
    ]


def run_variants(engine: Any, prompts: list[list[int]], new_tokens: int) -> Runs:
    results: Runs = {}
    for variant in VARIANTS:
        t0 = time.perf_counter()
        if variant == "alone, uncached":
            got = []
            for p in prompts:
                engine.flush_cache()
                got += outputs(engine, [p], new_tokens)
        elif variant == "alone, cached":
            got = [outputs(engine, [p], new_tokens)[0] for p in prompts]
        elif variant == "batched":
            got = outputs(engine, prompts, new_tokens)
        else:
            got = outputs(engine, prompts[::-1], new_tokens)[::-1]
        results[variant] = (got, time.perf_counter() - t0)
    return results


def compare(dtype: str, mode: str, runs: Runs) -> list[VariantResult]:
    reference = runs[VARIANTS[0]][0]
    rows = []
    for variant, (got, wall) in runs.items():
        same_tokens = sum(g[0] == r[0] for g, r in zip(got, reference, strict=True))
        same_logprobs = sum(g == r for g, r in zip(got, reference, strict=True))
        rows.append(VariantResult(dtype, mode, variant, same_tokens, same_logprobs, len(reference), wall))
    return rows


def plot(path: Path, results: list[VariantResult]) -> None:
    plt = pyplot()
    groups = sorted({(r.dtype, r.mode) for r in results}, key=lambda g: (g[0], list(MODES).index(g[1])))
    fig, ax = plt.subplots(figsize=(7, 3.5))
    width = 0.8 / len(groups)
    for g, (dtype, mode) in enumerate(groups):
        rows = [r for r in results if (r.dtype, r.mode) == (dtype, mode) and r.variant != VARIANTS[0]]
        xs = [i + g * width for i in range(len(rows))]
        ax.bar(xs, [100 * r.same_logprobs / r.prompts for r in rows], width, label=f"{dtype}, {mode}")
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(VARIANTS) - 1)], list(VARIANTS[1:]))
    ax.set_ylabel("% prompts bit-identical to alone, uncached")
    ax.set_ylim(0, 105)
    ax.set_title("Same tokens and logprobs whatever the batch and cache")
    ax.legend(fontsize=8)
    save_figure(fig, path)


def main(argv: list[str] | None = None) -> None:
    ap = bench_parser(__doc__, SIZES)
    ap.add_argument(
        "--device", default="auto", help="Engine device: auto (CUDA when there is one), cpu, cuda."
    )
    add_list_flag(
        ap, "--dtypes", "engine dtypes (auto: bfloat16,float32 on CUDA, float32 on CPU)", "auto", "auto"
    )
    ap.add_argument(
        "--model", default=None, help="Model path (default $RADIXLM_GPU_MODEL, else the embedded one)."
    )
    args, sizes = parse_sizes(ap, argv, SIZES)
    # Measure the runtime beside this script even when another checkout is the installed one.
    if str(REPO_ROOT) not in sys.path:
        sys.path.insert(0, str(REPO_ROOT))
    import torch

    import radixlm_runtime as rt
    from radixlm_runtime.executor.model_runner import resolve_device
    from radixlm_runtime.io.tokenizer import load_tokenizer
    from radixlm_runtime.models.loader import resolve_model_path

    device = resolve_device(args.device)
    dtypes = list_flag(args, "--dtypes", str)
    if dtypes == ["auto"]:
        dtypes = ["bfloat16", "float32"] if device.type == "cuda" else ["float32"]
    model_dir = resolve_model_path(args.model or os.environ.get("RADIXLM_GPU_MODEL"))
    prompts = build_prompts(load_tokenizer(model_dir), sizes["prompts"], sizes["prefix_tokens"])

    results: list[VariantResult] = []
    for dtype in dtypes:
        for mode, flags in MODES.items():
            engine = rt.Engine(str(model_dir), device=str(device), dtype=dtype, log_level="warning", **flags)
            try:
                outputs(engine, prompts[:1], 2)  # warm-up: first-call allocations and kernel builds
                rows = compare(dtype, mode, run_variants(engine, prompts, sizes["new_tokens"]))
            finally:
                engine.shutdown()
                del engine
                gc.collect()
                if device.type == "cuda":
                    torch.cuda.empty_cache()
            results += rows
            for r in rows:
                print(
                    f"{dtype} {mode} {r.variant}: tokens {r.same_tokens}/{r.prompts}, "
                    f"logprobs {r.same_logprobs}/{r.prompts} ({r.wall_s:.2f} s)",
                    flush=True,
                )

    n = sizes["prompts"]
    table = Table(
        f"{n} prompts on a {sizes['prefix_tokens']}-token shared prefix, {sizes['new_tokens']} greedy tokens "
        f"each, on {device.type}: prompts equal to the alone-uncached run",
        ["dtype", "mode", "variant", "same tokens", "same tokens and logprobs", "wall s"],
        [
            [r.dtype, r.mode, r.variant, f"{r.same_tokens}/{n}", f"{r.same_logprobs}/{n}", f"{r.wall_s:.2f}"]
            for r in results
            if r.variant != VARIANTS[0]
        ],
    )
    notes = []
    for dtype in dtypes:
        det = [r for r in results if r.dtype == dtype and r.mode == "deterministic"]
        exact = all(r.same_logprobs == r.prompts for r in det)
        batched = {r.mode: r.wall_s for r in results if r.dtype == dtype and r.variant == "batched"}
        notes.append(
            f"{dtype}: --deterministic {'bit-identical in every variant' if exact else 'NOT bit-identical'}; "
            f"its batched call {batched['deterministic'] / batched['default']:.2f}x the default's wall time"
        )
    figure = f"{NAME}.png"
    plot(args.out_dir / figure, results)
    save_result(
        args.out_dir,
        NAME,
        {
            "device": device.type,
            "dtypes": dtypes,
            "runtime_path": str(Path(rt.__file__).parent),
            "results": [asdict(r) for r in results],
        },
        [table],
        notes,
        [figure],
        sizes,
        BenchModel(args.model or os.environ.get("RADIXLM_GPU_MODEL")),
    )


if __name__ == "__main__":
    main()
