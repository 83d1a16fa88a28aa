"""The device the suite runs on, RADIXLM_TEST_DEVICE: "cpu" (the default) or "cuda", and the tolerance
of a Triton kernel's result per dtype there.

tests/conftest.py imports this before torch, since torch and Triton read the two switches below when
they start. Under "cpu" the Triton kernels run in the interpreter and the GPU, if any, is hidden, so
every engine's device "auto" is the CPU and `pytest tests` on a GPU machine is exactly the CPU suite.
Under "cuda" the kernels run natively and "auto" is the GPU.
"""

from __future__ import annotations

import os

TEST_DEVICE = os.environ.get("RADIXLM_TEST_DEVICE") or "cpu"
if TEST_DEVICE == "cpu":
    os.environ["TRITON_INTERPRET"] = "1"
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
elif TEST_DEVICE == "cuda":
    os.environ.pop("TRITON_INTERPRET", None)

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402


class _RowwiseMatmul:
    """numpy, but matmul one row of the left operand at a time. The Triton interpreter computes tl.dot
    with np.matmul, and OpenBLAS's sgemm may sum a row in an order that depends on the row's place in
    the tile (its Haswell and Zen kernels do, on a Zen 5): a row's bits would then move with the rows
    beside it, which a GPU's MMA never does and batch-invariant kernels rely on. Row by row, every
    row is the same call, and K is still summed as BLAS sums one row."""

    def __getattr__(self, name: str) -> object:
        value = getattr(np, name)
        setattr(self, name, value)  # found once, then a plain attribute
        return value

    @staticmethod
    def matmul(a: np.ndarray, b: np.ndarray, **kwargs: object) -> np.ndarray:
        # Half-precision products run numpy's own loops, not BLAS.
        if a.ndim < 2 or a.shape[-2] == 1 or a.dtype not in (np.float32, np.float64):
            return np.matmul(a, b, **kwargs)
        rows = [np.matmul(a[..., i : i + 1, :], b, **kwargs) for i in range(a.shape[-2])]
        return np.concatenate(rows, axis=-2)


if TEST_DEVICE == "cpu":
    from triton.runtime import interpreter

    interpreter.np = _RowwiseMatmul()

# atol = rtol of a Triton attention kernel's output against a float32 torch reference, per input dtype.
# The interpreter's tl.dot multiplies float32 exactly; a GPU's may round float32 operands to tf32 (a
# 10-bit mantissa, Triton's default there), so float32 allows ~1e-3 on CUDA. Half-precision operands
# lose nothing more on a GPU.
_TOLERANCE = {torch.float32: 1e-4, torch.float16: 1e-2, torch.bfloat16: 3e-2}
_TF32_TOLERANCE = 2e-3


def check_test_device() -> None:
    """Stops the run before any test when RADIXLM_TEST_DEVICE names no device the suite can use."""
    if TEST_DEVICE not in ("cpu", "cuda"):
        raise pytest.UsageError(f"RADIXLM_TEST_DEVICE must be 'cpu' or 'cuda', got {TEST_DEVICE!r}")
    if TEST_DEVICE == "cuda" and not torch.cuda.is_available():
        raise pytest.UsageError(
            "RADIXLM_TEST_DEVICE=cuda, but torch sees no CUDA device "
            f"(torch {torch.__version__}, CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r})"
        )


def tolerance(dtype: torch.dtype) -> tuple[float, float]:
    """(atol, rtol) of a Triton attention kernel's result with dtype inputs on the test device."""
    tol = _TF32_TOLERANCE if TEST_DEVICE == "cuda" and dtype == torch.float32 else _TOLERANCE[dtype]
    return tol, tol
