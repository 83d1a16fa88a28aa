"""lm-eval's loglikelihood path against the server, side by side with radixlm's own evaluator.

EleutherAI's lm-eval drives a server through `local-completions`: tokenized prompts sent to
/v1/completions with `echo` and `logprobs`, one request per answer choice, every prompt token's
logprob asked for. The 5-shot prefix can come from the cache only because the radix tree keeps the
logprobs earlier requests computed. Both evaluators score the same MMLU questions (the shared CSVs,
given to lm-eval as a local task in the prompt format of `radixlm.eval mmlu`) on one server, the cache
flushed before each. Reported per system: the time from its first request reaching the server to
its last one finishing (so neither tool's start-up counts), accuracy, and the share of prompt tokens
served from the cache; and how many answers the two agree on.

lm-eval is no dependency of radixlm: `--lm-eval-python` names an interpreter that has it, e.g. a
venv made with `python -m venv --system-site-packages` plus `pip install "lm-eval[api]"`. Without
one the benchmark says so and records nothing.

    python benchmarks/bench_lmeval.py --lm-eval-python /path/to/venv/bin/python
    python benchmarks/bench_lmeval.py --tiny --lm-eval-python ...
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx
from common import Size, Table, bench_parser, child_env, fmt, parse_sizes, save_result
from local_server import flush, running_server

from radixlm.eval.data import default_data_dir, mmlu_subjects

NAME = "lmeval"
SIZES = {
    "questions": Size(16, 2, "MMLU test questions per subject"),
    "subjects": Size(2, 1, "MMLU subjects, in name order", scales=False),
}
NUM_SHOTS = 5
LETTERS = ("A", "B", "C", "D")
POLL_S = 0.05


def task_yaml(subject: str, data_dir: Path) -> str:
    """A local lm-eval task that asks exactly what `radixlm.eval mmlu` asks (radixlm.eval.tasks)."""
    header = f"The following are multiple choice questions (with answers) about {subject.replace('_', ' ')}."
    return "\n".join(
        [
            f"task: radixlm_mmlu_{subject}",
            "dataset_path: csv",
            "dataset_kwargs:",
            "  data_files:",
            f"    test: {data_dir / 'mmlu' / 'test' / f'{subject}_test.csv'}",
            f"    dev: {data_dir / 'mmlu' / 'dev' / f'{subject}_dev.csv'}",
            "  column_names: [question, A, B, C, D, answer]",
            "test_split: test",
            "fewshot_split: dev",
            "fewshot_config:",
            "  sampler: first_n",
            f"num_fewshot: {NUM_SHOTS}",
            "output_type: multiple_choice",
            f"description: {json.dumps(header + chr(10) * 2)}",
            'doc_to_text: "{{question.strip()}}\\nA. {{A}}\\nB. {{B}}\\nC. {{C}}\\nD. {{D}}\\nAnswer:"',
            f"doc_to_choice: {json.dumps(list(LETTERS))}",
            "doc_to_target: \"{{['A', 'B', 'C', 'D'].index(answer.strip())}}\"",
            'target_delimiter: " "',
            'fewshot_delimiter: "\\n\\n"',
            "metric_list:",
            "  - metric: acc",
            "    aggregation: mean",
            "    higher_is_better: true",
            "",
        ]
    )


class ServerWatch:
    """Polls /server_info in the background: when this run's first request arrived and when its
    last one finished, and what the server counted in between."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.start = self._info()
        self.samples: list[tuple[float, dict[str, Any]]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _info(self) -> dict[str, Any]:
        return httpx.get(f"{self.url}/server_info", timeout=30).json()

    def _run(self) -> None:
        while not self._stop.is_set():
            self.samples.append((time.monotonic(), self._info()))
            time.sleep(POLL_S)

    def finish(self) -> dict[str, Any]:
        self._stop.set()
        self._thread.join()
        end = self._info()
        first = next(t for t, i in self.samples if i["num_requests"] > self.start["num_requests"])
        last = next(t for t, i in self.samples if i["finished_requests"] >= end["finished_requests"])
        prompt = end["prompt_tokens"] - self.start["prompt_tokens"]
        cached = end["cached_tokens"] - self.start["cached_tokens"]
        return {
            "busy_s": last - first,
            "requests": end["num_requests"] - self.start["num_requests"],
            "prompt_tokens": prompt,
            "cached_tokens": cached,
            "hit_rate": cached / prompt if prompt else 0.0,
        }


def run_radixlm_eval(url: str, subjects: list[str], questions: int, out: Path) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "radixlm.eval", "mmlu", "--backend", url, "--subjects", *subjects]
    cmd += ["--num-questions", str(questions), "--num-shots", str(NUM_SHOTS), "--output", str(out)]
    subprocess.run(cmd, check=True, env=child_env(), stdout=subprocess.DEVNULL)
    result = json.loads(out.read_text())
    return {"accuracy": result["accuracy"], "predictions": result["predictions"]}


