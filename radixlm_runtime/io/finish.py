"""Why a request ended, as one typed value instead of ad-hoc dicts."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from radixlm_runtime.io.limits import InvalidRequest

# constraint_error: the grammar engine gave up on the request's constraint mid-generation (a resource
# limit such as llguidance's ParserTooComplex, a token its own mask allowed and then refused): the
# output so far is not a match, so the request fails with the engine's message, never ends as a stop.
FinishKind = Literal["stop", "length", "abort", "constraint_error"]


@dataclass(frozen=True)
class FinishReason:
    kind: FinishKind
    # stop: the stop token id or stop string that ended it (None: EOS-free end of a constraint).
    matched: int | str | None = None
    length: int | None = None  # length: how many tokens were generated
    message: str | None = None  # abort, constraint_error: why
    # abort, constraint_error: the request field at fault (e.g. a regex this tokenizer cannot spell),
    # None when the request itself was fine; the HTTP side turns such an abort into a 400 naming the
    # field, while a constraint_error is reported as the request's finish (OpenAI: an error).
    param: str | None = None

    @classmethod
    def stop(cls, matched: int | str | None) -> FinishReason:
        return cls("stop", matched=matched)

    @classmethod
    def by_length(cls, length: int) -> FinishReason:
        return cls("length", length=length)

    @classmethod
    def abort(cls, message: str, param: str | None = None) -> FinishReason:
        return cls("abort", message=message, param=param)

    @classmethod
    def constraint_error(cls, message: str, param: str) -> FinishReason:
        """The grammar engine failed on the constraint carried by `param` after generation began."""
        return cls("constraint_error", message=message, param=param)

    def refusal(self) -> InvalidRequest | None:
        """An abort the scheduler blames on a request field (a max_new_tokens below the shortest
        output its constraint admits, a regex no token sequence of this vocabulary spells) is the
        request's error, raised by every entry point: None for any other finish."""
        if self.kind != "abort" or self.param is None:
            return None
        return InvalidRequest(self.message or f"{self.param}: refused", self.param)

    def to_json(self) -> dict[str, Any]:
        """SGLang's meta_info `finish_reason` object."""
        if self.kind == "stop":
            return {"type": "stop", "matched": self.matched}
        if self.kind == "length":
            return {"type": "length", "length": self.length}
        return {"type": self.kind, "message": self.message}
