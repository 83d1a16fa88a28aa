"""Runs every benchmark script at its --tiny size, as `run_all.py` would, so none of them rots; checks
the structure and sanity of the JSON each writes (agreement between systems, rates in range), never
wall-clock figures. Then renders a copy of the README from those results."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
BENCH = REPO / "benchmarks"
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def run(args: list[str], timeout: float = 600, extra_env: dict[str, str] | None = None) -> None:
    """Runs a benchmark script on the CPU whatever the test device: the benchmarks measure the CPU
    runtime (int4 weights among its systems) against CPU peers."""
    path = os.environ.get("PYTHONPATH")
    env = os.environ | {"PYTHONPATH": f"{REPO}{os.pathsep}{path}" if path else str(REPO)}
    env |= {"CUDA_VISIBLE_DEVICES": ""} | (extra_env or {})
    proc = subprocess.run(
        [sys.executable, *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout
    )
    assert proc.returncode == 0, (
        f"{args} exited {proc.returncode}\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    )


def run_tiny(
    script: str, out_dir: Path, name: str, *flags: str, extra_env: dict[str, str] | None = None
) -> dict[str, Any]:
    run([str(BENCH / script), "--tiny", "--out-dir", str(out_dir), *flags], extra_env=extra_env)
    result = json.loads((out_dir / f"{name}.json").read_text())
    assert result["name"] == name
    assert result["command"].startswith(f"python benchmarks/{script} --tiny")
    assert {"cpu", "logical_cores", "torch_threads", "model", "dtype"} <= set(result["machine"])
    assert result["tables"] and result["figures"]
    for table in result["tables"]:
        assert table["rows"] and all(len(row) == len(table["headers"]) for row in table["rows"])
    for figure in result["figures"]:
        assert (out_dir / figure).read_bytes()[:8] == PNG_MAGIC
    return result


@pytest.fixture(scope="module")
def out_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("bench_results")


@pytest.fixture(scope="module")
def fewshot(out_dir: Path) -> dict[str, Any]:
    return run_tiny("bench_fewshot_engine.py", out_dir, "fewshot_engine")


@pytest.fixture(scope="module")
def serving(out_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    # vLLM's environment pointed at an empty folder: its server is skipped with the reason, whether or
    # not this machine has it (starting it takes minutes).
    no_vllm = {"RADIXLM_VLLM_VENV": str(tmp_path_factory.mktemp("no_vllm"))}
    servers = "radixlm,radixlm_no_cache,vllm_cpu"
    return run_tiny("bench_serving.py", out_dir, "serving", "--servers", servers, extra_env=no_vllm)


@pytest.fixture(scope="module")
def startup(out_dir: Path) -> dict[str, Any]:
    return run_tiny("bench_startup.py", out_dir, "startup")


@pytest.fixture(scope="module")
def program_prefix(out_dir: Path) -> dict[str, Any]:
    return run_tiny("bench_program_prefix.py", out_dir, "program_prefix")


@pytest.fixture(scope="module")
def programs(out_dir: Path) -> dict[str, Any]:
    return run_tiny("bench_programs.py", out_dir, "programs")


@pytest.fixture(scope="module")
def constrained(out_dir: Path) -> dict[str, Any]:
    return run_tiny("bench_constrained.py", out_dir, "constrained")


@pytest.fixture(scope="module")
def host_overhead(out_dir: Path) -> dict[str, Any]:
    return run_tiny("bench_host_overhead.py", out_dir, "host_overhead")


@pytest.fixture(scope="module")
def linear_cpu(out_dir: Path) -> dict[str, Any]:
    return run_tiny("bench_linear_cpu.py", out_dir, "linear_cpu")


@pytest.fixture(scope="module")
def attention_cpu(out_dir: Path) -> dict[str, Any]:
    return run_tiny("bench_attention_cpu.py", out_dir, "attention_cpu")


@pytest.fixture(scope="module")
def tp(out_dir: Path) -> dict[str, Any]:
    return run_tiny("bench_tp.py", out_dir, "tp")


@pytest.fixture(scope="module")
def jump_forward(out_dir: Path) -> dict[str, Any]:
    return run_tiny("bench_jump_forward.py", out_dir, "jump_forward")


@pytest.fixture(scope="module")
def speculative(out_dir: Path) -> dict[str, Any]:
    return run_tiny("bench_speculative.py", out_dir, "speculative")


@pytest.fixture(scope="module")
def single_stream(out_dir: Path) -> dict[str, Any]:
    return run_tiny("bench_single_stream.py", out_dir, "single_stream")


def test_fewshot_engine(fewshot: dict[str, Any]) -> None:
    assert set(fewshot["systems"]) == {"gsm8k", "mmlu"}
    for task, systems in fewshot["systems"].items():
        expected = {"radixlm", "radixlm_no_cache", "transformers"}
        assert expected <= set(systems), task
        assert "llama_cpp" in systems or "llama_cpp" in fewshot["skipped"]
        for name, r in systems.items():
            assert r["num_questions"] == fewshot["summary"][task]["num_questions"] > 0
            assert 0 <= r["correct"] <= r["num_questions"]
            assert r["wall_s"] > 0 and r["questions_per_s"] > 0
            hit = r["cache_hit_rate"]
            if name == "transformers":
                assert hit is None
            else:
                assert 0.0 <= hit <= 1.0, (task, name, hit)
        # The shared few-shot prefix is served from the cache, and only when the cache is on.
        assert systems["radixlm"]["cache_hit_rate"] > 0
        assert systems["radixlm_no_cache"]["cache_hit_rate"] == 0
        summary = fewshot["summary"][task]
        assert summary["same_outputs_vs_radixlm_no_cache"] == 1.0, task
        assert summary["accuracy_gap_vs_transformers_questions"] <= summary["accuracy_gap_allowed_questions"]
    assert fewshot["summary"]["mmlu"]["max_logprob_diff_cache_on_vs_off"] < 1e-3


def test_fewshot_engine_arithmetic(tmp_path: Path, tmp_path_factory: pytest.TempPathFactory) -> None:
    """radixlm's bf16 and int8-activation variants beside float32 (each run or skipped with the reason),
    their agreement with float32 radixlm per task; vLLM-CPU bf16 skipped (its environment pointed at an
    empty folder: it takes minutes to start) and so no target against it."""
    no_vllm = {"RADIXLM_VLLM_VENV": str(tmp_path_factory.mktemp("no_vllm"))}
    variants = ["radixlm_bf16", "radixlm_int4_a8", "radixlm_int4_a8_no_cache"]
    systems = ",".join(["radixlm", *variants, "vllm_cpu_bf16"])
    result = run_tiny(
        "bench_fewshot_engine.py", tmp_path, "fewshot_engine", "--systems", systems, extra_env=no_vllm
    )
    assert "vllm_cpu/install.sh" in result["skipped"]["vllm_cpu_bf16"]
    for task, runs in result["systems"].items():
        assert set(runs) | set(result["skipped"]) == {"radixlm", *variants, "vllm_cpu_bf16"}, task
        summary = result["summary"][task]
        assert set(summary["agreement_vs_fp32"]) == set(runs) - {"radixlm"}
        for found in summary["agreement_vs_fp32"].values():
            assert 0 <= found["identical"] <= 1
            assert ("token_agreement" in found) == (task == "gsm8k")
        assert summary["targets"] == {}
    assert all(t["headers"][-1] == "same as radixlm fp32" for t in result["tables"])


def test_serving(serving: dict[str, Any]) -> None:
    assert set(serving["servers"]) == {"radixlm", "radixlm_no_cache"}
    assert "vllm_cpu/install.sh" in serving["skipped"]["vllm_cpu"]
    assert serving["workload"]["fewshot_requests"] > 0 and serving["workload"]["chat_requests"] > 0
    for name, points in serving["servers"].items():
        assert [p["rate"] for p in points] == serving["rates"]
        for p in points:
            assert p["num_requests"] == serving["sizes"]["num_requests"]
            assert p["completion_tokens"] == p["num_requests"] * serving["sizes"]["max_new_tokens"]
            for key in ("ttft_ms", "itl_ms", "e2e_ms"):
                q = p[key]
                assert 0 < q["p50"] <= q["p90"] <= q["p99"], (name, key, q)
            assert 0.0 <= p["cache_hit_rate"] <= 1.0
            if name == "radixlm_no_cache":
                assert p["cache_hit_rate"] == 0
    mix = serving["long_mix"]
    assert set(mix["chunking"]) == {"mixed", "fixed"}
    for p in mix["chunking"].values():
        assert p["num_requests"] == serving["sizes"]["long_mix_requests"] and p["num_long"] >= 1
        assert p["completion_tokens"] == p["num_requests"] * serving["sizes"]["max_new_tokens"]
        for key in ("short_ttft_ms", "long_ttft_ms", "itl_ms"):
            assert 0 < p[key]["p50"] <= p[key]["p99"], (key, p[key])
        assert p["itl_p99_over_p50"] >= 1
    assert [t["title"].startswith("Long-prompt mix") for t in serving["tables"]] == [False, True]


def test_startup(startup: dict[str, Any]) -> None:
    assert len(startup["times_s"]) == startup["sizes"]["runs"] == 1
    assert all(t > 0 for t in startup["times_s"])


def test_constrained(constrained: dict[str, Any]) -> None:
    assert constrained["vocab_size"] > 1000
    assert set(constrained["compile"]) == {"llguidance", "xgrammar"}
    for backend in constrained["compile"].values():
        assert set(backend["cases"]) == {
            "six_field_schema",
            "pydantic_ref_anyof",
            "ipv4_regex",
            "ebnf_arithmetic",
        }
        assert all(
            c["cold_s"] > 0 and c["warm_s"] >= 0 and c["mask_us"] > 0 for c in backend["cases"].values()
        )
    decode = constrained["decode"]
    for backend in ("llguidance", "xgrammar"):
        for batch in (1, 4):
            r = decode[f"{backend}_batch{batch}"]
            assert r["unconstrained_tok_s"] > 0 and r["constrained_tok_s"] > 0
    for mode in ("jump_forward_on", "jump_forward_off"):
        for text in decode[mode]["texts"]:
            json.loads(text)  # valid under any budget: complete documents
    assert decode["jump_forward_on"]["forward_passes"] < decode["jump_forward_off"]["forward_passes"]


def test_jump_forward(jump_forward: dict[str, Any]) -> None:
    off, on = jump_forward["systems"]["off"], jump_forward["systems"]["on"]
    n = jump_forward["sizes"]["num_inputs"]
    assert off["valid_outputs"] == on["valid_outputs"] == n
    assert off["jumps"] == off["jump_tokens"] == 0 < on["jumps"]
    assert on["decode_steps"] < off["decode_steps"] and on["sampled_tokens"] < off["sampled_tokens"]
    assert on["completion_tokens"] == on["sampled_tokens"] + on["jump_tokens"]


def test_tp(tp: dict[str, Any]) -> None:
    one, two = tp["results"]
    assert (one["tp"], two["tp"]) == (1, 2) and tp["batches"] == [1, 2]
    collectives = 2 * two["layers"] + 2  # after each attention and MLP block, the embedding, the logits
    for r, per_step in ((one, 0), (two, collectives)):
        phases = [r["prefill"], *r["decode"].values()]
        assert r["prefill"]["steps"] == tp["sizes"]["prefills"]
        assert [s["steps"] for s in r["decode"].values()] == [tp["sizes"]["steps"]] * 2
        for s in phases:
            assert s["collectives_per_step"] == per_step and s["step_ms"] > 0
            assert (0 < s["comm_share"] < 1) if per_step else s["comm_ms"] == 0
    assert one["decoder"] == two["decoder"] == "C++ one call"


def test_host_overhead(host_overhead: dict[str, Any]) -> None:
    steps = host_overhead["sizes"]["steps"]
    assert [r["batch_size"] for r in host_overhead["results"]] == host_overhead["batch_sizes"] == [2, 4]
    for r in host_overhead["results"]:
        # Every decode step after the prefill ran with all B requests, and only those were kept.
        assert r["steps_kept"] == steps and r["steps_total"] == steps + 1, r
        assert len(r["per_step"]["step_ms"]) == len(r["per_step"]["forward_ms"]) == steps
        assert 0 < r["forward_ms"] < r["step_ms"]
        assert r["host_overhead_ms"] > 0 and 0 < r["host_share"] < 1
        # A decode step must at least read the sampled token ids back.
        assert 1 <= r["host_reads_median"] <= r["host_reads_max"]
        assert sum(r["host_reads_by_method"].values()) >= steps
    assert [row[0] for row in host_overhead["tables"][0]["rows"]] == ["2", "4"]


def test_long_context(out_dir: Path) -> None:
    """Every turn of every conversation is measured on both radixlm servers; with the host tier the
    follow-ups find the document in the cache, without it the pool (half the documents) has lost it."""
    result = run_tiny("bench_long_context.py", out_dir, "long_context")
    servers = result["servers"]
    assert list(servers) == ["host_off", "host_on"]
    assert result["pool_tokens"] < result["working_set_tokens"]
    for turns in servers.values():
        assert len(turns) == 3 and all(t["ttft_ms_mean"] > 0 for t in turns)
        assert [t["prompt_tokens"] for t in turns] == [t["prompt_tokens"] for t in servers["host_off"]]
    assert all(t["cached_share"] > 0.9 for t in servers["host_on"][1:])
    assert all(t["cached_share"] < 0.5 for t in servers["host_off"][1:])


def test_dashboard(out_dir: Path) -> None:
    """Both modes serve every round, the open page's feeds answer, and the tree snapshot is timed at
    each size (the stand-in scheduler carries every field the snapshot reads)."""
    run([str(BENCH / "bench_dashboard.py"), "--tiny", "--out-dir", str(out_dir)])
    result = json.loads((out_dir / "dashboard.json").read_text())
    assert result["name"] == "dashboard" and result["tables"][0]["rows"]
    assert set(result["median_output_tok_per_s"]) == {"closed", "open"}
    assert all(v > 0 for v in result["median_output_tok_per_s"].values())
    assert len(result["open_over_closed_per_round"]) == len(result["feed_seconds_per_round"]) >= 1
    assert set(result["tree_snapshot_ms"]) == {"100", "2000", "10000"}


def test_kv_tiers(out_dir: Path) -> None:
    """Every server gets every request; only those with a host tier load prefixes back from it, and
    the hit rates are shares of the prompt tokens. --throughput runs every server with the steps beside
    decoding streams sized by time, and names the result apart."""
    result = run_tiny("bench_kv_tiers.py", out_dir, "kv_tiers_throughput", "--throughput")
    assert result["server_flags"] == ["--prefill-step-decode-ratio", "0"]
    assert "--prefill-step-decode-ratio 0" in result["tables"][0]["title"]
    servers = result["servers"]
    off = servers["host_off"]
    assert list(servers) == ["host_off", "write_back", "write_through", "host_disk"]
    assert result["pool_tokens"] < result["working_set_tokens"]
    assert off["host_hit_rate"] == 0 and off["host_loaded_tokens"] == 0 == off["host_stored_tokens"]
    for name, r in servers.items():
        assert r["requests"] == 12 and r["prompt_tokens"] == off["prompt_tokens"]
        hit_rate = r["device_hit_rate"] + r["host_hit_rate"] + r["disk_hit_rate"]
        assert 0 <= hit_rate <= 1 and r["request_throughput"] > 0
        if name != "host_off":
            assert r["host_loaded_tokens"] > 0 and 0 < r["host_hit_rate"] <= 1
        # Only the server with a disk tier writes to it and reads prefixes back from it.
        assert (r["disk_loaded_tokens"] > 0 and r["disk_hit_rate"] > 0) == (name == "host_disk")
    # Write-through copies everything it caches; write-back only what the pool evicts.
    assert servers["write_through"]["host_stored_tokens"] >= servers["write_back"]["host_stored_tokens"]
    assert servers["host_disk"]["disk_stored_tokens"] >= servers["host_disk"]["disk_loaded_tokens"]
    assert all(r["runs_req_s"] == [r["request_throughput"]] for r in servers.values())  # one run each


def test_kv_tiers_reports_the_run_of_median_throughput(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(BENCH))
    import bench_kv_tiers

    runs = [{"request_throughput": v, "run": i} for i, v in enumerate([1.9, 1.7, 2.1, 1.8])]
    median = bench_kv_tiers.median_run(runs)
    assert median["run"] == 3 and median["runs_req_s"] == [1.9, 1.7, 2.1, 1.8]  # the lower middle: 1.8
    assert bench_kv_tiers.median_run(runs[:3])["run"] == 0


def test_kv_restart(out_dir: Path) -> None:
    """After the restart every prompt's document comes from disk (all of the prompt but its last
    token), and the generated tokens are the cold run's."""
    result = run_tiny("bench_kv_restart.py", out_dir, "kv_restart")
    cold, warm = result["cold"], result["restarted"]
    assert len(cold["ttft_ms"]) == len(warm["ttft_ms"]) == result["sizes"]["prompts"] == 2
    assert all(c <= 8 for c in cold["cached_tokens"])  # a few leading tokens shared by chance at most
    assert warm["cached_tokens"] == [p - 1 for p in warm["prompt_tokens"]]
    assert warm["disk_hit_tokens"] >= sum(warm["cached_tokens"]) - 8 and warm["disk_failed_tokens"] == 0
    assert result["identical"] == [True, True] and result["ttft_speedup"] > 0


