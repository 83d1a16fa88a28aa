"""JSON extraction with jump-forward decoding on vs off, through the offline engine.

Short person descriptions (synthesized deterministically) are each turned into a JSON object under
a schema of 6 fields (two enums and a nested 3-field object among them), greedy, all submitted
together. The same engine settings run with and without `disable_jump_forward`, each run warmed up
first (the schema's index compiled, then the radix cache flushed) so only generation is timed; off
and on runs alternate, `--repeats` pairs of them, so that load changes on a shared machine hit both.
Reports decode steps (forward passes), sampled and jumped tokens, output tokens/s, wall clock
(median and best of the repeats), process CPU time and the speedups, and checks every output
against the schema.

    python benchmarks/bench_jump_forward.py            # 32 inputs, 3 off/on pairs
    python benchmarks/bench_jump_forward.py --tiny     # 4 inputs, one pair
"""

from __future__ import annotations

import gc
import json
import statistics
import time
from pathlib import Path
from typing import Any

import jsonschema
from common import Size, Table, bench_parser, fmt, parse_sizes, pyplot, save_figure, save_result

import radixlm_runtime as rt
from radixlm_runtime.io.tokenizer import load_tokenizer
from radixlm_runtime.models.loader import resolve_model_path

NAME = "jump_forward"
SIZES = {
    "num_inputs": Size(32, 4, "descriptions to extract from"),
    "max_new_tokens": Size(192, 192, "output token limit per input", scales=False),
    "repeats": Size(3, 1, "off/on run pairs", scales=False),
}
JOBS = ["nurse", "teacher", "software engineer", "chef", "architect", "pilot", "lawyer", "farmer"]
PLANS = ["free", "basic", "premium"]
# Modeled on SGLang's jump-forward benchmark (character extraction): free-text fields next to enums,
# a boolean and a nested object, so much of each answer is fixed by the schema.
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 30},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "city": {"type": "string", "maxLength": 30},
        "occupation": {"enum": JOBS},
        "email": {"type": "string", "maxLength": 40},
        "membership": {
            "type": "object",
            "properties": {
                "active": {"type": "boolean"},
                "since": {"type": "integer", "minimum": 2000, "maximum": 2030},
                "plan": {"enum": PLANS},
            },
            "required": ["active", "since", "plan"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "age", "city", "occupation", "email", "membership"],
    "additionalProperties": False,
}
FIRST = ["Maria", "James", "Aiko", "Omar", "Lena", "Carlos", "Priya", "Tom"]
LAST = ["Lopez", "Smith", "Tanaka", "Haddad", "Novak", "Silva", "Patel", "Berg"]
CITIES = ["Lisbon", "Chicago", "Osaka", "Cairo", "Prague", "Recife", "Pune", "Oslo"]
INSTRUCTION = (
    "Extract the person's name, age, city, occupation, email and membership (whether it is active, the "
    "year it started and the plan: free, basic or premium) from the text below. Answer with a JSON "
    "object only.\n\n"
)


