"""utils/transfer.py: host tensors packed from Python lists, copies to the step's device."""

from __future__ import annotations

import pytest
import torch

from radixlm_runtime.utils.transfer import host_tensor, to_device


def test_host_tensor_concatenates_lists_like_torch_tensor() -> None:
    parts = [[1, -2, 2**62], [], [7]]
    got = host_tensor(parts)
    assert got.dtype == torch.int64
    assert torch.equal(got, torch.tensor([1, -2, 2**62, 7]))
    floats = host_tensor([[0.9, 1e-38], [0.1]], torch.float32)
    assert floats.dtype == torch.float32
    assert torch.equal(floats, torch.tensor([0.9, 1e-38, 0.1], dtype=torch.float32))  # same rounding


def test_host_tensor_of_nothing_is_empty() -> None:
    assert host_tensor([]).shape == (0,)
    assert host_tensor([[], []], torch.float32).dtype == torch.float32


def test_host_tensor_rejects_what_it_cannot_hold() -> None:
    with pytest.raises(OverflowError):
        host_tensor([[2**63]])
    with pytest.raises(ValueError, match="dtype"):
        host_tensor([[1]], torch.int32)


def test_to_device_on_cpu_keeps_the_values() -> None:
    t = host_tensor([[3, 4]])
    assert torch.equal(to_device(t, "cpu"), t)