def test_kv_quant(out_dir: Path) -> None:
    """int8 KV: 3.76x float32's tokens per GiB at the default model's shape (codes plus two float32
    scales per token and kv head), both decode runs serve every request from their cached prompts, and
    the accuracy rows compare int8 with float32 KV on the same questions."""
    result = run_tiny("bench_kv_quant.py", out_dir, "kv_quant")
    mem = result["memory"]
    assert mem["fp32"]["vs_fp32"] == 1 and mem["bf16"]["vs_fp32"] == 2
    assert mem["int8"]["vs_fp32"] == pytest.approx(4 * 64 / (64 + 4))
    for r in result["decode"].values():
        assert r["output_tok_per_s"] > 0 and 0.9 < r["cache_hit_rate"] < 1
    assert 0 <= result["decode_token_agreement"] <= 1
    for task in ("gsm8k", "mmlu"):
        a = result["accuracy"][task]
        assert a["num_questions"] == 2 and set(a["correct"]) == {"fp32", "int8"}
        assert a["gap_questions"] == abs(a["correct"]["int8"] - a["correct"]["fp32"])
        assert 0 <= a["agreement"]["identical"] <= 1


def test_router(out_dir: Path) -> None:
    """Every policy serves every request over both replicas; the cache-aware one keeps each tenant
    where its prefix is cached, so its hit rate is at least round-robin's."""
    result = run_tiny("bench_router.py", out_dir, "router")
    policies = result["policies"]
    assert list(policies) == ["cache_aware", "round_robin", "least_load"]
    for r in policies.values():
        assert r["requests"] == 16 and 0 <= r["hit_rate"] <= 1 and r["request_throughput"] > 0
        assert sum(r["routed"]) == 17 and min(r["routed"]) > 0  # the warm-up request too
    assert policies["cache_aware"]["hit_rate"] >= policies["round_robin"]["hit_rate"]


