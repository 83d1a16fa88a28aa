"""benchmarks/bench_gpu.py: its skip without CUDA, its pieces (trace arithmetic, flag parsing, targets),
and one run of every CPU-capable code path on the tiny model (`--device cpu`), checking the JSON holds
every part with positive figures and that radixlm's greedy tokens equal transformers'."""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "benchmarks" / "bench_gpu.py"
sys.path.insert(0, str(REPO / "benchmarks"))
import bench_gpu  # noqa: E402


def run_script(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    path = os.environ.get("PYTHONPATH")
    base = os.environ | {"PYTHONPATH": f"{REPO}{os.pathsep}{path}" if path else str(REPO)}
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args],
        cwd=REPO,
        env=base | (env or {}),
        capture_output=True,
        text=True,
        timeout=600,
    )


def test_skips_with_a_message_without_cuda(tmp_path: Path) -> None:
    proc = run_script("--out-dir", str(tmp_path), env={"CUDA_VISIBLE_DEVICES": ""})
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == bench_gpu.SKIP_MESSAGE
    assert "needs a CUDA GPU" in proc.stdout
    assert not list(tmp_path.iterdir())  # nothing measured, nothing written


def test_device_busy_is_the_union_of_device_intervals() -> None:
    events = [
        {"ph": "X", "cat": "kernel", "ts": 0.0, "dur": 10.0},
        {"ph": "X", "cat": "kernel", "ts": 5.0, "dur": 10.0},  # overlaps the first (another stream): +5
        {"ph": "X", "cat": "gpu_memcpy", "ts": 20.0, "dur": 2.0},
        {"ph": "X", "cat": "gpu_memset", "ts": 21.0, "dur": 0.5},  # inside the memcpy: +0
        {"ph": "X", "cat": "kernel", "ts": 30.0, "dur": 4.0},
        {"ph": "X", "cat": "cuda_runtime", "ts": 0.0, "dur": 100.0},  # host side: ignored
        {"ph": "X", "cat": "user_annotation", "ts": 0.0, "dur": 100.0},
        {"ph": "i", "cat": "kernel", "ts": 50.0},  # not a duration event
    ]
    busy, count = bench_gpu.device_busy_us(events)
    assert busy == pytest.approx(15.0 + 2.0 + 4.0)
    assert count == 5
    assert bench_gpu.device_busy_us([]) == (0.0, 0)


