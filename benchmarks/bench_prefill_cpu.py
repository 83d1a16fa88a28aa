"""Prompt processing (prefill) on the CPU: radixlm against llama.cpp, one prompt at a time, nothing
cached, in prompt tokens per second.

Pairs that read the same weights (the default model's GGUF, and a Q8_0 copy of it that llama.cpp's own
quantizer makes once, `systems.q8_0_gguf`, requantizing its blocks, so both engines read the same Q8_0
weights):

- the model's GGUF as shipped (Q4_1 for the embedded SmolLM2): llama.cpp against radixlm serving its
  blocks as int4 (`quantization="auto"`) with int8 activations (`cpu_act_quant="int8"`, the fair pair:
  llama.cpp's CPU kernels quantize activations to 8 bits too), and for reference radixlm with float32
  activations and in bf16 (`dtype="bfloat16"`);
- its Q8_0 copy: llama.cpp against radixlm serving it as int8 from its own blocks, with int8
  activations (the fair pair), float32 ones and bf16.

radixlm runs with the radix cache disabled, `chunked_prefill_size` the longest prompt and
`prefill_step_target_ms=0` (every prompt prefilled in one forward step), `cpu_thread_policy="fixed"`
(every kernel on all its threads), and is timed around
`Engine.generate(input_ids=..., max_new_tokens=1)`: the prompt's forward, its last row's logits and
one sampled token. llama.cpp (llama-cpp-python) has `n_batch = n_ubatch` the longest prompt (one
`llama_decode` takes the whole prompt), no prompt cache and a reset context before every prompt, and
is timed around `Llama.eval(prompt)`: the forward and its last row's logits. Both use `--threads`
threads. llama.cpp runs with flash attention off and on (`--llamacpp-flash-attn best`, the default),
its faster setting per length taken as its figure. Prompts are random token ids (prefill costs the same
whatever the tokens), a fresh prompt for every repeat, the same for every system; every system first
prefills one prompt of each length (warm-up), then rounds alternate the systems, and the best of
`--repeats` is reported (the median too, in the JSON). A system this radixlm or CPU cannot run (bf16
without AVX512-BF16, int8 activations without their SIMD kernels or `cpu_act_quant`) is skipped
with the reason.

    python benchmarks/bench_prefill_cpu.py                       # 512 and 2,048 tokens, every system
    python benchmarks/bench_prefill_cpu.py --systems llamacpp_q4_1,radixlm_int4_a8 --lengths 512
    python benchmarks/bench_prefill_cpu.py --tiny
"""

from __future__ import annotations

import gc
import os
import random
import statistics
import time
from collections.abc import Callable
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
from systems import SystemUnavailable, check_engine_options, engine_fields, llama_cpp, q8_0_gguf