def test_invariance(out_dir: Path) -> None:
    """Every variant against the alone-uncached reference, in both modes; under --deterministic each
    is bit-identical on the CPU (the default mode's counts are reported, not held to anything)."""
    result = run_tiny("bench_invariance.py", out_dir, "invariance")
    assert result["device"] == "cpu" and result["dtypes"] == ["float32"]
    rows = result["results"]
    variants = ["alone, uncached", "alone, cached", "batched", "reversed"]
    assert [(r["mode"], r["variant"]) for r in rows] == [
        (mode, v) for mode in ("default", "deterministic") for v in variants
    ]
    for r in rows:
        assert 0 <= r["same_logprobs"] <= r["same_tokens"] <= r["prompts"] == 3 and r["wall_s"] > 0
    exact = [r for r in rows if r["mode"] == "deterministic" or r["variant"] == variants[0]]
    assert len(exact) == 5 and all(r["same_logprobs"] == 3 for r in exact)
    assert len(result["tables"][0]["rows"]) == 6


def test_speculative(speculative: dict[str, Any]) -> None:
    assert speculative["draft_tokens"] == [0, 2]
    for k, run_k in speculative["runs"].items():
        for name in ("rag", "chat", "gsm8k"):
            # Speculation never changes greedy tokens.
            assert run_k[name]["same_tokens_as_k0"], (k, name)
        for name in ("rag", "chat"):
            r = run_k[name]
            assert r["completion_tokens"] == speculative["sizes"]["max_new_tokens"]
            assert r["ttft_s"] > 0 and r["decode_tok_per_s"] > 0
            assert r["accept_length"] >= 1.0
        assert run_k["gsm8k"]["accept_length"] >= 1.0
    # Prompt lookup finds the quoted paragraph in the RAG prompt.
    assert speculative["runs"]["2"]["rag"]["accept_rate"] > 0


