"""`python -m radixlm.eval gsm8k|mmlu`: few-shot evaluation written as radixlm programs and run with
run_batch, against a running server (--backend URL) or a local one started for the run."""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import radixlm as sgl
from radixlm.eval.data import (
    default_data_dir,
    gsm8k_fewshot_prefix,
    gsm8k_question_suffix,
    load_gsm8k,
    load_mmlu,
    mmlu_subjects,
)
from radixlm.eval.tasks import (
    GSM8K_STOP,
    MMLU_CHOICES,
    MMLU_LETTERS,
    gsm8k_answer,
    gsm8k_correct,
    mmlu_block,
    mmlu_fewshot_prefix,
)


@sgl.function
def gsm8k_program(s, prefix, question, max_new_tokens):
    s += prefix + gsm8k_question_suffix(question)
    s += sgl.gen("answer", max_tokens=max_new_tokens, stop=GSM8K_STOP)


@sgl.function
def mmlu_program(s, prefix, question, choices):
    s += prefix + mmlu_block(question, choices)
    s += sgl.select("answer", choices=MMLU_CHOICES)


@dataclass
class EvalItem:
    """One question: the program's arguments, its full prompt text (for baselines), its label."""

    arguments: dict[str, Any]
    prompt: str
    label: str
    subject: str | None = None


def gsm8k_items(args: argparse.Namespace) -> list[EvalItem]:
    prefix = gsm8k_fewshot_prefix(args.num_shots, args.data_dir)
    return [
        EvalItem(
            {"prefix": prefix, "question": it.question, "max_new_tokens": args.max_new_tokens},
            prefix + gsm8k_question_suffix(it.question),
            it.label,
        )
        for it in load_gsm8k("test", args.num_questions, args.data_dir)
    ]


def mmlu_items(args: argparse.Namespace) -> list[EvalItem]:
    """--num-questions per subject; subjects default to the first --num-subjects in name order."""
    subjects = args.subjects or mmlu_subjects(args.data_dir)[: args.num_subjects]
    if not subjects:
        raise FileNotFoundError(f"no MMLU subjects under {args.data_dir or default_data_dir()}/mmlu")
    items = []
    for subject in subjects:
        prefix = mmlu_fewshot_prefix(subject, args.num_shots, args.data_dir)
        for it in load_mmlu(subject, "test", args.num_questions, args.data_dir):
            arguments = {"prefix": prefix, "question": it.question, "choices": it.choices}
            items.append(EvalItem(arguments, prefix + mmlu_block(it.question, it.choices), it.label, subject))
    return items


def _gsm8k_prediction(state: sgl.ProgramState) -> str:
    return state["answer"]


def _mmlu_prediction(state: sgl.ProgramState) -> str:
    return state["answer"].strip()


TASKS: dict[str, tuple[Any, Callable[..., list[EvalItem]], Callable[[sgl.ProgramState], str]]] = {
    "gsm8k": (gsm8k_program, gsm8k_items, _gsm8k_prediction),
    "mmlu": (mmlu_program, mmlu_items, _mmlu_prediction),
}


def is_correct(task: str, prediction: str, label: str) -> bool:
    return gsm8k_correct(prediction, label) if task == "gsm8k" else prediction == label


def evaluate(task: str, items: list[EvalItem], backend: Any, parallel: int) -> dict[str, Any]:
    """Runs every item; throughput and cache figures come from the server's counters around the run."""
    program, _, predict = TASKS[task]
    before = backend.get_server_info()
    t0 = time.perf_counter()
    states = program.run_batch(
        [it.arguments for it in items],
        backend=backend,
        num_threads=parallel,
        progress_bar=True,
        temperature=0,
    )
    wall = time.perf_counter() - t0
    after = backend.get_server_info()
    predictions = [predict(s) for s in states]
    correct = [is_correct(task, p, it.label) for p, it in zip(predictions, items)]
    prompt_tokens = after["prompt_tokens"] - before["prompt_tokens"]
    generated = after["generated_tokens"] - before["generated_tokens"]
    return {
        "accuracy": sum(correct) / len(items),
        "num_questions": len(items),
        "wall_s": wall,
        "questions_per_s": len(items) / wall,
        "output_tokens_per_s": generated / wall,
        "cache_hit_rate": (after["cached_tokens"] - before["cached_tokens"]) / max(prompt_tokens, 1),
        "predictions": predictions,
        "correct": correct,
    }


