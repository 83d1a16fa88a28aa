"""The batch-invariance check the CPU linear kernels' tests share."""

from __future__ import annotations

from collections.abc import Callable

import torch

# Row counts that cross every blocking the kernels use (1-4 rows, 8-row blocks, the panel threshold).
ROW_COUNTS = (2, 3, 4, 5, 8, 9, 16, 40)


def assert_batch_invariant(matmul: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> None:
    """Each row of x gets the same bits from `matmul` alone, among the rows before it, and in a slice
    starting mid-batch."""
    alone = torch.cat([matmul(x[i : i + 1]) for i in range(len(x))])
    for rows in ROW_COUNTS:
        assert torch.equal(matmul(x[:rows]), alone[:rows])
    assert torch.equal(matmul(x[7:30]), alone[7:30])