def test_linear_cpu(linear_cpu: dict[str, Any]) -> None:
    """Both sides timed at every row count (outputs checked against each other inside the script)."""
    assert linear_cpu["isa"] == "native"
    assert [r["rows"] for r in linear_cpu["results"]] == [1, 16]
    for r in linear_cpu["results"]:
        assert r["onednn_ms"] > 0 and r["panels_ms"] > 0
        assert r["speedup"] == pytest.approx(r["onednn_ms"] / r["panels_ms"])
    # The decode rows include the lm_head: 1 layer (3.5M weights) + 28.3M, in float32.
    assert linear_cpu["results"][0]["weight_mb"] == pytest.approx((3_538_944 + 49152 * 576) * 4 / 1e6)
    assert [row[0] for row in linear_cpu["tables"][0]["rows"]] == ["1", "16"]


def test_attention_cpu(attention_cpu: dict[str, Any]) -> None:
    """Every pool this machine's kernels read, float32 first (the reference of the others' outputs);
    path 3 where the CPU has AVX512-BF16 and path 4 where it has AMX-BF16, else skipped with the
    reason; rates against the peak of the instruction each path multiplies with."""
    results = attention_cpu["results"]
    labels = [r["label"].split(" (path")[0] for r in results]
    assert labels[0] == "float32 pool" and results[0]["max_diff_vs_float32"] == 0.0
    assert set(labels) | set(attention_cpu["skipped"]) == {
        "float32 pool",
        "bf16 pool, widened",
        "bf16 pool, vdpbf16ps",
        "bf16 pool, AMX tiles",
        "int8 pool",
    }
    n, c = attention_cpu["sizes"]["tokens"], attention_cpu["sizes"]["context"]
    assert c > 0  # --tiny's prompts are chunks after a cached part: its causal work counted
    assert attention_cpu["flops"] == 4 * attention_cpu["sizes"]["requests"] * 9 * 64 * n * (c + (n + 1) / 2)
    for r in results:
        assert r["ms"] > 0 and r["gflops"] == pytest.approx(attention_cpu["flops"] / r["ms"] / 1e6)
        assert 0 <= r["max_diff_vs_float32"] < 0.1  # bf16 / int8 K and V, random unit-variance data
        if r["path"] == 3:
            assert r["peak"].startswith("vdpbf16ps")
        if r["path"] == 4:
            assert r["peak"].startswith("tdpbf16ps")
        if r["peak_gflops"]:
            assert r["share_of_peak"] == pytest.approx(100 * r["gflops"] / r["peak_gflops"])