def descriptions(n: int) -> list[str]:
    """n distinct, deterministic one-paragraph descriptions of people."""
    out = []
    for i in range(n):
        first, last = FIRST[i % 8], LAST[(i * 3 + i // 8) % 8]
        age, city, job, plan = 21 + (i * 7) % 50, CITIES[(i * 5) % 8], JOBS[(i + i // 8) % 8], PLANS[i % 3]
        member = "has been a member since" if i % 4 else "cancelled the membership in"
        out.append(
            f"{first} {last} is a {age}-year-old {job} living in {city}. {first} {member} "
            f"{2010 + i % 12} and is on the {plan} plan. Contact: {first.lower()}.{last.lower()}@example.com."
        )
    return out


def run(prompts: list[str], max_new_tokens: int, disable_jump_forward: bool) -> dict[str, Any]:
    """One timed batch on a fresh engine, with the scheduler's counters for it."""
    engine = rt.Engine(disable_jump_forward=disable_jump_forward, log_level="warning")
    params = {"json_schema": json.dumps(SCHEMA), "temperature": 0, "max_new_tokens": max_new_tokens}
    engine.generate("Warm-up: describe anyone.", params)  # compiles the schema's index
    engine.flush_cache()
    before = engine.get_server_info()
    t0, c0 = time.perf_counter(), time.process_time()
    outs = engine.generate(prompts, params)
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    info = engine.get_server_info()
    completion = sum(o["meta_info"]["completion_tokens"] for o in outs)
    valid = 0
    for o in outs:
        try:
            jsonschema.validate(json.loads(o["text"]), SCHEMA)
            valid += 1
        except (ValueError, jsonschema.ValidationError):
            pass
    tok = engine.tokenizer
    canonical = sum(o["output_ids"] == tok.encode(o["text"], add_special_tokens=False) for o in outs)
    counters = ("forward_passes", "generated_tokens", "jump_forwards", "jump_forward_tokens")
    delta = {k: info[k] - before[k] for k in counters}
    engine.shutdown()
    return {
        "wall_s": wall,
        "cpu_s": cpu,
        "decode_steps": delta["forward_passes"],
        "sampled_tokens": delta["generated_tokens"],
        "jumps": delta["jump_forwards"],
        "jump_tokens": delta["jump_forward_tokens"],
        "completion_tokens": completion,
        "output_tok_per_s": completion / wall,
        "valid_outputs": valid,
        "canonical_tokenizations": canonical,
        "texts": [o["text"] for o in outs],
    }


def plot(path: Path, systems: dict[str, dict[str, Any]]) -> None:
    """Work (decode steps, sampled tokens) and time (wall clock of every repeat) side by side."""
    plt = pyplot()
    fig, (work, time_ax) = plt.subplots(1, 2, figsize=(8, 3.2))
    names = list(systems)
    for i, (key, label) in enumerate(
        (("decode_steps", "decode steps"), ("sampled_tokens", "sampled tokens"))
    ):
        work.bar([x + 0.4 * i for x in range(len(names))], [systems[n][key] for n in names], 0.4, label=label)
    work.set_xticks([x + 0.2 for x in range(len(names))], [f"jump-forward {n}" for n in names])
    work.set_title("Work")
    work.legend()
    time_ax.bar(names, [systems[n]["wall_s_median"] for n in names], color="C2", label="median")
    for x, n in enumerate(names):
        runs = systems[n]["wall_s_runs"]
        time_ax.plot([x] * len(runs), runs, "k.", label="each repeat" if x == 0 else None)
    time_ax.set_xticks(range(len(names)), [f"jump-forward {n}" for n in names])
    time_ax.set_ylabel("wall clock (s)")
    time_ax.set_title("Time")
    time_ax.legend()
    save_figure(fig, path)


def main(argv: list[str] | None = None) -> None:
    ap = bench_parser(__doc__, SIZES)
    args, sizes = parse_sizes(ap, argv, SIZES)
    tokenizer = load_tokenizer(resolve_model_path(None))
    prompts = [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": INSTRUCTION + d}], tokenize=False, add_generation_prompt=True
        )
        for d in descriptions(sizes["num_inputs"])
    ]
    runs: dict[str, list[dict[str, Any]]] = {"off": [], "on": []}
    for _ in range(sizes["repeats"]):
        for name in runs:
            runs[name].append(run(prompts, sizes["max_new_tokens"], disable_jump_forward=name == "off"))
            gc.collect()

    # Steps, tokens and texts are the same in every repeat (greedy); times vary with the machine's load.
    systems: dict[str, dict[str, Any]] = {}
    for name, rs in runs.items():
        walls = [r["wall_s"] for r in rs]
        systems[name] = {k: v for k, v in rs[0].items() if k not in ("wall_s", "cpu_s", "texts")} | {
            "wall_s_median": statistics.median(walls),
            "wall_s_best": min(walls),
            "cpu_s_median": statistics.median(r["cpu_s"] for r in rs),
            "wall_s_runs": walls,
            "cpu_s_runs": [r["cpu_s"] for r in rs],
        }
        systems[name]["output_tok_per_s"] = rs[0]["completion_tokens"] / systems[name]["wall_s_median"]
    off, on = systems["off"], systems["on"]
    n = len(prompts)
    ratios = {
        "speedup_wall_median": off["wall_s_median"] / on["wall_s_median"],
        "speedup_wall_best": off["wall_s_best"] / on["wall_s_best"],
        "speedup_cpu_time": off["cpu_s_median"] / on["cpu_s_median"],
        "decode_step_ratio": off["decode_steps"] / on["decode_steps"],
    }
    identical = sum(a == b for a, b in zip(runs["on"][0]["texts"], runs["off"][0]["texts"]))
    table = Table(
        f"JSON extraction, jump-forward off vs on: {n} inputs, {len(SCHEMA['properties'])}-field schema, "
        f"greedy, {sizes['repeats']} off/on pairs",
        [
            "jump-forward",
            "decode steps",
            "sampled tokens",
            "jumps",
            "output tokens",
            "output tok/s",
            "wall s (median)",
            "wall s (best)",
            "CPU s",
            "valid JSON",
            "canonical tokens",
        ],
        [
            [
                name,
                str(r["decode_steps"]),
                str(r["sampled_tokens"]),
                str(r["jumps"]),
                str(r["completion_tokens"]),
                fmt(r["output_tok_per_s"], ".1f"),
                fmt(r["wall_s_median"]),
                fmt(r["wall_s_best"]),
                fmt(r["cpu_s_median"]),
                f"{r['valid_outputs']}/{n}",
                f"{r['canonical_tokenizations']}/{n}",
            ]
            for name, r in systems.items()
        ],
    )
    notes = [
        f"jump-forward on: **{ratios['speedup_wall_median']:.2f}x** wall clock (median; "
        f"{ratios['speedup_wall_best']:.2f}x best of each), {ratios['speedup_cpu_time']:.2f}x CPU time, "
        f"{ratios['decode_step_ratio']:.2f}x fewer decode steps, "
        f"{off['sampled_tokens'] / on['sampled_tokens']:.2f}x fewer sampled tokens",
        f"valid against the schema: {off['valid_outputs']}/{n} off, {on['valid_outputs']}/{n} on; "
        f"identical texts {identical}/{n} (off feeds the model its own, non-canonical spellings of the "
        f"forced text: canonical tokenizations {off['canonical_tokenizations']}/{n} off vs "
        f"{on['canonical_tokenizations']}/{n} on)",
    ]
    args.out_dir.mkdir(parents=True, exist_ok=True)
    figure = f"{NAME}.png"
    plot(args.out_dir / figure, systems)
    save_result(
        args.out_dir,
        NAME,
        {
            "systems": systems,
            **ratios,
            "identical_texts": identical,
            "sample_output": runs["on"][0]["texts"][0],
        },
        tables=[table],
        notes=notes,
        figures=[figure],
        sizes=sizes,
    )


if __name__ == "__main__":
    main()