NAME = "prefill_cpu"
SIZES = {
    "repeats": Size(3, 1, "timed prefills per system and length, a fresh prompt each (best reported)"),
}
# radixlm's systems: name -> (weights: "gguf" the model's own file or "q8_0" its Q8_0 copy, engine flags).
RADIXLM: dict[str, tuple[str, dict[str, str]]] = {
    "radixlm_int4_a8": ("gguf", {"quantization": "auto", "cpu_act_quant": "int8"}),
    "radixlm_int4": ("gguf", {"quantization": "auto"}),
    "radixlm_int4_bf16": ("gguf", {"quantization": "auto", "dtype": "bfloat16"}),
    "radixlm_int8_a8": ("q8_0", {"quantization": "auto", "cpu_act_quant": "int8"}),
    "radixlm_int8": ("q8_0", {"quantization": "auto"}),
    "radixlm_int8_bf16": ("q8_0", {"quantization": "auto", "dtype": "bfloat16"}),
}
# llama.cpp's systems -> their weights; and the radixlm systems each is held against (the fair one first).
LLAMACPP = {"llamacpp_q4_1": "gguf", "llamacpp_q8_0": "q8_0"}
PAIRS = {
    "llamacpp_q4_1": ("radixlm_int4_a8", "radixlm_int4", "radixlm_int4_bf16"),
    "llamacpp_q8_0": ("radixlm_int8_a8", "radixlm_int8", "radixlm_int8_bf16"),
}
SYSTEMS = (*PAIRS["llamacpp_q4_1"], "llamacpp_q4_1", *PAIRS["llamacpp_q8_0"], "llamacpp_q8_0")
TINY_SYSTEMS = "radixlm_int4_a8,radixlm_int4,llamacpp_q4_1"
LABELS = {
    "radixlm_int4_a8": "radixlm int4 weights, int8 activations",
    "radixlm_int4": "radixlm int4 weights, fp32 activations",
    "radixlm_int4_bf16": "radixlm int4 weights, bf16 arithmetic",
    "llamacpp_q4_1": "llama.cpp, the GGUF (Q4_1)",
    "radixlm_int8_a8": "radixlm int8 weights (Q8_0), int8 activations",
    "radixlm_int8": "radixlm int8 weights (Q8_0), fp32 activations",
    "radixlm_int8_bf16": "radixlm int8 weights (Q8_0), bf16 arithmetic",
    "llamacpp_q8_0": "llama.cpp, Q8_0",
}
TARGET = 1.5  # radixlm with int8 activations over llama.cpp, per pair and length
FLASH_ATTN = {"off": (False,), "on": (True,), "best": (False, True)}

# A system: prefill(prompt ids) -> seconds, and close().
Prefill = Callable[[list[int]], float]


def radixlm_system(name: str, gguf: Path, threads: int, longest: int) -> tuple[Prefill, Callable[[], None]]:
    import radixlm_runtime as rt

    options = RADIXLM[name][1]
    check_engine_options(options)
    if "cpu_thread_policy" in engine_fields():  # every kernel on `threads` threads, as llama.cpp's
        options = options | {"cpu_thread_policy": "fixed"}
    engine = rt.Engine(
        model_path=str(gguf),
        disable_radix_cache=True,
        chunked_prefill_size=longest,
        prefill_step_target_ms=0,
        max_total_tokens=longest + 512,
        num_threads=threads,
        log_level="warning",
        **options,
    )
    params = {"temperature": 0, "max_new_tokens": 1}

    def prefill(ids: list[int]) -> float:
        start = time.perf_counter()
        out = engine.generate(input_ids=ids, sampling_params=params)
        seconds = time.perf_counter() - start
        if out["meta_info"]["cached_tokens"]:
            raise AssertionError(
                f"{name} served {out['meta_info']['cached_tokens']} prompt tokens from a cache"
            )
        return seconds

    return prefill, engine.shutdown


def llamacpp_system(
    gguf: Path, threads: int, longest: int, flash_attn: bool
) -> tuple[Prefill, Callable[[], None]]:
    llm = llama_cpp().Llama(
        model_path=str(gguf),
        n_ctx=longest + 64,
        n_batch=longest,
        n_ubatch=longest,
        n_threads=threads,
        n_threads_batch=threads,
        flash_attn=flash_attn,
        verbose=False,
        seed=0,
    )

    def prefill(ids: list[int]) -> float:
        llm.reset()  # nothing kept: eval drops the KV past n_tokens (0) first
        start = time.perf_counter()
        llm.eval(ids)
        return time.perf_counter() - start

    return prefill, llm.close


def prompts(vocab_size: int, lengths: list[int], repeats: int) -> dict[int, list[list[int]]]:
    """Per length, a warm-up prompt and then one fresh prompt per repeat: random ids clear of the
    special tokens at either end of the vocabulary."""
    out = {}
    for length in lengths:
        rng = random.Random(length)
        out[length] = [
            [rng.randrange(256, vocab_size - 256) for _ in range(length)] for _ in range(repeats + 1)
        ]
    return out