def test_linear_cpu_against_peak(linear_cpu: dict[str, Any]) -> None:
    """The measured peaks at every core, and each kernel this machine runs at a decode and a prefill row
    count against the peak of its arithmetic (outputs checked inside the script); a kernel it cannot
    run is skipped with the reason."""
    cores = str(os.cpu_count())
    assert list(linear_cpu["peaks"]) == [cores]
    peaks = linear_cpu["peaks"][cores]
    assert peaks and all(rate > 0 for rate in peaks.values())
    kernels = {r["kernel"] for r in linear_cpu["kernels"]}
    assert "fp32_panels" in kernels and "int4" in kernels and "int8" in kernels
    assert kernels | set(linear_cpu["skipped_kernels"]) == {
        "fp32_panels",
        "bf16_panels",
        "bf16_panels_vdp",  # beside AMX-BF16; skipped where the CPU has no AMX
        "int4",
        "int4_gguf",  # the GGUF layout the quantized panels replaced, beside them
        "int4_bf16",
        "int4_a8",
        "int8",
        "int8_gguf",
        "int8_bf16",
        "int8_a8",
    }
    for r in linear_cpu["kernels"]:
        assert r["rows"] in (1, 96) and r["ms"] > 0 and r["rate"] > 0, r
        assert r["peak_path"] in peaks and r["percent_of_peak"] == pytest.approx(100 * r["rate"] / r["peak"])
        assert r["relative_error"] < (1e-4 if r["arithmetic"] == "fp32" else 3e-2)
        if r["kernel"].endswith("_a8"):
            assert r["arithmetic"] == "int8" and r["peak_path"].startswith("int8_vnni")
        if r["kernel"] == "bf16_panels_vdp":
            assert r["arithmetic"] == "bf16" and r["peak_path"] == "bf16_dot_zmm"
        if r["arithmetic"] == "bf16_amx":
            assert r["peak_path"] == "bf16_amx" and r["kernel"] != "bf16_panels_vdp"
    # What each companion instruction of the int8-activation kernels costs vpdpbusd, where the CPU has it.
    slots = linear_cpu["vnni_slots"]
    titles = [
        "Measured peak of this machine",
        "CPU linear kernels against the measured peak of their arithmetic",
    ]
    if "int8_vnni_zmm" in peaks:
        assert list(slots) == [
            "vmulps",
            "vfmadd231ps",
            "vaddps",
            "vcvtdq2ps",
            "vpaddd",
            "vpandd",
            "vpsrlw",
            "vpbroadcastd (load)",
            "vpshufd",
            "vbroadcasti32x4 (load)",
        ]
        assert all(math.isfinite(v) for v in slots.values())
        titles.append("vpdpbusd zmm slots one other instruction takes among them")
    else:
        assert slots is None
    assert [t["title"].split(" (")[0] for t in linear_cpu["tables"][1:]] == titles
    # One note per kernel that ran at the prefill row count, against the 70 % target.
    assert sum("target >= 70%" in n for n in linear_cpu["notes"]) == len(kernels)


