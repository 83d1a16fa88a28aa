"""The C++ kernels' own tests, run again with the kernels built under AddressSanitizer: an out-of-bounds
read or write in a kernel (which in a normal build may corrupt the heap silently, or crash a later,
unrelated test) fails here, at the access, with its source line."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from radixlm_runtime.kernels import native

REPO = Path(__file__).resolve().parents[3]
KERNEL_TESTS = [
    "tests/runtime/attention/test_cpu_backend.py",
    "tests/runtime/layers/test_fused_cpu.py",
    "tests/runtime/layers/test_linear_kernels.py",
    "tests/runtime/layers/test_quantization.py",
    "tests/runtime/models/test_llama_cpu.py",
]


def _libasan() -> Path | None:
    """The compiler's AddressSanitizer runtime, which the Python process must preload."""
    out = subprocess.run([native._compiler(), "-print-file-name=libasan.so"], capture_output=True, text=True)
    path = Path(out.stdout.strip())
    return path if out.returncode == 0 and path.is_absolute() and path.is_file() else None


def test_sanitize_flag_is_validated(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(native.SANITIZE_ENV, "address")
    assert "-fsanitize=address" in native._flags()
    monkeypatch.setenv(native.SANITIZE_ENV, "thread")
    with pytest.raises(native.KernelBuildError, match=native.SANITIZE_ENV):
        native._flags()
    monkeypatch.delenv(native.SANITIZE_ENV)
    assert native._flags() == native.FLAGS


@pytest.mark.slow
def test_kernel_tests_pass_under_address_sanitizer() -> None:
    libasan = _libasan()
    if libasan is None:
        pytest.skip(f"{native._compiler()} has no AddressSanitizer runtime (libasan.so)")
    env = {
        **os.environ,
        "LD_PRELOAD": str(libasan),
        "ASAN_OPTIONS": "detect_leaks=0:halt_on_error=1",
        native.SANITIZE_ENV: "address",
    }
    # The instrumented libraries built first, all at once (a minute; twice that one after another).
    build = [sys.executable, "-m", "radixlm_runtime.kernels.native"]
    built = subprocess.run(build, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert built.returncode == 0, (built.stdout + built.stderr)[-6000:]
    # -s: a report is printed where this test can show it (pytest's capture would lose it on the abort).
    command = [sys.executable, "-m", "pytest", "-q", "-s", "-p", "no:cacheprovider", *KERNEL_TESTS]
    result = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    output = result.stdout + result.stderr
    report = output[output.find("ERROR: AddressSanitizer") :] if "ERROR: AddressSanitizer" in output else ""
    assert result.returncode == 0, (report or output)[-6000:]
    assert " passed" in result.stdout and "failed" not in result.stdout