def start_systems(
    names: list[str], model: BenchModel, threads: int, longest: int, flash_attn: tuple[bool, ...]
) -> tuple[dict[str, tuple[Prefill, Callable[[], None]]], dict[str, str]]:
    """Every runner of `names` (llama.cpp once per flash-attention setting, as `name/fa`), and the
    systems that cannot run here with the reason."""
    runners: dict[str, tuple[Prefill, Callable[[], None]]] = {}
    skipped: dict[str, str] = {}
    weights: dict[str, Path] = {}

    def gguf(kind: str) -> Path:
        if kind not in weights:
            weights[kind] = model.gguf() if kind == "gguf" else q8_0_gguf(model.gguf())
        return weights[kind]

    for name in names:
        try:
            if name in LLAMACPP:
                for fa in flash_attn:
                    runners[f"{name}/fa_{'on' if fa else 'off'}"] = llamacpp_system(
                        gguf(LLAMACPP[name]), threads, longest, fa
                    )
            else:
                runners[name] = radixlm_system(name, gguf(RADIXLM[name][0]), threads, longest)
        except SystemUnavailable as e:
            print(f"skipping {name}: {e}")
            skipped[name] = str(e)
    return runners, skipped


def measure(
    runners: dict[str, tuple[Prefill, Callable[[], None]]], prompt_sets: dict[int, list[list[int]]]
) -> dict[str, dict[int, list[float]]]:
    """Warm-up (each runner prefills the first prompt of each length), then rounds alternating the
    runners over the fresh prompts: seconds per runner, length and repeat."""
    for prefill, _ in runners.values():
        for ids in prompt_sets.values():
            prefill(ids[0])
    times: dict[str, dict[int, list[float]]] = {r: {n: [] for n in prompt_sets} for r in runners}
    for length, ids in prompt_sets.items():
        for prompt in ids[1:]:
            for runner, (prefill, _) in runners.items():
                times[runner][length].append(prefill(prompt))
                print(f"{runner:26s} {length:5d} tokens: {length / times[runner][length][-1]:8.1f} tok/s")
    return times


def summarize(times: dict[str, dict[int, list[float]]]) -> dict[str, dict[str, Any]]:
    """Per system and length: the best and median tokens/s. llama.cpp's runners fold into one system
    per weights, its faster flash-attention setting per length (each setting's figures under
    "settings")."""
    found: dict[str, dict[str, list[dict[str, Any]]]] = {}
    for runner, by_length in times.items():
        name, _, setting = runner.partition("/")
        for length, seconds in by_length.items():
            found.setdefault(name, {}).setdefault(str(length), []).append(
                {
                    "setting": setting or None,
                    "times_s": seconds,
                    "tok_s": length / min(seconds),
                    "median_tok_s": length / statistics.median(seconds),
                }
            )
    return {
        name: {
            n: max(entries, key=lambda e: e["tok_s"]) | ({"settings": entries} if len(entries) > 1 else {})
            for n, entries in by_length.items()
        }
        for name, by_length in found.items()
    }


def ratios(systems: dict[str, dict[str, Any]], lengths: list[int]) -> dict[str, dict[str, float]]:
    """radixlm / llama.cpp tokens/s, per radixlm system and length, against its pair's llama.cpp."""
    out: dict[str, dict[str, float]] = {}
    for llama, mine in PAIRS.items():
        for name in mine:
            if name in systems and llama in systems:
                out[name] = {
                    str(n): systems[name][str(n)]["tok_s"] / systems[llama][str(n)]["tok_s"] for n in lengths
                }
    return out


def notes_for(ratio: dict[str, dict[str, float]], lengths: list[int], threads: int) -> list[str]:
    notes = []
    for llama, mine in PAIRS.items():
        for name in mine:
            if name not in ratio:
                continue
            shown = ", ".join(f"**{ratio[name][str(n)]:.2f}x** at {n}" for n in lengths)
            line = f"{LABELS[name]} vs {LABELS[llama]}: {shown} tokens"
            if name == mine[0]:  # the fair pair
                met = all(ratio[name][str(n)] >= TARGET for n in lengths)
                line += f" (target >= {TARGET}x: {'met' if met else 'not met'})"
            notes.append(line)
    notes.append(
        f"{threads} thread(s) per system; one prompt at a time, nothing cached; best of the repeats (the "
        "JSON holds the median too); llama.cpp at its faster flash-attention setting per length."
    )
    return notes


