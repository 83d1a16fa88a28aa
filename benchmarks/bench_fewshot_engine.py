"""Few-shot GSM8K and MMLU through the offline engine, side by side with its baselines.

Every question sits behind a few-shot prefix it shares with the others (one for GSM8K, one per subject
for MMLU). Systems, run one after another in this process on the same weights and the same token ids:
radixlm; radixlm with the radix cache disabled; a plain `transformers` loop (left-padded batches); and
llama.cpp through llama-cpp-python on the same GGUF file with its prompt cache on (skipped when the
optional `llamacpp` extra is not installed). vLLM's CPU build, with its prefix cache on and off, in
float32 and in bf16 (its fastest on a CPU with AVX512-BF16), runs when asked for (`--systems
...,vllm_cpu,vllm_cpu_no_cache,vllm_cpu_bf16,vllm_cpu_bf16_no_cache`) from the environment that
`benchmarks/vllm_cpu/install.sh` makes, set up as its CPU guide says; skipped with a message where it
is not installed. So do radixlm's other arithmetic, caches on and off: bf16 (`dtype="bfloat16"`: bf16
weights and dot products, AVX512-BF16) and the GGUF's int4 weights with int8 activations
(`quantization="auto"`, `cpu_act_quant="int8"`, VNNI or AVX2), with float32 KV and with a bf16 KV cache
(`kv_cache_dtype="bfloat16"`: prefill attention on vdpbf16ps where the CPU has AVX512-BF16), each
skipped with the reason where this radixlm or CPU lacks it. `--systems cpu_dtypes` names that whole
comparison (saved as fewshot_engine_cpu_dtypes.json). `radixlm_int8_kv` is float32 radixlm with
`--kv-cache-dtype int8`; `--systems kv_quant` compares it with float32 KV (bench_kv_quant.py runs that
at >= 200 questions).

GSM8K is greedy generation graded on the final number. MMLU picks the answer letter whose continuation
(" A" .. " D") has the highest logprob after the prompt; every system scores the same continuations.

Agreement with float32 radixlm (the `radixlm` row, when `--quantization none`), per system: on GSM8K
the share of questions whose generated token ids are identical to it, and the token agreement: over all
questions, the tokens equal up to the first divergence (the common leading run of the two outputs)
divided by the tokens of the longer of the two outputs (1.0 when every output is identical); on MMLU
the share of questions given the same answer. Targets, per task: the fastest radixlm with its cache
off against vLLM-CPU bf16 with its prefix cache off, and the fastest radixlm with its cache on against
vLLM-CPU bf16 with it on (both >= 1.5x).

    python benchmarks/bench_fewshot_engine.py            # 16 GSM8K + 16 MMLU questions, 5 shots
    python benchmarks/bench_fewshot_engine.py --tiny     # a few questions, seconds per system
    python benchmarks/bench_fewshot_engine.py --systems radixlm,radixlm_no_cache,vllm_cpu,vllm_cpu_no_cache
    python benchmarks/bench_fewshot_engine.py --systems cpu_dtypes   # radixlm and vLLM-CPU arithmetic
"""

from __future__ import annotations

import gc
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

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
from systems import LlamaCppSystem, RadixlmSystem, SystemUnavailable, VllmCpuSystem
from workloads import ChoiceTask, GenTask, gsm8k_task, mmlu_task

from radixlm.eval.baseline import GenRun, ScoreRun, TransformersSystem
from radixlm.eval.tasks import gsm8k_correct
from radixlm_runtime.io.tokenizer import load_tokenizer

