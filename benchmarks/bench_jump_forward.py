"""JSON extraction with jump-forward decoding on vs off, through the offline engine.

32 short person descriptions (synthesized deterministically) are each turned into a 7-field JSON
object under a JSON schema, greedy, all submitted together. The same engine settings run twice, once
with `disable_jump_forward=True`; each run is warmed up first (the schema's index compiled, then the
radix cache flushed) so only generation is timed. Prints decode steps (forward passes), output
tokens/s, wall clock, process CPU time (steadier than wall clock on a shared machine) and the
speedups side by side, checks every output against the schema, and writes the figures as JSON.

    python benchmarks/bench_jump_forward.py                      # 32 inputs
    python benchmarks/bench_jump_forward.py --num-inputs 8       # quick
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import time
from pathlib import Path
from typing import Any

import jsonschema
import torch

import radixlm_runtime as rt

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 30},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "city": {"type": "string", "maxLength": 30},
        "occupation": {"type": "string", "maxLength": 30},
        "email": {"type": "string", "maxLength": 40},
        "member": {"type": "boolean"},
        "plan": {"enum": ["free", "basic", "premium"]},
    },
    "required": ["name", "age", "city", "occupation", "email", "member", "plan"],
    "additionalProperties": False,
}
FIRST = ["Maria", "James", "Aiko", "Omar", "Lena", "Carlos", "Priya", "Tom"]
LAST = ["Lopez", "Smith", "Tanaka", "Haddad", "Novak", "Silva", "Patel", "Berg"]
CITIES = ["Lisbon", "Chicago", "Osaka", "Cairo", "Prague", "Recife", "Pune", "Oslo"]
JOBS = ["nurse", "teacher", "software engineer", "chef", "architect", "pilot", "lawyer", "farmer"]
PLANS = ["free", "basic", "premium"]
INSTRUCTION = (
    "Extract the person's name, age, city, occupation, email, whether they are a member, and their plan "
    "(free, basic or premium) from the text below. Answer with a JSON object only.\n\n"
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
    delta = {k: info[k] - before[k] for k in ("forward_passes", "generated_tokens", "jump_forwards")}
    delta["jump_forward_tokens"] = info["jump_forward_tokens"] - before["jump_forward_tokens"]
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--num-inputs", type=int, default=32)
    ap.add_argument("--max-new-tokens", type=int, default=192)
    ap.add_argument("--repeats", type=int, default=1, help="Runs per setting; the median wall clock counts.")
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/jump_forward.json"))
    args = ap.parse_args()
    if args.num_inputs < 1 or args.repeats < 1:
        raise ValueError("--num-inputs and --repeats must be >= 1")

    from radixlm_runtime.engine.tokenizer import load_tokenizer
    from radixlm_runtime.models.loader import resolve_model_path

    tokenizer = load_tokenizer(resolve_model_path(None))
    prompts = [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": INSTRUCTION + d}], tokenize=False, add_generation_prompt=True
        )
        for d in descriptions(args.num_inputs)
    ]
    results: dict[str, dict[str, Any]] = {}
    for _ in range(args.repeats):
        for name, disable in (("jump_forward_off", True), ("jump_forward_on", False)):
            r = run(prompts, args.max_new_tokens, disable)
            walls = results.get(name, {}).get("wall_runs_s", []) + [r["wall_s"]]
            cpus = results.get(name, {}).get("cpu_runs_s", []) + [r["cpu_s"]]
            results[name] = r | {
                "wall_runs_s": walls,
                "wall_s": statistics.median(walls),
                "cpu_runs_s": cpus,
                "cpu_s": statistics.median(cpus),
            }
            results[name]["output_tok_per_s"] = r["completion_tokens"] / results[name]["wall_s"]
            gc.collect()

    off, on = results["jump_forward_off"], results["jump_forward_on"]
    summary = {
        "num_inputs": len(prompts),
        "schema_fields": len(SCHEMA["properties"]),
        "max_new_tokens": args.max_new_tokens,
        "threads": torch.get_num_threads(),
        "speedup_wall": off["wall_s"] / on["wall_s"],
        "speedup_cpu_time": off["cpu_s"] / on["cpu_s"],
        "decode_step_ratio": off["decode_steps"] / on["decode_steps"],
        "identical_texts": sum(a == b for a, b in zip(on["texts"], off["texts"])),
    }
    print(
        f"\nJSON extraction: {len(prompts)} inputs, {summary['schema_fields']}-field schema, greedy, "
        f"max_new_tokens={args.max_new_tokens}, {summary['threads']} threads, repeats={args.repeats}"
    )
    header = f"{'jump-forward':<14}{'steps':>7}{'sampled':>9}{'jumps':>7}{'out tok':>9}{'tok/s':>9}"
    print(header + f"{'wall s':>9}{'cpu s':>9}{'valid':>8}{'canonical':>11}")
    for name, r in (("off", off), ("on", on)):
        print(
            f"{name:<14}{r['decode_steps']:>7}{r['sampled_tokens']:>9}{r['jumps']:>7}"
            f"{r['completion_tokens']:>9}{r['output_tok_per_s']:>9.1f}{r['wall_s']:>9.2f}{r['cpu_s']:>9.2f}"
            f"{r['valid_outputs']:>5}/{len(prompts):<2}{r['canonical_tokenizations']:>8}/{len(prompts)}"
        )
    for key, value in summary.items():
        print(f"{key}: {value:.2f}" if isinstance(value, float) else f"{key}: {value}")
    if off["valid_outputs"] != len(prompts) or on["valid_outputs"] != len(prompts):
        print("WARNING: some outputs do not validate against the schema")

    args.out.parent.mkdir(parents=True, exist_ok=True)
    slim = {name: {k: v for k, v in r.items() if k != "texts"} for name, r in results.items()}
    payload = {"summary": summary, "runs": slim, "sample_output": on["texts"][0]}
    args.out.write_text(json.dumps(payload, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
