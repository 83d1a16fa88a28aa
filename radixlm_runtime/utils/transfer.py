"""Host-to-device copies that never stall the host.

A copy from pageable host memory makes CUDA wait for the stream before it starts, so the host would
stop until the GPU had finished all queued work. Pinned memory (torch's caching host allocator, which
keeps a block until its copy is done) lets the copy queue behind the running kernels instead.
"""

from __future__ import annotations

from array import array

import torch


def to_device(host: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    device = torch.device(device)
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


_ARRAY_CODES = {torch.int64: "q", torch.float32: "f"}


def host_tensor(parts: list[list[int]] | list[list[float]], dtype: torch.dtype = torch.int64) -> torch.Tensor:
    """The lists concatenated into one host tensor (int64 or float32). Built through
    `array.fromlist`, about 4x faster than `torch.tensor` on a Python list: at a few hundred values
    per step, that is per-step host time."""
    code = _ARRAY_CODES.get(dtype)
    if code is None:
        raise ValueError(f"dtype: host_tensor packs int64 or float32, not {dtype}")
    buf = array(code)
    for part in parts:
        buf.fromlist(part)
    return torch.frombuffer(buf, dtype=dtype) if buf else torch.empty(0, dtype=dtype)