def run_lm_eval(
    python: str, url: str, model: str, tokenizer: str, subjects: list[str], questions: int, work: Path
) -> dict[str, Any]:
    tasks = work / "tasks"
    tasks.mkdir()
    for subject in subjects:
        (tasks / f"{subject}.yaml").write_text(task_yaml(subject, default_data_dir()))
    model_args = ",".join(
        [
            f"model={model}",
            f"base_url={url}/v1/completions",
            "tokenizer_backend=huggingface",
            f"tokenizer={tokenizer}",
            "tokenized_requests=True",
            "num_concurrent=8",
            "max_retries=1",
        ]
    )
    names = ",".join(f"radixlm_mmlu_{s}" for s in subjects)
    cmd = [python, "-m", "lm_eval", "--model", "local-completions", "--model_args", model_args]
    cmd += ["--tasks", names, "--include_path", str(tasks), "--limit", str(questions)]
    cmd += ["--output_path", str(work / "out"), "--log_samples"]
    env = child_env() | {"HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    subprocess.run(cmd, check=True, env=env, cwd=work, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    predictions: list[str] = []
    correct = 0
    for subject in subjects:
        (path,) = (work / "out").rglob(f"samples_radixlm_mmlu_{subject}_*.jsonl")
        docs = sorted((json.loads(line) for line in path.read_text().splitlines()), key=lambda d: d["doc_id"])
        for doc in docs:
            # One (loglikelihood, is_greedy) pair per choice.
            scores = [float(loglikelihood) for loglikelihood, _ in doc["filtered_resps"]]
            predictions.append(LETTERS[max(range(len(scores)), key=scores.__getitem__)])
            correct += int(doc["acc"])
    return {"accuracy": correct / len(predictions), "predictions": predictions}


def lm_eval_available(python: str) -> bool:
    probe = subprocess.run([python, "-c", "import lm_eval, tenacity"], capture_output=True)
    return probe.returncode == 0


def main(argv: list[str] | None = None) -> None:
    ap = bench_parser(__doc__, SIZES)
    ap.add_argument(
        "--lm-eval-python",
        default=os.environ.get("RADIXLM_LM_EVAL_PYTHON", sys.executable),
        help="Python interpreter with lm-eval[api] installed (default: $RADIXLM_LM_EVAL_PYTHON or this one).",
    )
    args, sizes = parse_sizes(ap, argv, SIZES)
    if not lm_eval_available(args.lm_eval_python):
        print(f"skipping: lm-eval is not importable by {args.lm_eval_python} (see --help to set one up)")
        return
    subjects = mmlu_subjects()[: sizes["subjects"]]
    questions = sizes["questions"]
    with tempfile.TemporaryDirectory() as tmp, running_server([], Path(tmp) / "server.log") as url:
        work = Path(tmp)
        model = httpx.get(f"{url}/v1/models", timeout=30).json()["data"][0]["id"]
        tokenizer = httpx.get(f"{url}/model_info", timeout=30).json()["tokenizer_path"]
        runs: dict[str, dict[str, Any]] = {}
        for system in ("radixlm.eval", "lm-eval"):
            flush(url)
            watch = ServerWatch(url)
            if system == "radixlm.eval":
                result = run_radixlm_eval(url, subjects, questions, work / "radixlm_eval.json")
            else:
                result = run_lm_eval(args.lm_eval_python, url, model, tokenizer, subjects, questions, work)
            runs[system] = result | watch.finish()
    num = len(runs["lm-eval"]["predictions"])
    agree = sum(a == b for a, b in zip(runs["lm-eval"]["predictions"], runs["radixlm.eval"]["predictions"]))
    ratio = runs["lm-eval"]["busy_s"] / runs["radixlm.eval"]["busy_s"]
    table = Table(
        f"MMLU {NUM_SHOTS}-shot, {num} questions ({', '.join(subjects)}), cache flushed per system",
        ["system", "requests", "server busy s", "s / question", "prompt tokens", "from cache", "accuracy"],
        [
            [
                name,
                str(r["requests"]),
                fmt(r["busy_s"]),
                fmt(r["busy_s"] / num, ".3f"),
                str(r["prompt_tokens"]),
                fmt(100 * r["hit_rate"], ".1f", "%"),
                fmt(r["accuracy"], ".3f"),
            ]
            for name, r in runs.items()
        ],
    )
    notes = [
        f"lm-eval (local-completions, echo + logprobs) takes **{ratio:.2f}x** radixlm.eval's server time",
        f"answers identical for {agree}/{num} questions",
    ]
    save_result(args.out_dir, NAME, {"runs": runs, "subjects": subjects}, [table], notes, [], sizes)


if __name__ == "__main__":
    main()
