"""Why a request ended, as one typed value instead of ad-hoc dicts."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

FinishKind = Literal["stop", "length", "abort"]


@dataclass(frozen=True)
class FinishReason:
    kind: FinishKind
    # stop: the stop token id or stop string that ended it (None: EOS-free end of a constraint).
    matched: int | str | None = None
    length: int | None = None  # length: how many tokens were generated
    message: str | None = None  # abort: why

    @classmethod
    def stop(cls, matched: int | str | None) -> FinishReason:
        return cls("stop", matched=matched)

    @classmethod
    def by_length(cls, length: int) -> FinishReason:
        return cls("length", length=length)

    @classmethod
    def abort(cls, message: str) -> FinishReason:
        return cls("abort", message=message)

    def to_json(self) -> dict[str, Any]:
        """SGLang's meta_info `finish_reason` object."""
        if self.kind == "stop":
            return {"type": "stop", "matched": self.matched}
        if self.kind == "length":
            return {"type": "length", "length": self.length}
        return {"type": "abort", "message": self.message}