def test_top_kernels_are_per_decode_step() -> None:
    """A full run's kernel time less a 1-token run's, over the decode steps, largest first."""

    def trace(*kernels: tuple[str, float]) -> list[dict]:
        events = [{"ph": "X", "cat": "kernel", "name": name, "ts": 0.0, "dur": dur} for name, dur in kernels]
        host = {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": 0.0, "dur": 9.0}
        return [*events, host]

    one = bench_gpu.kernel_totals(trace(("prefill_gemm", 50.0), ("matmul", 4.0)))
    full = bench_gpu.kernel_totals(
        trace(("prefill_gemm", 50.0), *[("matmul", 4.0)] * 5, *[("attention", 1.0)] * 4, ("sample", 0.5))
    )
    assert full["matmul"] == (20.0, 5) and "cudaLaunchKernel" not in full
    top = bench_gpu.top_kernels(full, one, steps=4, n=2)
    assert top == [("matmul", 4.0, 1.0), ("attention", 1.0, 1.0)]


def test_engine_argument_parsing() -> None:
    assert bench_gpu.parse_kv(
        ["disable_cuda_graph=true", "cuda-graph-max-bs=256", "mem_fraction_static=0.5"]
    ) == {
        "disable_cuda_graph": True,
        "cuda_graph_max_bs": 256,
        "mem_fraction_static": 0.5,
    }
    assert bench_gpu.parse_kv(["attention_backend=triton", "context_length=none"]) == {
        "attention_backend": "triton",
        "context_length": None,
    }
    assert bench_gpu.parse_variant("nograph:disable_cuda_graph=false,max_running_requests=8") == (
        "radixlm_nograph",
        {"disable_cuda_graph": False, "max_running_requests": 8},
    )
    for bad in ("no_equals_sign", "=3"):
        with pytest.raises(ValueError):
            bench_gpu.parse_kv([bad])
    with pytest.raises(ValueError):
        bench_gpu.parse_variant("no colon")


def _decode(side: str, batch: int, ms: float, tok_s: float) -> Any:
    return bench_gpu.DecodeRun(side, batch, 96, 128, 0.01, 1.0, ms, tok_s, tok_s, [], {}, [], [])


def _fewshot(side: str, wall: float) -> Any:
    return bench_gpu.FewshotRun(side, 256, 5, 64, wall, [], [wall], 1000, None, 256 * 64, [])


def test_targets_pass_and_miss() -> None:
    decode = {
        "radixlm": {1: _decode("radixlm", 1, 2.5, 400), 64: _decode("radixlm", 64, 4.0, 9000)},
        "hf_compile": {64: _decode("hf_compile", 64, 5.0, 5000)},
    }
    busy = {"radixlm": bench_gpu.BusyRun("radixlm", 64, 32, 4.0, 3.0, 0.75, 5.0, 0.6, 400, {})}
    fewshot = {n: _fewshot(n, w) for n, w in [("radixlm", 2.0), ("hf_eager", 9.0), ("hf_compile", 5.0)]}
    targets = {t.name: t for t in bench_gpu.build_targets(decode, busy, fewshot, 64)}
    assert len(targets) == 4
    assert targets["batch 1 decode ms/token"].passed is True  # 2.5 <= 3
    assert targets["batch 64 tokens/s vs transformers static + compile"].measured == pytest.approx(1.8)
    assert targets["batch 64 tokens/s vs transformers static + compile"].passed is False
    assert targets["GPU busy share of a decode step at batch 64"].passed is False  # 75% < 80%
    few = targets["few-shot GSM8K speed-up vs transformers"]
    assert few.measured == pytest.approx(2.5) and "hf_compile" in few.detail  # the faster baseline
    nothing = bench_gpu.build_targets({}, {}, {}, 64)
    assert [t.passed for t in nothing] == [None] * 4
    assert all(t.row()[3] == "not measured" for t in nothing)


def test_decode_prompts_are_distinct_and_exact(tiny_llama_dir: Path) -> None:
    from radixlm_runtime.io.tokenizer import load_tokenizer

    prompts = bench_gpu.decode_prompts(load_tokenizer(tiny_llama_dir), 64, 40)
    assert len(prompts) == 64 and {len(p) for p in prompts} == {40}
    assert len({tuple(p[:8]) for p in prompts}) == 64  # no two share even a short prefix


def test_agreement_counts() -> None:
    assert bench_gpu.agreement([1, 2, 3, 4], [1, 2, 9, 4]) == {
        "same_prefix": 2,
        "same_positions": 3,
        "tokens": 4,
    }


@pytest.fixture(scope="module")
def cpu_result(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    # The tiny model with room for a 1-shot GSM8K prompt (its 512 positions hold a question but not a shot).
    model = tmp_path_factory.mktemp("tiny_long") / "model"
    shutil.copytree(tiny_llama_dir, model)
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps(config | {"max_position_embeddings": 4096}))
    out = tmp_path_factory.mktemp("bench_gpu")
    proc = run_script(
        "--device",
        "cpu",
        "--tiny",
        "--model",
        str(model),
        "--out-dir",
        str(out),
        "--radixlm-variant",
        "torchattn:attention_backend=torch",
        "--fewshot-no-cache",
    )
    assert proc.returncode == 0, f"{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    assert "Issue 14 targets" in proc.stdout
    assert not (out / "gpu.partial.json").exists()
    return json.loads((out / "gpu.json").read_text())


@pytest.mark.slow
def test_cpu_run_measures_every_part(cpu_result: dict[str, Any]) -> None:
    r = cpu_result
    assert r["name"] == "gpu" and r["device"] == "cpu" and r["dtype"] == "float32"
    assert r["errors"] == {}
    assert {"model", "dtype", "date", "transformers", "torch", "cpu"} <= set(r["machine"])
    assert "LlamaForCausalLM" in r["machine"]["model"]
    # decode: every CPU side at both --tiny batch sizes. The per-token figures are differences of two
    # best walls (full run minus a 1-token run), below timing noise at this size on a busy machine:
    # only their consistency is checked.
    assert set(r["decode"]) == {"radixlm", "radixlm_torchattn", "hf_eager"}
    for side, runs in r["decode"].items():
        assert [run["batch_size"] for run in runs] == [1, 4], side
        for run in runs:
            for key in ("ttft_s", "wall_s", "tokens_per_s"):
                assert run[key] > 0, (side, key)
            per_token = (run["wall_s"] - run["ttft_s"]) / (run["new_tokens"] - 1)
            assert run["decode_ms_per_token"] == pytest.approx(1e3 * per_token)
            if per_token > 0:
                assert run["decode_tokens_per_s"] == pytest.approx(run["batch_size"] / per_token)
            else:
                assert math.isnan(run["decode_tokens_per_s"])
            assert run["new_tokens"] == 8 and run["prompt_tokens"] == 16
            assert len(run["first_output_ids"]) == 8
            assert run["warmup_s"] and all(w > 0 for w in run["warmup_s"])
    # fewshot: radixlm with and without its cache, and transformers.
    few = r["fewshot"]
    assert set(few) == {"radixlm", "radixlm_torchattn", "radixlm_no_cache", "hf_eager"}
    for side, run in few.items():
        assert run["wall_s"] > 0 and run["questions_per_s"] > 0, side
        assert run["questions"] == 4 and run["output_tokens"] == 4 * 4
    assert few["radixlm"]["cached_tokens"] > 0  # the shared few-shot prefix came from the radix cache
    assert few["radixlm_no_cache"]["cached_tokens"] == 0
    assert few["hf_eager"]["cached_tokens"] is None
    # The parts and sides that need CUDA say so instead of measuring.
    assert "CUDA" in r["skipped"]["busy"] and "CUDA" in r["skipped"]["hf_compile"]
    assert r["busy"] == {}
    assert len(r["targets"]) == 4 and r["tables"] and r["notes"]


@pytest.mark.slow
def test_cpu_run_greedy_tokens_match_transformers(cpu_result: dict[str, Any]) -> None:
    """fp32 on the tiny model: radixlm's greedy tokens are transformers' exactly, for every request."""
    decode = {side: {run["batch_size"]: run for run in runs} for side, runs in cpu_result["decode"].items()}
    for batch in (1, 4):
        ours = decode["radixlm"][batch]["first_output_ids"]
        assert ours == decode["hf_eager"][batch]["first_output_ids"]
        assert ours == decode["radixlm_torchattn"][batch]["first_output_ids"]
    agree = cpu_result["agreement"]
    assert agree["decode_batch1_vs_radixlm"]["hf_eager"] == {
        "same_prefix": 8,
        "same_positions": 8,
        "tokens": 8,
    }
    # JSON object keys are strings: batch size -> requests whose whole output is identical.
    assert agree["decode_same_outputs_vs_radixlm"] == {
        "radixlm_torchattn": {"1": 1, "4": 4},
        "hf_eager": {"1": 1, "4": 4},
    }
    assert agree["fewshot_same_outputs_vs_radixlm"] == {
        "radixlm_torchattn": 4,
        "radixlm_no_cache": 4,
        "hf_eager": 4,
    }
