"""vLLM's CPU build is a benchmark peer, never a dependency: where its environment is missing the
benchmarks skip it with a message saying how to install it, and where present it is set up as its CPU
guide says (threads bound to every core, Intel OpenMP preloaded)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from systems import VLLM_VENV_ENV, SystemUnavailable, VllmCpuSystem, vllm_env  # noqa: E402


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
