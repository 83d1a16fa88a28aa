"""--kv-cache-dtype int8 against float32 KV (issue 29), on the same float32 weights:

- memory: bytes per token of the KV pool and tokens per GiB, float32 / bf16 (--dtype bfloat16 on CPU) /
  int8 (codes plus a float32 scale per token and kv head for K and for V), as the pool sizes itself;
- accuracy: few-shot GSM8K and MMLU (bench_fewshot_engine.py's workloads and systems: `radixlm` and
  `radixlm_int8_kv`), >= 200 questions each by default; the accuracy gap in questions per 100 and the
  greedy agreement with float32 KV (GSM8K: identical outputs, and tokens equal up to the first
  divergence over the longer output's; MMLU: identical answers);
- decode throughput at batch 32 over long contexts (2,048 distinct random tokens each, cached, so the
  timed run is the decode): output tokens per second, and the KV bytes a decode step reads.

    python benchmarks/bench_kv_quant.py            # 200 GSM8K + 200 MMLU questions, batch 32 x 2k decode
    python benchmarks/bench_kv_quant.py --tiny     # a few questions, a tiny decode, to check it runs
    python benchmarks/bench_kv_quant.py --skip-accuracy   # memory and decode throughput only
"""

from __future__ import annotations

import gc
import math
import random
import time
from typing import Any

import torch
from bench_fewshot_engine import agreement, gsm8k_metrics, make_system, mmlu_metrics
from common import (
    BenchModel,
    Size,
    Table,
    add_model_flag,
    bench_parser,
    common_prefix_len,
    fmt,
    parse_sizes,
    pyplot,
    save_figure,
    save_result,
)
from workloads import gsm8k_task, mmlu_task

import radixlm_runtime as rt
from radixlm_runtime.io.tokenizer import load_tokenizer
from radixlm_runtime.kvcache.pool import KVPool
from radixlm_runtime.models.config import ModelConfig

NAME = "kv_quant"
SIZES = {
    "gsm8k_questions": Size(200, 2, "GSM8K test questions"),
    "mmlu_subjects": Size(8, 1, "MMLU subjects, in name order (8 are shipped)", scales=False),
    "mmlu_per_subject": Size(25, 2, "MMLU test questions per subject"),
    "max_new_tokens": Size(48, 4, "GSM8K tokens generated per question", scales=False),
    "num_shots": Size(5, 1, "solved examples in every prompt's shared prefix", scales=False),
    "decode_batch": Size(32, 2, "requests decoding together in the throughput run", scales=False),
    "context_tokens": Size(2048, 64, "prompt tokens of each decoding request", scales=False),
    "decode_tokens": Size(64, 4, "tokens each request decodes in the timed run", scales=False),
}
# KV cache dtypes compared: --kv-cache-dtype, the pool's dtype, the label.
KV_TYPES = {"fp32": ("auto", torch.float32), "bf16": (None, torch.bfloat16), "int8": ("int8", torch.int8)}
# The accuracy systems of bench_fewshot_engine.py: float32 KV, int8 KV.
ACCURACY_SYSTEMS = {"fp32": "radixlm", "int8": "radixlm_int8_kv"}
GIB = 2**30


def memory(config: ModelConfig, context_tokens: int, batch: int) -> dict[str, dict[str, float]]:
    """Per KV dtype: bytes per token, tokens per GiB of pool, the ratio to float32, and the bytes of KV a
    decode step of `batch` requests over `context_tokens` each reads (every token's K and V once)."""
    out = {}
    for name, (_, dtype) in KV_TYPES.items():
        per_token = KVPool.bytes_per_token_for(config.num_layers, config.num_kv_heads, config.head_dim, dtype)
        out[name] = {"bytes_per_token": per_token, "tokens_per_gib": GIB / per_token}
        out[name]["decode_step_kv_gib"] = per_token * context_tokens * batch / GIB
    for r in out.values():
        r["vs_fp32"] = r["tokens_per_gib"] / out["fp32"]["tokens_per_gib"]
    return out


