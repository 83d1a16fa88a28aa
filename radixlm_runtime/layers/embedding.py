"""The token embedding table."""

from __future__ import annotations

from torch import nn


class Embedding(nn.Embedding):
    """nn.Embedding without its random init: models are built on the meta device and every row comes
    from the checkpoint, and the init's first call there imports torch._dynamo (a second of every
    start-up)."""

    def reset_parameters(self) -> None:
        pass