def test_contention(out_dir: Path) -> None:
    """Each radixlm thread policy runs idle and beside a busy loop on the last core; the ratio is busy over
    idle, held against the 2x target."""
    result = run_tiny("bench_contention.py", out_dir, "contention")
    assert result["busy_core"] == os.cpu_count() - 1
    assert set(result["walls"]) == {"radixlm", "radixlm_fixed"}
    for name, walls in result["walls"].items():
        assert len(walls["idle"]) == len(walls["busy"]) == result["sizes"]["rounds"] == 1
        assert result["ratios"][name] == pytest.approx(min(walls["busy"]) / min(walls["idle"]))
    assert sum("target <= 2x" in n for n in result["notes"]) == 2


def test_prefill_cpu(out_dir: Path) -> None:
    """Each system prefills fresh prompts with nothing cached; llama.cpp at both flash-attention settings
    (its faster kept); radixlm's ratios against llama.cpp on the same GGUF. int8 activations and
    llama.cpp may be skipped here, with the reason."""
    result = run_tiny("bench_prefill_cpu.py", out_dir, "prefill_cpu")
    systems, skipped = result["systems"], result["skipped"]
    assert result["lengths"] == [64] and result["threads"] == os.cpu_count()
    assert set(systems) | set(skipped) == {"radixlm_int4_a8", "radixlm_int4", "llamacpp_q4_1"}
    assert "radixlm_int4" in systems
    for name, by_length in systems.items():
        r = by_length["64"]
        assert len(r["times_s"]) == result["sizes"]["repeats"] == 1 and r["tok_s"] >= r["median_tok_s"] > 0
        if name == "llamacpp_q4_1":
            assert [s["setting"] for s in r["settings"]] == ["fa_off", "fa_on"]
            assert r["tok_s"] == max(s["tok_s"] for s in r["settings"])
    if "llamacpp_q4_1" in systems:
        for name in set(systems) - {"llamacpp_q4_1"}:
            want = systems[name]["64"]["tok_s"] / systems["llamacpp_q4_1"]["64"]["tok_s"]
            assert result["ratios"][name]["64"] == pytest.approx(want)
        if "radixlm_int4_a8" in systems:
            assert any("target >= 1.5x" in n for n in result["notes"])


