"""The one logging setup of the runtime: every module logs through `get_logger`."""

from __future__ import annotations

import logging
import os

_FORMAT = "[%(asctime)s %(processName)s %(levelname)s] %(name)s: %(message)s"


def setup_logging(level: str | None = None) -> None:
    level = (level or os.environ.get("RADIXLM_LOG_LEVEL", "info")).upper()
    root = logging.getLogger("radixlm_runtime")
    if not root.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter(_FORMAT, datefmt="%H:%M:%S"))
        root.addHandler(handler)
        root.propagate = False
    root.setLevel(level)


def get_logger(name: str) -> logging.Logger:
    return logging.getLogger(name if name.startswith("radixlm_runtime") else f"radixlm_runtime.{name}")