def decode_run(model: BenchModel, kv: str, sizes: dict[str, int], quantization: str) -> dict[str, Any]:
    """`decode_batch` requests of `context_tokens` distinct random tokens prefilled into the radix cache,
    then, timed, the same prompts decoding `decode_tokens` greedy tokens each (their prompts from the
    cache, so the run is the decode): output tokens per second."""
    batch, context, steps = sizes["decode_batch"], sizes["context_tokens"], sizes["decode_tokens"]
    engine = rt.Engine(
        model_path=model.path,
        quantization=quantization,
        kv_cache_dtype=KV_TYPES[kv][0],
        max_total_tokens=batch * (context + steps + 8) + 64,
        context_length=context + steps + 8,
        log_level="warning",
    )
    try:
        vocab = engine.runner.info.vocab_size
        rng = random.Random(0)
        prompts = [[rng.randrange(100, vocab - 100) for _ in range(context)] for _ in range(batch)]
        t0 = time.perf_counter()
        engine.generate(input_ids=prompts, sampling_params={"temperature": 0, "max_new_tokens": 1})
        prefill_s = time.perf_counter() - t0
        params = {"temperature": 0, "max_new_tokens": steps, "ignore_eos": True}
        t0 = time.perf_counter()
        outs = engine.generate(input_ids=prompts, sampling_params=params)
        wall = time.perf_counter() - t0
        pool = engine.runner.kv_pool
        assert pool.dtype == KV_TYPES[kv][1], (pool.dtype, kv)
    finally:
        engine.shutdown()
    cached = sum(o["meta_info"]["cached_tokens"] for o in outs)
    return {
        "prefill_s": prefill_s,
        "decode_s": wall,
        "output_tok_per_s": batch * steps / wall,
        "cache_hit_rate": cached / (batch * context),
        "output_ids": [o["output_ids"] for o in outs],
    }


def accuracy_runs(model: BenchModel, sizes: dict[str, int], quantization: str) -> dict[str, dict[str, Any]]:
    """GSM8K and MMLU through bench_fewshot_engine's radixlm systems with float32 and int8 KV."""
    tokenizer = load_tokenizer(model.hf_dir())
    tasks = {
        "gsm8k": gsm8k_task(tokenizer, sizes["gsm8k_questions"], sizes["num_shots"]),
        "mmlu": mmlu_task(tokenizer, sizes["mmlu_subjects"], sizes["mmlu_per_subject"], sizes["num_shots"]),
    }
    runs: dict[str, dict[str, Any]] = {t: {} for t in tasks}
    for kv, name in ACCURACY_SYSTEMS.items():
        system = make_system(name, model, 8, quantization)
        gsm8k = system.generate(tasks["gsm8k"].prompts, sizes["max_new_tokens"])
        runs["gsm8k"][kv] = gsm8k_metrics(gsm8k, tasks["gsm8k"])
        runs["mmlu"][kv] = mmlu_metrics(
            system.score(tasks["mmlu"].prompts, tasks["mmlu"].choices), tasks["mmlu"]
        )
        for t in tasks:
            print(f"{kv} KV {t}: accuracy {runs[t][kv]['accuracy']:.3f}, {runs[t][kv]['wall_s']:.1f} s")
        system.close()
        gc.collect()
    out = {}
    for t, r in runs.items():
        n = len(tasks[t].prompts)
        gap = abs(r["int8"]["correct"] - r["fp32"]["correct"])
        out[t] = {
            "num_questions": n,
            "correct": {kv: r[kv]["correct"] for kv in r},
            "accuracy": {kv: r[kv]["accuracy"] for kv in r},
            "gap_questions": gap,
            "gap_per_100": 100 * gap / n,
            "allowed_questions": math.ceil(n / 100),
            "within_target": gap <= math.ceil(n / 100),
            "agreement": agreement(t, r["int8"], r["fp32"]),
            "wall_s": {kv: r[kv]["wall_s"] for kv in r},
        }
    return out


def token_agreement(a: list[list[int]], b: list[list[int]]) -> float:
    longer = sum(max(len(x), len(y)) for x, y in zip(a, b))
    return sum(common_prefix_len(x, y) for x, y in zip(a, b)) / longer if longer else 1.0


def plot(path: Any, mem: dict[str, dict[str, float]], decode: dict[str, dict[str, Any]]) -> None:
    plt = pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    names = list(mem)
    left.bar(
        names, [mem[n]["tokens_per_gib"] / 1000 for n in names], color=[f"C{i}" for i in range(len(names))]
    )
    left.set_ylabel("thousand tokens per GiB of KV pool")
    left.set_title("KV pool capacity")
    runs = list(decode)
    right.bar(runs, [decode[n]["output_tok_per_s"] for n in runs], color=["C0", "C2"][: len(runs)])
    right.set_ylabel("output tokens / s (higher is better)")
    right.set_title("decode throughput, long contexts")
    save_figure(fig, path)