def test_run_all_renders_readme(
    out_dir: Path,
    tmp_path: Path,
    fewshot: dict[str, Any],
    serving: dict[str, Any],
    startup: dict[str, Any],
    constrained: dict[str, Any],
) -> None:
    """Rewrites the sections between markers, appends a missing one, keeps the prose, copies figures."""
    original = (BENCH / "README.md").read_text()
    readme = tmp_path / "README.md"
    cut_begin, cut_end = (
        original.index("<!-- results:startup -->"),
        original.index("<!-- /results:startup -->"),
    )
    readme.write_text(original[:cut_begin] + original[cut_end + len("<!-- /results:startup -->") :])
    figures = tmp_path / "figures"
    run(
        [
            str(BENCH / "run_all.py"),
            "--readme-only",
            "--results-dir",
            str(out_dir),
            "--readme",
            str(readme),
            "--figures-dir",
            str(figures),
        ]
    )
    text = readme.read_text()
    assert text.startswith(original[: original.index("<!-- results:")])
    for result in (fewshot, serving, startup, constrained):
        name = result["name"]
        section = text[text.index(f"<!-- results:{name} -->") : text.index(f"<!-- /results:{name} -->")]
        assert "| " + " | ".join(result["tables"][0]["headers"]) + " |" in section
        for figure in result["figures"]:
            assert f"](figures/{figure})" in section
            assert (figures / figure).read_bytes()[:8] == PNG_MAGIC
    assert text.count("<!-- results:startup -->") == 1
    assert "logical cores" in text[text.index("<!-- results:machine -->") :]