def run_transformers_baseline(
    task: str, items: list[EvalItem], model_dir: Path, max_new_tokens: int, batch_size: int
) -> dict[str, Any]:
    """The same prompts through a plain transformers loop (greedy; MMLU by the letters' logprobs)."""
    from radixlm.eval.baseline import TransformersSystem

    system = TransformersSystem(model_dir, batch_size)
    ids = [system.tokenizer.encode(it.prompt) for it in items]
    if task == "gsm8k":
        run = system.generate(ids, max_new_tokens)
        predictions = run.texts
    else:
        choices = [system.tokenizer.encode(c) for c in MMLU_CHOICES]
        run = system.score(ids, choices)
        predictions = [MMLU_LETTERS[max(range(len(lp)), key=lp.__getitem__)] for lp in run.logprobs]
    system.close()
    correct = [is_correct(task, p, it.label) for p, it in zip(predictions, items)]
    return {
        "system": "transformers",
        "accuracy": sum(correct) / len(items),
        "wall_s": run.wall_s,
        "predictions": predictions,
        "correct": correct,
    }


def _answer(task: str, prediction: str) -> str | None:
    return gsm8k_answer(prediction) if task == "gsm8k" else prediction


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m radixlm.eval", description=__doc__.splitlines()[0])
    p.add_argument(
        "task", choices=sorted(TASKS), help="gsm8k: gen + final-number match; mmlu: select over A-D"
    )
    p.add_argument("--backend", metavar="URL", help="a running radixlm (or SGLang) server")
    p.add_argument(
        "--model-path",
        help="without --backend: start a local server on this model (default: the embedded one)",
    )
    p.add_argument("--num-questions", type=int, default=50, help="test questions (for mmlu: per subject)")
    p.add_argument("--num-shots", type=int, default=5, help="solved examples in the shared prefix")
    p.add_argument("--parallel", type=int, default=64, help="programs in flight at once")
    p.add_argument("--subjects", nargs="+", help="mmlu subjects (default: the first --num-subjects)")
    p.add_argument("--num-subjects", type=int, default=4, help="mmlu subjects when --subjects is not given")
    p.add_argument("--max-new-tokens", type=int, default=256, help="gsm8k answer length limit")
    p.add_argument("--data-dir", type=Path, default=None, help="data folder (default: ../shared/data)")
    p.add_argument("--output", type=Path, default=None, help="JSON result path (default: eval_<task>.json)")
    p.add_argument(
        "--baseline",
        choices=["transformers"],
        help="also run the same prompts through plain transformers (greedy) on the same weights and "
        "record both accuracies; the weights are --model-path's, else the server's model path",
    )
    p.add_argument("--baseline-batch-size", type=int, default=8, help="transformers batch size")
    return p


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = build_parser().parse_args(argv)
    for name in (
        "num_questions",
        "num_shots",
        "parallel",
        "num_subjects",
        "max_new_tokens",
        "baseline_batch_size",
    ):
        if getattr(args, name) < (0 if name == "num_shots" else 1):
            raise SystemExit(f"--{name.replace('_', '-')} must be positive, got {getattr(args, name)}")
    items = TASKS[args.task][1](args)
    backend = sgl.RuntimeEndpoint(args.backend) if args.backend else sgl.Runtime(model_path=args.model_path)
    try:
        result = evaluate(args.task, items, backend, args.parallel)
        result |= {"task": args.task, "model_path": backend.model_info["model_path"]}
    finally:
        backend.shutdown()
    if args.baseline:
        model_dir = Path(args.model_path) if args.model_path else Path(result["model_path"])
        if not model_dir.is_dir():
            raise SystemExit(
                f"--baseline needs the model's weights here: pass --model-path (not found: {model_dir})"
            )
        base = run_transformers_baseline(
            args.task, items, model_dir, args.max_new_tokens, args.baseline_batch_size
        )
        ours = [_answer(args.task, p) for p in result["predictions"]]
        theirs = [_answer(args.task, p) for p in base["predictions"]]
        result["baseline"] = base
        result["answers_agree"] = sum(a == b for a, b in zip(ours, theirs)) / len(items)
        result["accuracy_gap"] = abs(result["accuracy"] - base["accuracy"])
        print(
            f"transformers baseline: accuracy {base['accuracy']:.3f}; "
            f"answers agree on {result['answers_agree']:.0%} of questions"
        )
    result["config"] = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
    print(
        f"{args.task}: accuracy {result['accuracy']:.3f} on {result['num_questions']} questions | "
        f"{result['questions_per_s']:.2f} questions/s | "
        f"{result['output_tokens_per_s']:.1f} output tokens/s | "
        f"cache hit rate {result['cache_hit_rate']:.3f} | wall {result['wall_s']:.1f} s"
    )
    output = args.output or Path(f"eval_{args.task}.json")
    output.write_text(json.dumps(result, indent=2))
    print(f"wrote {output}")
    return result