def main(argv: list[str] | None = None) -> None:
    ap = bench_parser(__doc__, SIZES)
    ap.add_argument(
        "--quantization", default="none", help="radixlm's --quantization (none: float32 weights)."
    )
    ap.add_argument("--skip-accuracy", action="store_true", help="Only the memory and decode figures.")
    add_model_flag(ap)
    args, sizes = parse_sizes(ap, argv, SIZES)
    model = BenchModel(args.model_path)
    config = ModelConfig.from_dir(model.hf_dir())
    mem = memory(config, sizes["context_tokens"], sizes["decode_batch"])
    decode = {kv: decode_run(model, kv, sizes, args.quantization) for kv in ("fp32", "int8")}
    for kv, r in decode.items():
        hit = 100 * r["cache_hit_rate"]
        print(f"{kv} KV decode: {r['output_tok_per_s']:.1f} tok/s (prompts {hit:.0f}% cached)")
    decode_agreement = token_agreement(decode["int8"]["output_ids"], decode["fp32"]["output_ids"])
    accuracy = {} if args.skip_accuracy else accuracy_runs(model, sizes, args.quantization)

    batch, context = sizes["decode_batch"], sizes["context_tokens"]
    tables = [
        Table(
            "KV pool memory",
            [
                "KV dtype",
                "bytes per token",
                "tokens per GiB",
                "vs fp32",
                f"KV read per decode step ({batch} x {context})",
            ],
            [
                [
                    kv,
                    str(r["bytes_per_token"]),
                    f"{r['tokens_per_gib']:,.0f}",
                    f"{r['vs_fp32']:.2f}x",
                    fmt(r["decode_step_kv_gib"], ".2f", " GiB"),
                ]
                for kv, r in mem.items()
            ],
        ),
        Table(
            f"Decode, batch {batch}, {context}-token contexts, {sizes['decode_tokens']} tokens each",
            ["KV dtype", "output tok/s", "decode s", "speed-up vs fp32"],
            [
                [
                    kv,
                    fmt(r["output_tok_per_s"], ".1f"),
                    fmt(r["decode_s"], ".2f"),
                    f"{r['output_tok_per_s'] / decode['fp32']['output_tok_per_s']:.2f}x",
                ]
                for kv, r in decode.items()
            ],
        ),
    ]
    speedup = decode["int8"]["output_tok_per_s"] / decode["fp32"]["output_tok_per_s"]
    notes = [
        f"int8 KV holds {mem['int8']['vs_fp32']:.2f}x float32's tokens per GiB "
        f"({mem['bf16']['vs_fp32']:.2f}x for bf16)",
        f"decode at batch {batch}: int8 KV {speedup:.2f}x float32 KV's throughput; greedy token agreement "
        f"on random prompts {100 * decode_agreement:.1f}%",
    ]
    if accuracy:
        rows = []
        for t, a in accuracy.items():
            agreed = a["agreement"] or {}
            tokens = fmt(100 * agreed["token_agreement"], ".1f", "%") if "token_agreement" in agreed else "-"
            rows.append(
                [
                    t.upper(),
                    str(a["num_questions"]),
                    f"{a['correct']['fp32']}",
                    f"{a['correct']['int8']}",
                    f"{a['gap_per_100']:.2f}",
                    f"{100 * agreed.get('identical', float('nan')):.1f}%",
                    tokens,
                ]
            )
            met = "met" if a["within_target"] else "not met"
            gap = a["gap_questions"]
            notes.append(
                f"{t.upper()}: int8 KV {gap} question(s) from float32 KV (target <= 1 per 100: {met})"
            )
        tables.append(
            Table(
                f"Few-shot accuracy, {sizes['num_shots']} shots, float32 weights",
                [
                    "task",
                    "questions",
                    "fp32 KV correct",
                    "int8 KV correct",
                    "gap per 100",
                    "identical outputs",
                    "token agreement",
                ],
                rows,
            )
        )
    figure = f"{model.result_name(NAME)}.png"
    args.out_dir.mkdir(parents=True, exist_ok=True)
    plot(args.out_dir / figure, mem, decode)
    save_result(
        args.out_dir,
        model.result_name(NAME),
        {
            "memory": mem,
            "decode": {kv: {k: v for k, v in r.items() if k != "output_ids"} for kv, r in decode.items()},
            "decode_token_agreement": decode_agreement,
            "accuracy": accuracy,
        },
        tables=tables,
        notes=notes,
        figures=[figure],
        sizes=sizes,
        model=model,
    )


if __name__ == "__main__":
    main()