NAME = "fewshot_engine"
SIZES = {
    "gsm8k_questions": Size(16, 2, "GSM8K test questions"),
    "mmlu_subjects": Size(2, 1, "MMLU subjects, in name order (8 are shipped)", scales=False),
    "mmlu_per_subject": Size(8, 2, "MMLU test questions per subject"),
    "max_new_tokens": Size(48, 4, "GSM8K tokens generated per question", scales=False),
    "num_shots": Size(5, 1, "solved examples in every prompt's shared prefix", scales=False),
}
DEFAULT_SYSTEMS = ("radixlm", "radixlm_no_cache", "transformers", "llama_cpp")
# radixlm in other arithmetic: name -> (radix cache disabled, quantization, engine options).
RADIXLM_VARIANTS: dict[str, tuple[bool, str, dict[str, str]]] = {
    "radixlm_bf16": (False, "none", {"dtype": "bfloat16"}),
    "radixlm_bf16_no_cache": (True, "none", {"dtype": "bfloat16"}),
    "radixlm_int4_a8": (False, "auto", {"cpu_act_quant": "int8"}),
    "radixlm_int4_a8_no_cache": (True, "auto", {"cpu_act_quant": "int8"}),
    "radixlm_int4_a8_bf16_kv": (False, "auto", {"cpu_act_quant": "int8", "kv_cache_dtype": "bfloat16"}),
    "radixlm_int4_a8_bf16_kv_no_cache": (
        True,
        "auto",
        {"cpu_act_quant": "int8", "kv_cache_dtype": "bfloat16"},
    ),
    "radixlm_int8_kv": (False, "none", {"kv_cache_dtype": "int8"}),
    "radixlm_int8_kv_no_cache": (True, "none", {"kv_cache_dtype": "int8"}),
}
# vLLM-CPU compiles for minutes at start-up, so it runs only when named; so do radixlm's variants.
VLLM_SYSTEMS = ("vllm_cpu", "vllm_cpu_no_cache", "vllm_cpu_bf16", "vllm_cpu_bf16_no_cache")
SYSTEMS = (*DEFAULT_SYSTEMS, *RADIXLM_VARIANTS, *VLLM_SYSTEMS)
# Named sets of --systems.
SYSTEM_SETS = {
    "cpu_dtypes": ("radixlm", "radixlm_no_cache", *RADIXLM_VARIANTS, *VLLM_SYSTEMS),
    # --kv-cache-dtype int8 against float32 KV on the same float32 weights (bench_kv_quant.py).
    "kv_quant": ("radixlm", "radixlm_int8_kv"),
}
# What radixlm (float32 under --quantization none) is compared with in the notes.
BASELINES = ("radixlm_no_cache", "transformers", "llama_cpp", *VLLM_SYSTEMS)
LABELS = {
    "radixlm": "radixlm",
    "radixlm_no_cache": "radixlm, radix cache disabled",
    "radixlm_bf16": "radixlm bf16",
    "radixlm_bf16_no_cache": "radixlm bf16, radix cache disabled",
    "radixlm_int4_a8": "radixlm int4, int8 activations",
    "radixlm_int4_a8_no_cache": "radixlm int4, int8 activations, radix cache disabled",
    "radixlm_int4_a8_bf16_kv": "radixlm int4, int8 activations, bf16 KV",
    "radixlm_int4_a8_bf16_kv_no_cache": "radixlm int4, int8 activations, bf16 KV, radix cache disabled",
    "radixlm_int8_kv": "radixlm, int8 KV cache",
    "radixlm_int8_kv_no_cache": "radixlm, int8 KV cache, radix cache disabled",
    "transformers": "transformers, batched",
    "llama_cpp": "llama.cpp, prompt cache on",
    "vllm_cpu": "vLLM-CPU, prefix cache on",
    "vllm_cpu_no_cache": "vLLM-CPU, prefix cache off",
    "vllm_cpu_bf16": "vLLM-CPU bf16, prefix cache on",
    "vllm_cpu_bf16_no_cache": "vLLM-CPU bf16, prefix cache off",
}
# The targets: the fastest radixlm of a cache setting against vLLM-CPU bf16 with its cache set alike.
TARGETS = {
    "uncached": (
        (
            "radixlm_no_cache",
            "radixlm_bf16_no_cache",
            "radixlm_int4_a8_no_cache",
            "radixlm_int4_a8_bf16_kv_no_cache",
        ),
        "vllm_cpu_bf16_no_cache",
    ),
    "cached": (("radixlm", "radixlm_bf16", "radixlm_int4_a8", "radixlm_int4_a8_bf16_kv"), "vllm_cpu_bf16"),
}
TARGET = 1.5


def gsm8k_metrics(run: GenRun, task: GenTask) -> dict[str, Any]:
    correct = [gsm8k_correct(text, label) for text, label in zip(run.texts, task.labels)]
    return {
        **_common_metrics(run, len(task.prompts), correct),
        "completion_tokens": run.completion_tokens,
        "output_tok_per_s": run.completion_tokens / run.wall_s,
        "output_ids": run.output_ids,
    }


def mmlu_metrics(run: ScoreRun, task: ChoiceTask) -> dict[str, Any]:
    answers = [max(range(len(lps)), key=lps.__getitem__) for lps in run.logprobs]
    return {
        **_common_metrics(run, len(task.prompts), [a == label for a, label in zip(answers, task.labels)]),
        "answers": answers,
        "logprobs": run.logprobs,
    }


