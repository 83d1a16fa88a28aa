"""Few-shot GSM8K through the offline engine, side by side with its baselines.

Every question sits behind the same k-shot prefix; all prompts are submitted together. Runs, in one
process on the same weights: radixlm (radix cache on), radixlm with the radix cache disabled, and a
plain `transformers` `model.generate` loop (greedy, left-padded batches). Prints each figure and the
ratios, and writes them as JSON.

    python benchmarks/bench_fewshot_engine.py                 # 32 questions, 5 shots
    python benchmarks/bench_fewshot_engine.py --num-questions 8 --max-new-tokens 16   # quick
"""

from __future__ import annotations

import argparse
import gc
import json
import time
from pathlib import Path

import torch

import radixlm_runtime as rt
from radixlm.eval.data import extract_gsm8k_number, gsm8k_fewshot_prefix, gsm8k_question_suffix, load_gsm8k


def run_radixlm(prompts: list[str], max_new_tokens: int, disable_radix_cache: bool) -> dict:
    engine = rt.Engine(disable_radix_cache=disable_radix_cache, log_level="warning")
    params = {"temperature": 0, "max_new_tokens": max_new_tokens}
    t0 = time.perf_counter()
    outs = engine.generate(prompts, params)
    wall = time.perf_counter() - t0
    prompt_tokens = sum(o["meta_info"]["prompt_tokens"] for o in outs)
    cached = sum(o["meta_info"]["cached_tokens"] for o in outs)
    completion = sum(o["meta_info"]["completion_tokens"] for o in outs)
    engine.shutdown()
    return {
        "wall_s": wall,
        "prompt_tokens": prompt_tokens,
        "cached_tokens": cached,
        "cache_hit_rate": cached / prompt_tokens,
        "completion_tokens": completion,
        "output_tok_per_s": completion / wall,
        "texts": [o["text"] for o in outs],
        "output_ids": [o["output_ids"] for o in outs],
    }


def run_transformers(model_dir: Path, prompts: list[str], max_new_tokens: int, batch_size: int) -> dict:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    tok.padding_side = "left"
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    texts: list[str] = []
    completion = 0
    t0 = time.perf_counter()
    for i in range(0, len(prompts), batch_size):
        enc = tok(prompts[i : i + batch_size], return_tensors="pt", padding=True)
        with torch.inference_mode():
            out = model.generate(
                **enc, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=tok.pad_token_id
            )
        for row in out[:, enc["input_ids"].shape[1] :]:
            ids = row.tolist()
            if tok.eos_token_id in ids:
                ids = ids[: ids.index(tok.eos_token_id)]
            completion += len(ids)
            texts.append(tok.decode(ids, skip_special_tokens=True))
    wall = time.perf_counter() - t0
    return {
        "wall_s": wall,
        "completion_tokens": completion,
        "output_tok_per_s": completion / wall,
        "texts": texts,
    }


def accuracy(texts: list[str], labels: list[str]) -> float:
    hits = 0
    for text, label in zip(texts, labels):
        answer = text.split("Question:")[0]
        hits += extract_gsm8k_number(answer) == label
    return hits / len(labels)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--num-questions", type=int, default=32)
    ap.add_argument("--num-shots", type=int, default=5)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--hf-batch-size", type=int, default=8)
    ap.add_argument("--skip-transformers", action="store_true", help="Skip the transformers baseline.")
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/fewshot_engine.json"))
    args = ap.parse_args()

    prefix = gsm8k_fewshot_prefix(args.num_shots)
    items = load_gsm8k("test", args.num_questions)
    prompts = [prefix + gsm8k_question_suffix(it.question) for it in items]
    labels = [it.label for it in items]

    results: dict[str, dict] = {}
    results["radixlm"] = run_radixlm(prompts, args.max_new_tokens, disable_radix_cache=False)
    gc.collect()
    results["radixlm_no_cache"] = run_radixlm(prompts, args.max_new_tokens, disable_radix_cache=True)
    gc.collect()
    if not args.skip_transformers:
        from radixlm_runtime.models.loader import resolve_model_path

        results["transformers"] = run_transformers(
            resolve_model_path(None), prompts, args.max_new_tokens, args.hf_batch_size
        )

    on, off = results["radixlm"], results["radixlm_no_cache"]
    same = sum(a == b for a, b in zip(on["output_ids"], off["output_ids"]))
    summary = {
        "num_questions": len(prompts),
        "num_shots": args.num_shots,
        "max_new_tokens": args.max_new_tokens,
        "threads": torch.get_num_threads(),
        "cache_hit_rate": on["cache_hit_rate"],
        "identical_outputs_cache_on_vs_off": same / len(prompts),
        "speedup_vs_no_cache": off["wall_s"] / on["wall_s"],
    }
    if "transformers" in results:
        summary["speedup_vs_transformers"] = results["transformers"]["wall_s"] / on["wall_s"]
    for r in results.values():
        r["accuracy"] = accuracy(r["texts"], labels)

    print(
        f"\nfew-shot GSM8K: {len(prompts)} questions x {args.num_shots} shots, "
        f"greedy, max_new_tokens={args.max_new_tokens}, {torch.get_num_threads()} threads"
    )
    print(f"{'system':<20}{'wall s':>10}{'out tok/s':>12}{'hit rate':>10}{'accuracy':>10}")
    for name, r in results.items():
        hit = f"{r['cache_hit_rate']:.3f}" if "cache_hit_rate" in r else "-"
        print(f"{name:<20}{r['wall_s']:>10.2f}{r['output_tok_per_s']:>12.1f}{hit:>10}{r['accuracy']:>10.3f}")
    for key, value in summary.items():
        print(f"{key}: {value:.3f}" if isinstance(value, float) else f"{key}: {value}")

    args.out.parent.mkdir(parents=True, exist_ok=True)
    slim = {
        name: {k: v for k, v in r.items() if k not in ("texts", "output_ids")} for name, r in results.items()
    }
    args.out.write_text(json.dumps({"summary": summary, "systems": slim}, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
