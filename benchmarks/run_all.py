"""Regenerates every benchmark result, and the README's tables and figures, in one command.

Each benchmark runs in its own process (as `python benchmarks/<script> --out-dir <results>`), writing
<name>.json and its PNGs to benchmarks/results/ (not committed). Then every section of
benchmarks/README.md between `<!-- results:NAME -->` and `<!-- /results:NAME -->` is rewritten from
<name>.json (a missing section is appended), and the PNGs are copied to benchmarks/figures/, which is
committed so the README shows them. The prose around the markers is left alone.

    python benchmarks/run_all.py                 # default sizes: minutes on 2 CPU cores
    python benchmarks/run_all.py --scale 4       # 4x the workloads
    python benchmarks/run_all.py --tiny          # smoke run; leaves README and figures alone
    python benchmarks/run_all.py --only serving startup
    python benchmarks/run_all.py --readme-only   # re-render the README from the existing results
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from common import REPO_ROOT, RESULTS_DIR, Table, child_env

BENCH_DIR = REPO_ROOT / "benchmarks"


@dataclass(frozen=True)
class Bench:
    name: str  # the JSON's name and the README marker
    script: str
    title: str  # heading of an appended README section
    args: tuple[str, ...] = ()  # the script's own flags, e.g. another --model-path


# Every script takes --out-dir, --tiny and --scale, and writes <out-dir>/<name>.json in the shape of
# common.save_result.
BENCHMARKS = [
    Bench("fewshot_engine", "bench_fewshot_engine.py", "Few-shot GSM8K and MMLU through the offline engine"),
    Bench("serving", "bench_serving.py", "Serving: Poisson arrivals over a prefix-sharing workload"),
    Bench("programs", "bench_programs.py", "Frontend language: program workloads"),
    Bench("program_prefix", "bench_program_prefix.py", "Frontend language: shared-prefix programs"),
    Bench("startup", "bench_startup.py", "Start-up"),
    Bench("constrained", "bench_constrained.py", "Constrained decoding: grammar backends, masks, throughput"),
    Bench("jump_forward", "bench_jump_forward.py", "Constrained decoding: jump-forward"),
    Bench("host_overhead", "bench_host_overhead.py", "Host overhead of a decode step"),
    Bench("kv_tiers", "bench_kv_tiers.py", "KV tiers: multi-tenant prefixes beyond the KV pool"),
    Bench(
        "kv_tiers_throughput",
        "bench_kv_tiers.py",
        "KV tiers: multi-tenant prefixes beyond the KV pool, steps sized for throughput",
        ("--throughput",),
    ),
    Bench("kv_restart", "bench_kv_restart.py", "KV tiers: prefixes served from disk after a restart"),
    Bench("long_context", "bench_long_context.py", "Long context: follow-up turns on a reused document"),
    Bench("kv_quant", "bench_kv_quant.py", "int8 KV cache: memory, few-shot accuracy, long-context decode"),
    Bench("router", "bench_router.py", "Data parallelism: two replicas behind the router, by policy"),
    Bench("tp", "bench_tp.py", "Tensor parallelism on CPU: TP2 against TP1, and the communication's share"),
    Bench("invariance", "bench_invariance.py", "Batch and cache invariance, by default and --deterministic"),
    Bench("lmeval", "bench_lmeval.py", "lm-eval loglikelihood scoring against the server"),
    Bench("speculative", "bench_speculative.py", "Speculative decoding by prompt lookup"),
    Bench("single_stream", "bench_single_stream.py", "Single-stream decode: quantized weights vs llama.cpp"),
    Bench(
        "fewshot_engine_gemma3-270m",
        "bench_fewshot_engine.py",
        "Gemma 3 270M: few-shot GSM8K and MMLU, beside llama.cpp and vLLM-CPU",
        ("--model-path", "gemma3-270m", "--systems", "radixlm,radixlm_no_cache,llama_cpp,vllm_cpu"),
    ),
    Bench(
        "single_stream_gemma3-270m",
        "bench_single_stream.py",
        "Gemma 3 270M: single-stream decode vs llama.cpp",
        ("--model-path", "gemma3-270m", "--systems", "radixlm_fp32,radixlm_int4,llamacpp"),
    ),
    Bench(
        "long_context_gemma3-270m",
        "bench_long_context.py",
        "Gemma 3 270M: long context at 32k, follow-up turns on a reused document",
        (
            "--model-path",
            "gemma3-270m",
            "--conversations",
            "2",
            "--turns",
            "6",
            "--servers",
            "windows,vllm_cpu",
        ),
    ),
    Bench(
        "kv_restart_gemma3-270m",
        "bench_kv_restart.py",
        "Gemma 3 270M: prefixes served from disk after a restart, window slots included",
        ("--model-path", "gemma3-270m"),
    ),
    Bench(
        "linear_cpu",
        "bench_linear_cpu.py",
        "CPU linears: float32 panels vs oneDNN, every kernel against the measured peak",
    ),
    Bench(
        "prefill_cpu", "bench_prefill_cpu.py", "CPU prefill: radixlm against llama.cpp on the same weights"
    ),
    Bench("attention_cpu", "bench_attention_cpu.py", "CPU prefill attention by KV pool and path"),
    Bench(
        "fewshot_engine_cpu_dtypes",
        "bench_fewshot_engine.py",
        "CPU arithmetic: few-shot GSM8K and MMLU, radixlm fp32/bf16/int8 activations vs vLLM-CPU fp32/bf16",
        ("--systems", "cpu_dtypes"),
    ),
    Bench(
        "single_stream_cpu_dtypes",
        "bench_single_stream.py",
        "CPU arithmetic: single-stream decode, radixlm fp32/bf16/int8 activations vs vLLM-CPU and llama.cpp",
        ("--systems", "cpu_dtypes"),
    ),
    Bench(
        "contention",
        "bench_contention.py",
        "CPU threads beside a busy neighbour: the uncached few-shot run with one core taken",
        ("--systems", "radixlm,radixlm_fixed,vllm_cpu_bf16"),
    ),
    Bench("moe", "bench_moe.py", "MoE layer: routing cost per token against a dense MLP"),
    Bench("gpu", "bench_gpu.py", "GPU: decode, busy share and few-shot beside transformers (needs CUDA)"),
]
# Benchmarks being written that do not take those flags yet: reported, not run. Move one into
# BENCHMARKS once it does.
PENDING: dict[str, str] = {}


def run_benchmarks(benches: list[Bench], results_dir: Path, tiny: bool, scale: float) -> list[str]:
    """Runs each script; returns the names that failed."""
    for script, what in PENDING.items():
        print(f"== {script} ({what}): not on the run_all flags yet, skipped", flush=True)
    failed = []
    for bench in benches:
        script = BENCH_DIR / bench.script
        cmd = [sys.executable, str(script), *bench.args, "--out-dir", str(results_dir)]
        cmd += ["--tiny"] if tiny else ["--scale", f"{scale:g}"]
        print(f"== {bench.name}: {' '.join(cmd[1:])}", flush=True)
        if subprocess.run(cmd, cwd=REPO_ROOT, env=child_env()).returncode != 0:
            print(f"== {bench.name} FAILED", flush=True)
            failed.append(bench.name)
    return failed


def machine_line(machine: dict[str, Any]) -> str:
    gpu = machine.get("gpu") or "no GPU"
    return (
        f"Machine: {machine['logical_cores']} logical cores ({machine['cpu']}), {gpu}; torch "
        f"{machine['torch']} with {machine['torch_threads']} threads, Python {machine['python']}. "
        f"Model: {machine['model']}, {machine['dtype']}. The machine is shared: its 1-minute load average "
        f"was {machine['load_average_1m']:.1f} when the last result was saved."
    )


def render_section(result: dict[str, Any], figures_rel: str) -> str:
    parts = [f"`{result['command']}` (sizes: {', '.join(f'{k}={v}' for k, v in result['sizes'].items())})"]
    for t in result["tables"]:
        table = Table(t["title"], t["headers"], t["rows"])
        parts.append(f"**{table.title}**\n\n{table.markdown()}")
    if result["notes"]:
        parts.append("\n".join(f"- {n}" for n in result["notes"]))
    parts += [f"![{result['name']}]({figures_rel}/{f})" for f in result["figures"]]
    return "\n\n".join(parts)


def replace_section(readme: str, name: str, body: str, title: str) -> str:
    """Swaps the text between the markers of `name`, or appends a new section holding them."""
    begin, end = f"<!-- results:{name} -->", f"<!-- /results:{name} -->"
    block = f"{begin}\n{body}\n{end}"
    pattern = re.compile(re.escape(begin) + r".*?" + re.escape(end), re.DOTALL)
    if pattern.search(readme):
        return pattern.sub(lambda _: block, readme, count=1)
    return readme.rstrip("\n") + f"\n\n## {title}\n\n{block}\n"


def update_readme(benches: list[Bench], results_dir: Path, readme: Path, figures_dir: Path) -> list[str]:
    """Rewrites the README sections of every bench with a result; returns the names rendered."""
    text = readme.read_text()
    figures_dir.mkdir(parents=True, exist_ok=True)
    figures_rel = Path(figures_dir.resolve()).relative_to(readme.parent.resolve()).as_posix()
    rendered = []
    machine: dict[str, Any] | None = None
    for bench in benches:
        path = results_dir / f"{bench.name}.json"
        if not path.exists():
            continue
        result = json.loads(path.read_text())
        for fig in result["figures"]:
            shutil.copyfile(results_dir / fig, figures_dir / fig)
        text = replace_section(text, bench.name, render_section(result, figures_rel), bench.title)
        if not bench.args:  # the machine line names the default model; another model's rows say theirs
            machine = result["machine"]
        rendered.append(bench.name)
    if machine is not None:
        text = replace_section(text, "machine", machine_line(machine), "Machine")
    readme.write_text(text)
    return rendered


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--scale", type=float, default=1.0, help="Multiply every benchmark's default sizes.")
    ap.add_argument("--tiny", action="store_true", help="Smallest sizes; README and figures are left alone.")
    ap.add_argument("--only", nargs="+", metavar="NAME", help=f"Among {[b.name for b in BENCHMARKS]}.")
    ap.add_argument("--readme-only", action="store_true", help="Only re-render the README from results.")
    ap.add_argument("--results-dir", type=Path, default=RESULTS_DIR)
    ap.add_argument("--readme", type=Path, default=BENCH_DIR / "README.md")
    ap.add_argument("--figures-dir", type=Path, default=BENCH_DIR / "figures")
    args = ap.parse_args(argv)
    known = {b.name for b in BENCHMARKS}
    if args.only and not set(args.only) <= known:
        ap.error(f"--only takes names among {sorted(known)}")
    benches = [b for b in BENCHMARKS if not args.only or b.name in args.only]

    failed = [] if args.readme_only else run_benchmarks(benches, args.results_dir, args.tiny, args.scale)
    if not args.tiny:
        ok = [b for b in benches if b.name not in failed]
        rendered = update_readme(ok, args.results_dir, args.readme, args.figures_dir)
        print(f"updated {args.readme} ({', '.join(rendered) or 'nothing'}) and {args.figures_dir}")
    if failed:
        sys.exit(f"failed: {', '.join(failed)}")


if __name__ == "__main__":
    main()