def table(
    systems: dict[str, dict[str, Any]], ratio: dict[str, dict[str, float]], lengths: list[int]
) -> Table:
    headers = ["system"] + [f"{n} tok/s" for n in lengths] + [f"vs llama.cpp, {n}" for n in lengths]
    rows = []
    for name in SYSTEMS:
        if name not in systems:
            continue
        row = [LABELS[name]] + [fmt(systems[name][str(n)]["tok_s"], ".0f") for n in lengths]
        row += [fmt(ratio.get(name, {}).get(str(n)), ".2f", "x") for n in lengths]
        rows.append(row)
    return Table("Prefill tokens/s, one prompt, nothing cached", headers, rows)


def plot(path: Path, systems: dict[str, dict[str, Any]], lengths: list[int]) -> None:
    plt = pyplot()
    names = [s for s in SYSTEMS if s in systems]
    fig, ax = plt.subplots(figsize=(8, 3.8))
    width = 0.8 / len(lengths)
    for i, length in enumerate(lengths):
        rates = [systems[s][str(length)]["tok_s"] for s in names]
        ax.bar([j + i * width for j in range(len(names))], rates, width, label=f"{length}-token prompt")
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(names))], names, fontsize=7, rotation=25)
    ax.set_ylabel("prefill tokens / s (higher is better)")
    ax.legend(fontsize=8)
    save_figure(fig, path)


def main(argv: list[str] | None = None) -> None:
    ap = bench_parser(__doc__, SIZES)
    add_list_flag(ap, "--systems", f"systems, of {', '.join(SYSTEMS)}", ",".join(SYSTEMS), TINY_SYSTEMS)
    add_list_flag(ap, "--lengths", "prompt lengths in tokens", "512,2048", "64")
    ap.add_argument("--threads", type=int, default=None, help="Threads of every system (default: all cores).")
    ap.add_argument(
        "--llamacpp-flash-attn",
        choices=tuple(FLASH_ATTN),
        default="best",
        help="llama.cpp's flash attention: off, on, or best (both measured, the faster kept per length).",
    )
    add_model_flag(ap)
    args, sizes = parse_sizes(ap, argv, SIZES)
    model = BenchModel(args.model_path)
    names = list_flag(args, "--systems", str)
    if not set(names) <= set(SYSTEMS):
        ap.error(f"--systems takes names among {SYSTEMS}")
    lengths = list_flag(args, "--lengths", int)
    threads = args.threads or os.cpu_count() or 1

    from radixlm_runtime.io.tokenizer import load_tokenizer

    prompt_sets = prompts(len(load_tokenizer(model.hf_dir())), lengths, sizes["repeats"])
    runners, skipped = start_systems(
        names, model, threads, max(lengths), FLASH_ATTN[args.llamacpp_flash_attn]
    )
    try:
        times = measure(runners, prompt_sets)
    finally:
        for _, close in runners.values():
            close()
        gc.collect()
    systems = summarize(times)
    ratio = ratios(systems, lengths)
    name = model.result_name(NAME)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    figure = f"{name}.png"
    plot(args.out_dir / figure, systems, lengths)
    save_result(
        args.out_dir,
        name,
        {"threads": threads, "lengths": lengths, "systems": systems, "ratios": ratio, "skipped": skipped},
        tables=[table(systems, ratio, lengths)],
        notes=notes_for(ratio, lengths, threads)
        + [f"{LABELS[s]} skipped: {why}" for s, why in skipped.items()],
        figures=[figure],
        sizes=sizes,
        model=model,
    )


if __name__ == "__main__":
    main()
