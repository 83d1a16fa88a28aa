"""Constrained decoding, side by side in one run: each grammar backend's compile time and per-token
mask cost on four constraints, the cost of applying token masks to CPU logits, and decode throughput
with a constraint as a ratio of unconstrained decoding (batch 1 and 32), plus jump-forward on/off.

Constraints: a 6-field JSON schema (strings with maxLength / pattern, integer range, number,
boolean, array), a pydantic model with $ref and anyOf (nested models, an enum, nullable fields), an
IPv4 regex and an arithmetic EBNF grammar. Cold compile = first compile of that constraint (the
backend's vocabulary index already built, timed separately); warm = served from the compiled-grammar
cache; mask = median time of one step's allowed_mask + advance along a valid output.

    python benchmarks/bench_constrained.py            # default model, batch 1 and 32
    python benchmarks/bench_constrained.py --tiny     # batch 1 and 4, few tokens
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable
from enum import Enum
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import torch
from common import (
    Size,
    Table,
    add_list_flag,
    bench_parser,
    fmt,
    list_flag,
    parse_sizes,
    pyplot,
    save_figure,
    save_result,
)
from pydantic import BaseModel, Field

import radixlm_runtime as rt
from radixlm_runtime.config import GRAMMAR_BACKENDS
from radixlm_runtime.constrained.backend import make_backend
from radixlm_runtime.constrained.compiler import GrammarCompiler
from radixlm_runtime.constrained.constraint import Constraint
from radixlm_runtime.io.tokenizer import load_tokenizer
from radixlm_runtime.models.loader import resolve_model_path
from radixlm_runtime.sampling.sampler import apply_token_bitmask_

NAME = "constrained"
SIZES = {
    "max_new_tokens": Size(64, 8, "output tokens per request in the throughput runs", scales=False),
    "mask_batch": Size(8, 8, "rows of CPU logits the mask application is timed on", scales=False),
}
T = TypeVar("T")

SIX_FIELD = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "email": {"type": "string", "pattern": "^[a-z0-9.]+@[a-z]+\\.com$"},
        "score": {"type": "number"},
        "active": {"type": "boolean"},
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 4},
    },
    "required": ["name", "age", "email", "score", "active", "tags"],
}


class Kind(str, Enum):
    cat = "cat"
    dog = "dog"


class Address(BaseModel):
    street: str
    city: str
    zip: str | None = None


class Pet(BaseModel):
    name: str
    kind: Kind


class Person(BaseModel):
    name: str
    age: int = Field(ge=0)
    address: Address
    pets: list[Pet]
    nickname: str | None = None


IPV4 = r"((25[0-5]|2[0-4]\d|[01]?\d\d?)\.){3}(25[0-5]|2[0-4]\d|[01]?\d\d?)"
ARITHMETIC = (
    'root ::= expr\nexpr ::= term (("+" | "-") term)*\nterm ::= factor (("*" | "/") factor)*\n'
    'factor ::= [0-9]+ | "(" expr ")"'
)
# (constraint, a valid output to walk the mask along)
CASES = {
    "six_field_schema": (
        Constraint("json_schema", json.dumps(SIX_FIELD)),
        '{"name":"Ann","age":31,"email":"ann@x.com","score":1.5,"active":true,"tags":["a","b"]}',
    ),
    "pydantic_ref_anyof": (
        Constraint("json_schema", json.dumps(Person.model_json_schema())),
        '{"name":"Ann","age":31,"address":{"street":"Main","city":"Oslo","zip":null},'
        '"pets":[{"name":"Rex","kind":"dog"}],"nickname":null}',
    ),
    "ipv4_regex": (Constraint("regex", IPV4), "192.168.10.254"),
    "ebnf_arithmetic": (Constraint("ebnf", ARITHMETIC), "12*(3+4)-5/6"),
}
# Unbounded text; both runs ignore EOS where the constraint lets them (a request may still end early
# when the model takes EOS at an accepting point, which the guide then ends on).
LONG_REGEX = "[a-z ,.]+"
# Token budget of the jump-forward runs: room for the whole six-field document.
JSON_BUDGET = 256


def timed(fn: Callable[[], T]) -> tuple[T, float]:
    start = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - start


def compile_and_mask(backend_name: str, tokenizer: Any, eos: frozenset[int], vocab: int) -> dict[str, Any]:
    """Per case: cold and warm compile, per-token mask + advance (median, microseconds)."""
    backend, t_backend = timed(lambda: make_backend(backend_name, tokenizer, eos, vocab))
    compiler = GrammarCompiler(lambda: backend)
    out: dict[str, Any] = {"backend_init_s": t_backend, "cases": {}}
    for name, (constraint, text) in CASES.items():
        compiled, cold = timed(lambda c=constraint: compiler.compile(c))
        _, warm = timed(lambda c=constraint: compiler.compile(c))
        guide = compiler.guide(compiled)
        steps = []
        for token in tokenizer.encode(text, add_special_tokens=False):
            _, t = timed(lambda g=guide, tok=token: (g.allowed_mask(vocab), g.advance(tok)))
            steps.append(t)
        assert guide.is_accepting(), (backend_name, name)
        out["cases"][name] = {"cold_s": cold, "warm_s": warm, "mask_us": statistics.median(steps) * 1e6}
    compiler.shutdown()
    return out


def mask_apply(rows: int, vocab: int) -> dict[str, float]:
    """Microseconds to mask [rows, vocab] CPU logits: the int32 bitmask vs a bool mask (the former
    path), median of 50."""
    rng = np.random.default_rng(0)
    bools = torch.from_numpy(rng.random((rows, vocab)) < 0.1)
    bits = torch.from_numpy(np.packbits(bools.numpy(), axis=1, bitorder="little").view(np.int32).copy())
    logits = torch.randn(rows, vocab)

    def median_us(fn: Callable[[torch.Tensor], None]) -> float:
        times = []
        for _ in range(50):
            x = logits.clone()
            times.append(timed(lambda x=x: fn(x))[1])
        return statistics.median(times) * 1e6

    return {
        "bitmask_us": median_us(lambda x: apply_token_bitmask_(x, bits)),
        "bool_mask_us": median_us(lambda x: x.masked_fill_(~bools, float("-inf"))),
    }


def throughput(engine: rt.Engine, prompts: list[str], params: dict[str, Any]) -> float:
    """Output tokens per second of one batch, after a warm-up that compiles the constraint."""
    engine.generate(prompts[0], params | {"max_new_tokens": 2})
    engine.flush_cache()
    outs, wall = timed(lambda: engine.generate(prompts, params))
    return sum(o["meta_info"]["completion_tokens"] for o in outs) / wall


def decode_runs(model: str | None, batches: list[int], max_new_tokens: int) -> dict[str, Any]:
    """Constrained / unconstrained throughput per backend and batch size, and jump-forward on/off
    on the six-field schema at the largest batch."""
    plain = {"temperature": 0, "max_new_tokens": max_new_tokens, "ignore_eos": True}
    prompts = [f"Write a sentence about the number {i}." for i in range(max(batches))]
    out: dict[str, Any] = {}
    for backend in GRAMMAR_BACKENDS:
        engine = rt.Engine(model, grammar_backend=backend, log_level="warning")
        for b in batches:
            base = throughput(engine, prompts[:b], plain)
            constrained = throughput(engine, prompts[:b], plain | {"regex": LONG_REGEX})
            out[f"{backend}_batch{b}"] = {"unconstrained_tok_s": base, "constrained_tok_s": constrained}
        engine.shutdown()
    schema = {"json_schema": json.dumps(SIX_FIELD), "temperature": 0, "max_new_tokens": JSON_BUDGET}
    for label, disable in (("jump_forward_on", False), ("jump_forward_off", True)):
        engine = rt.Engine(model, disable_jump_forward=disable, log_level="warning")
        engine.generate(prompts[0], schema)
        engine.flush_cache()
        outs, wall = timed(lambda e=engine: e.generate(prompts[: max(batches)], schema))
        steps = engine.get_server_info()["forward_passes"]
        out[label] = {"wall_s": wall, "forward_passes": steps, "texts": [o["text"] for o in outs]}
        engine.shutdown()
    return out


def plot(path: Path, compiles: dict[str, Any]) -> None:
    """Cold compile and per-token mask of each constraint, backends side by side (log scales)."""
    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.2))
    cases = list(CASES)
    width = 0.8 / len(compiles)
    for ax, key, scale, label in (
        (axes[0], "cold_s", 1e3, "cold compile (ms)"),
        (axes[1], "mask_us", 1.0, "mask + advance (µs)"),
    ):
        for i, (backend, res) in enumerate(compiles.items()):
            values = [res["cases"][c][key] * scale for c in cases]
            ax.barh([y + i * width for y in range(len(cases))], values, width, label=backend)
        ax.set_yticks([y + width / 2 for y in range(len(cases))], cases)
        ax.set_xscale("log")
        ax.set_xlabel(label)
    axes[0].legend()
    save_figure(fig, path)


def main(argv: list[str] | None = None) -> None:
    ap = bench_parser(__doc__, SIZES)
    add_list_flag(ap, "--batches", "batch sizes of the throughput runs", "1,32", "1,4")
    args, sizes = parse_sizes(ap, argv, SIZES)
    batches = list_flag(args, "--batches", int)
    model_dir = resolve_model_path(None)
    tokenizer = load_tokenizer(model_dir)
    vocab = len(tokenizer)
    eos = frozenset({int(tokenizer.eos_token_id)})
    compiles = {b: compile_and_mask(b, tokenizer, eos, vocab) for b in GRAMMAR_BACKENDS}
    apply = mask_apply(sizes["mask_batch"], vocab)
    decode = decode_runs(None, batches, sizes["max_new_tokens"])

    rows = [
        [case, backend, fmt(r["cold_s"] * 1e3, ".1f", " ms"), fmt(r["warm_s"] * 1e6, ".0f", " µs"),
         fmt(r["mask_us"], ".0f", " µs")]
        for backend, res in compiles.items()
        for case, r in res["cases"].items()
    ]  # fmt: skip
    compile_table = Table(
        f"Compile and per-token mask, vocabulary {vocab}",
        ["constraint", "backend", "cold", "warm", "mask+advance"],
        rows,
    )
    ratio_rows = []
    for key, r in decode.items():
        if key.startswith(GRAMMAR_BACKENDS):
            ratio = r["constrained_tok_s"] / r["unconstrained_tok_s"]
            ratio_rows.append(
                [
                    key,
                    fmt(r["unconstrained_tok_s"], ".1f"),
                    fmt(r["constrained_tok_s"], ".1f"),
                    fmt(ratio, ".2f", "x"),
                ]
            )
    decode_table = Table(
        "Decode throughput, constrained vs unconstrained (output tok/s)",
        ["backend / batch", "unconstrained", "constrained", "ratio"],
        ratio_rows,
    )
    on, off = decode["jump_forward_on"], decode["jump_forward_off"]
    notes = [
        "backend vocabulary index: "
        + ", ".join(f"{b} {compiles[b]['backend_init_s']:.2f} s" for b in GRAMMAR_BACKENDS),
        f"mask application on CPU logits [{sizes['mask_batch']}, {vocab}]: int32 bitmask "
        f"{apply['bitmask_us']:.0f} µs, bool mask {apply['bool_mask_us']:.0f} µs",
        f"jump-forward on the six-field schema at batch {max(batches)}: {off['wall_s'] / on['wall_s']:.2f}x "
        f"({on['forward_passes']} vs {off['forward_passes']} forward passes)",
    ]
    args.out_dir.mkdir(parents=True, exist_ok=True)
    figure = f"{NAME}.png"
    plot(args.out_dir / figure, compiles)
    save_result(
        args.out_dir,
        NAME,
        {"compile": compiles, "mask_apply_us": apply, "decode": decode, "vocab_size": vocab},
        tables=[compile_table, decode_table],
        notes=notes,
        figures=[figure],
        sizes=sizes,
    )


if __name__ == "__main__":
    main()