def test_program_prefix(program_prefix: dict[str, Any]) -> None:
    off, on = program_prefix["modes"]
    assert (off["optimized"], on["optimized"]) == (False, True)
    assert program_prefix["identical_outputs"] == program_prefix["num_items"]
    for mode in (off, on):
        assert 0.0 <= mode["cache_hit_rate"] <= 1.0 and mode["pinned_tokens_after"] == 0
    # Warming never costs prefill beyond the warm-up request's own boundary tokens (the scheduler's
    # in-batch prefix check already keeps racing items from prefilling the prefix twice).
    assert on["computed_prompt_tokens"] <= off["computed_prompt_tokens"] * 1.05


def test_programs(programs: dict[str, Any]) -> None:
    assert set(programs["workloads"]) == {"multi-turn chat", "tree-of-thought", "react agent", "json regex"}
    for name, w in programs["workloads"].items():
        servers = w["servers"]
        assert set(servers) == {"lpm", "dfs-weight", "fcfs", "no cache"}
        assert servers["no cache"]["hit_rate"] == 0.0, name
        assert 0.0 < w["best_hit_rate"] < 1.0
        for server in ("lpm", "dfs-weight", "fcfs"):
            # Never above what the workload's own prefix tree allows (small slack: the ideal is
            # computed on retokenized text).
            assert 0.0 < servers[server]["hit_rate"] <= w["best_hit_rate"] + 0.05, (name, server)


def test_single_stream(single_stream: dict[str, Any]) -> None:
    systems = single_stream["systems"]
    assert systems == ["radixlm_fp32", "radixlm_int4", "transformers"]
    runs = single_stream["runs"]
    assert {(r["system"], r["prompt"]) for r in runs} == {
        (s, p) for s in systems for p in ("chat", "rag", "code")
    }
    new_tokens = single_stream["sizes"]["new_tokens"]
    for r in runs:
        assert len(r["output_ids"]) == new_tokens and r["ttft_s"] > 0 and r["decode_tok_s"] > 0
    # int4 serves the fp32 reference's own weights and transformers runs them: greedy tokens agree.
    by_key = {(r["system"], r["prompt"]): r["output_ids"] for r in runs}
    for prompt in ("chat", "rag", "code"):
        assert by_key[("radixlm_int4", prompt)][:4] == by_key[("radixlm_fp32", prompt)][:4]
        assert by_key[("transformers", prompt)][:4] == by_key[("radixlm_fp32", prompt)][:4]