def _common_metrics(run: GenRun | ScoreRun, n: int, correct: list[bool]) -> dict[str, Any]:
    hit = None if run.cached_tokens is None else run.cached_tokens / run.prompt_tokens
    return {
        "wall_s": run.wall_s,
        "questions_per_s": n / run.wall_s,
        "prompt_tokens": run.prompt_tokens,
        "cached_tokens": run.cached_tokens,
        "cache_hit_rate": hit,
        "correct": sum(correct),
        "accuracy": sum(correct) / n,
    }


def agreement(task_name: str, run: dict[str, Any], reference: dict[str, Any]) -> dict[str, float] | None:
    """`run` against float32 radixlm (see the module docstring): identical outputs (GSM8K) or answers
    (MMLU) as a share of the questions, and on GSM8K the token agreement; None where `run` returns no
    token ids (llama.cpp's text-only completions)."""
    key = "output_ids" if task_name == "gsm8k" else "answers"
    if run[key] is None or reference[key] is None:
        return None
    pairs = list(zip(run[key], reference[key]))
    out = {"identical": sum(a == b for a, b in pairs) / len(pairs)}
    if task_name == "gsm8k":
        longer = sum(max(len(a), len(b)) for a, b in pairs)
        out["token_agreement"] = sum(common_prefix_len(a, b) for a, b in pairs) / longer if longer else 1.0
    return out


