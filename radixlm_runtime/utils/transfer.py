"""Host-to-device copies that never stall the host.

A copy from pageable host memory makes CUDA wait for the stream before it starts, so the host would
stop until the GPU had finished all queued work. Pinned memory (torch's caching host allocator, which
keeps a block until its copy is done) lets the copy queue behind the running kernels instead.
"""

from __future__ import annotations

import torch


def to_device(host: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    device = torch.device(device)
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)