def targets(runs: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per target (uncached, cached): the fastest radixlm with that cache setting, the vLLM-CPU bf16 run
    set alike, their ratio (vLLM's wall time over radixlm's) and the target."""
    out = {}
    for name, (mine, theirs) in TARGETS.items():
        ran = [s for s in mine if s in runs]
        if not ran or theirs not in runs:
            continue
        best = min(ran, key=lambda s: runs[s]["wall_s"])
        ratio = runs[theirs]["wall_s"] / runs[best]["wall_s"]
        out[name] = {
            "radixlm": best,
            "vllm": theirs,
            "ratio": ratio,
            "target": TARGET,
            "met": ratio >= TARGET,
        }
    return out


def compare(task_name: str, n: int, runs: dict[str, dict[str, Any]], fp32: bool) -> dict[str, Any]:
    """Ratios against each baseline, and the agreement checks: radixlm must give the same outputs with
    the cache on and off, and within one question per hundred the accuracy of transformers; with
    `fp32` (radixlm ran float32) every other system's agreement with it; the targets against vLLM-CPU
    bf16."""
    key = "output_ids" if task_name == "gsm8k" else "answers"
    on = runs["radixlm"]
    out: dict[str, Any] = {"num_questions": n}
    for base in BASELINES:
        if base in runs:
            out[f"speedup_vs_{base}"] = runs[base]["wall_s"] / on["wall_s"]
            if runs[base][key] is not None:
                out[f"same_outputs_vs_{base}"] = sum(a == b for a, b in zip(on[key], runs[base][key])) / n
    if "radixlm_no_cache" in runs and task_name == "mmlu":
        out["max_logprob_diff_cache_on_vs_off"] = max(
            abs(a - b)
            for row_on, row_off in zip(on["logprobs"], runs["radixlm_no_cache"]["logprobs"])
            for a, b in zip(row_on, row_off)
        )
    if "transformers" in runs:
        out["accuracy_gap_vs_transformers_questions"] = abs(on["correct"] - runs["transformers"]["correct"])
        out["accuracy_gap_allowed_questions"] = math.ceil(n / 100)
    if fp32:
        found = {s: agreement(task_name, r, on) for s, r in runs.items() if s != "radixlm"}
        out["agreement_vs_fp32"] = {s: a for s, a in found.items() if a is not None}
    out["targets"] = targets(runs)
    return out


def make_system(name: str, model: BenchModel, hf_batch_size: int, quantization: str) -> Any:
    if name in RADIXLM_VARIANTS:
        no_cache, variant_quantization, options = RADIXLM_VARIANTS[name]
        return RadixlmSystem(no_cache, variant_quantization, model.path, **options)
    makers: dict[str, Callable[[], Any]] = {
        "radixlm": lambda: RadixlmSystem(False, quantization, model.path),
        "radixlm_no_cache": lambda: RadixlmSystem(True, quantization, model.path),
        "transformers": lambda: TransformersSystem(model.hf_dir(), hf_batch_size),
        "llama_cpp": lambda: LlamaCppSystem(model.gguf()),
        "vllm_cpu": lambda: VllmCpuSystem(model.hf_dir(), prefix_cache=True),
        "vllm_cpu_no_cache": lambda: VllmCpuSystem(model.hf_dir(), prefix_cache=False),
        "vllm_cpu_bf16": lambda: VllmCpuSystem(model.hf_dir(), prefix_cache=True, dtype="bfloat16"),
        "vllm_cpu_bf16_no_cache": lambda: VllmCpuSystem(model.hf_dir(), prefix_cache=False, dtype="bfloat16"),
    }
    return makers[name]()


def plot(path: Path, tasks: dict[str, dict[str, dict[str, Any]]], shots: int) -> None:
    plt = pyplot()
    fig, axes = plt.subplots(1, len(tasks), figsize=(5.5 * len(tasks), 4), squeeze=False)
    for ax, (task_name, runs) in zip(axes[0], tasks.items()):
        names = list(runs)
        values = [runs[s]["questions_per_s"] for s in names]
        bars = ax.bar(range(len(names)), values, color=[f"C{i}" for i in range(len(names))])
        for bar, s in zip(bars, names):
            hit = runs[s]["cache_hit_rate"]
            label = f"{values[names.index(s)]:.2f}/s" + ("" if hit is None else f"\nhit {hit:.0%}")
            ax.annotate(
                label,
                (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                ha="center",
                va="bottom",
                fontsize=8,
            )
        ax.set_xticks(range(len(names)), [LABELS[s].replace(", ", ",\n") for s in names], fontsize=8)
        ax.set_ylabel("questions / s (higher is better)")
        ax.set_title(f"{task_name.upper()} {shots}-shot, {runs['radixlm']['num_questions']} questions")
        ax.margins(y=0.2)
    save_figure(fig, path)


def agreement_cell(found: dict[str, float] | None, n: int) -> str:
    if found is None:
        return "-"
    cell = f"{round(found['identical'] * n)}/{n}"
    return cell + (f", {100 * found['token_agreement']:.1f}% tokens" if "token_agreement" in found else "")


def table(task_name: str, runs: dict[str, dict[str, Any]], shots: int, summary: dict[str, Any]) -> Table:
    gen = task_name == "gsm8k"
    headers = ["system", "wall s", "questions/s"] + (["output tok/s"] if gen else [])
    headers += ["prompt tokens from cache", "accuracy", "radixlm speed-up"]
    agreed = summary.get("agreement_vs_fp32")
    if agreed is not None:
        headers.append("same as radixlm fp32")
    rows = []
    for name, r in runs.items():
        row = [LABELS[name], fmt(r["wall_s"], ".1f"), fmt(r["questions_per_s"], ".2f")]
        if gen:
            row.append(fmt(r["output_tok_per_s"], ".1f"))
        hit = r["cache_hit_rate"]
        speedup = r["wall_s"] / runs["radixlm"]["wall_s"]
        row += [fmt(None if hit is None else 100 * hit, ".1f", "%"), f"{r['correct']}/{r['num_questions']}"]
        row.append(f"**{speedup:.2f}x**" if name != "radixlm" else "1x")
        if agreed is not None:
            row.append(
                "reference" if name == "radixlm" else agreement_cell(agreed.get(name), r["num_questions"])
            )
        rows.append(row)
    return Table(f"{task_name.upper()} {shots}-shot", headers, rows)


def notes_for(task_name: str, summary: dict[str, Any]) -> list[str]:
    n = summary["num_questions"]
    label = task_name.upper()
    notes = [
        f"{label}: radixlm vs {LABELS[b]}: **{summary[f'speedup_vs_{b}']:.2f}x**"
        for b in BASELINES
        if f"speedup_vs_{b}" in summary
    ]
    what = "outputs" if task_name == "gsm8k" else "answers"
    for base in BASELINES:
        if f"same_outputs_vs_{base}" in summary:
            same = round(summary[f"same_outputs_vs_{base}"] * n)
            notes.append(f"{label}: {what} identical to {LABELS[base]} for {same}/{n} questions")
    if "accuracy_gap_vs_transformers_questions" in summary:
        gap, allowed = (summary[f"accuracy_gap_{k}_questions"] for k in ("vs_transformers", "allowed"))
        notes.append(f"{label}: accuracy gap radixlm vs transformers: {gap} question(s) (allowed: {allowed})")
    for name, found in summary.get("agreement_vs_fp32", {}).items():
        if name in RADIXLM_VARIANTS or name in VLLM_SYSTEMS[2:]:  # the other arithmetic
            notes.append(f"{label}: {LABELS[name]} against radixlm fp32: {agreement_cell(found, n)}")
    for kind, t in summary["targets"].items():
        met = "met" if t["met"] else "not met"
        notes.append(
            f"{label}: {kind} radixlm (fastest: {LABELS[t['radixlm']]}) vs {LABELS[t['vllm']]}: "
            f"**{t['ratio']:.2f}x** (target >= {t['target']}x: {met})"
        )
    return notes


def main(argv: list[str] | None = None) -> None:
    ap = bench_parser(__doc__, SIZES)
    ap.add_argument("--tasks", default="gsm8k,mmlu", help="Comma-separated: gsm8k, mmlu.")
    ap.add_argument(
        "--systems",
        default=",".join(DEFAULT_SYSTEMS),
        help=f"Comma-separated, radixlm first: {', '.join(SYSTEMS)}; or a named set: "
        + "; ".join(f"{k} = {','.join(v)}" for k, v in SYSTEM_SETS.items()),
    )
    ap.add_argument("--hf-batch-size", type=int, default=8)
    ap.add_argument(
        "--quantization",
        default="none",
        help="radixlm's --quantization: none (fp32, as transformers and vLLM-CPU compute), auto, int8, int4.",
    )
    add_model_flag(ap)
    args, sizes = parse_sizes(ap, argv, SIZES)
    model = BenchModel(args.model_path)
    systems = list(SYSTEM_SETS.get(args.systems, args.systems.split(",")))
    if systems[0] != "radixlm" or not set(systems) <= set(SYSTEMS):
        ap.error(f"--systems must start with radixlm and name only {SYSTEMS}")

    tokenizer = load_tokenizer(model.hf_dir())
    workloads: dict[str, GenTask | ChoiceTask] = {}
    for task_name in args.tasks.split(","):
        if task_name == "gsm8k":
            workloads[task_name] = gsm8k_task(tokenizer, sizes["gsm8k_questions"], sizes["num_shots"])
        elif task_name == "mmlu":
            workloads[task_name] = mmlu_task(
                tokenizer, sizes["mmlu_subjects"], sizes["mmlu_per_subject"], sizes["num_shots"]
            )
        else:
            ap.error(f"unknown task {task_name!r}")

    runs: dict[str, dict[str, dict[str, Any]]] = {t: {} for t in workloads}
    skipped: dict[str, str] = {}
    for name in systems:
        try:
            system = make_system(name, model, args.hf_batch_size, args.quantization)
        except SystemUnavailable as e:
            print(f"skipping {name}: {e}")
            skipped[name] = str(e)
            continue
        for task_name, task in workloads.items():
            if isinstance(task, GenTask):
                metrics = gsm8k_metrics(system.generate(task.prompts, sizes["max_new_tokens"]), task)
            else:
                metrics = mmlu_metrics(system.score(task.prompts, task.choices), task)
            runs[task_name][name] = {"num_questions": len(task.prompts), **metrics}
            print(f"{name} {task_name}: {metrics['wall_s']:.1f} s, accuracy {metrics['accuracy']:.3f}")
        system.close()
        gc.collect()

    fp32 = args.quantization == "none"
    summaries = {t: compare(t, len(workloads[t].prompts), r, fp32) for t, r in runs.items()}
    # A named set is saved under its own name, beside the default comparison.
    name = model.result_name(f"{NAME}_{args.systems}" if args.systems in SYSTEM_SETS else NAME)
    figure = f"{name}.png"
    args.out_dir.mkdir(parents=True, exist_ok=True)
    plot(args.out_dir / figure, runs, sizes["num_shots"])
    bulky = ("output_ids", "logprobs")
    save_result(
        args.out_dir,
        name,
        {
            "skipped": skipped,
            "summary": summaries,
            "systems": {
                t: {s: {k: v for k, v in r.items() if k not in bulky} for s, r in rs.items()}
                for t, rs in runs.items()
            },
        },
        tables=[table(t, r, sizes["num_shots"], summaries[t]) for t, r in runs.items()],
        notes=[note for t, s in summaries.items() for note in notes_for(t, s)]
        + [f"{LABELS[s]} skipped: {why}" for s, why in skipped.items()],
        figures=[figure],
        sizes=sizes,
        model=model,
    )


if __name__ == "__main__":
    main()
