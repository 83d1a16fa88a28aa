"""API speculative execution, SGLang's `@function(num_api_spec_tokens=N)`: for backends that charge or
wait per call (an OpenAI endpoint), one call generates ahead and the program's next primitives are
served from its text while the program's own text agrees with it.

- Completion backends: an unconstrained gen asks for max(N, its max_new_tokens) tokens with no stop,
  keeps its text up to its first stop string and holds the rest. Constant text the program appends
  next consumes the held text when it starts with it and discards it otherwise; the next gen starts
  from what is held, calling the backend again only when nothing is.
- Chat backends write whole messages, so the constant text and gens of an assistant turn are
  collected and one chat completion (N tokens) at the turn's end is matched against them: constant
  text before the last gen must appear verbatim, each gen takes the text up to its first stop string
  (the last gen takes the rest when it has none). A message that does not follow the program is an
  error naming where it strayed.

Gen limits count characters of held text, as SGLang's do: the text was generated, its tokens are gone.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from radixlm.lang import ir


def eligible(params: ir.GenParams) -> bool:
    """Constrained or logprob-returning gens need their own call."""
    return (
        params.regex is None
        and params.json_schema is None
        and params.ebnf is None
        and params.dtype is None
        and not params.return_logprob
    )


def _stops(params: ir.GenParams) -> list[str]:
    stop = params.stop
    return [] if stop is None else [stop] if isinstance(stop, str) else [s for s in stop if s]


def _first_stop(text: str, stops: list[str]) -> int:
    """Where the earliest stop string starts in text, or -1."""
    found = [pos for pos in (text.find(s) for s in stops) if pos >= 0]
    return min(found, default=-1)


def speculative_params(params: ir.GenParams, num_tokens: int) -> ir.GenParams:
    """The generate-ahead call: no stop, at least num_tokens tokens."""
    return ir.GenParams(max_new_tokens=max(num_tokens, params.max_new_tokens or 0), stop=[]).merged_over(
        params
    )


@dataclass
class HeldText:
    """Text generated ahead on a completion backend, not yet claimed by the program."""

    text: str = ""

    def fill(self, appended: str) -> None:
        self.text = self.text[len(appended) :] if self.text.startswith(appended) else ""

    def take(self, params: ir.GenParams) -> str:
        """The gen's text from what is held (which must not be empty), up to its stop or limit."""
        stops = _stops(params)
        pos = _first_stop(self.text, stops)
        if pos < 0:
            pos = min(params.max_new_tokens or len(self.text), len(self.text))
        out, self.text = self.text[:pos], self.text[pos:]
        return out


@dataclass
class ChatTurn:
    """The constant text (str) and gens (ir.Gen) of an assistant turn, in program order."""

    terms: list[str | ir.Gen] = field(default_factory=list)

    def match(self, message: str, params: list[ir.GenParams]) -> list[tuple[str, str | None]]:
        """(text, gen variable name or None) pieces that spell the message term by term; params
        holds each gen's merged settings. Raises ValueError where the message strays."""
        pieces: list[tuple[str, str | None]] = []
        rest = message
        gens = iter(params)
        last_gen = max((i for i, t in enumerate(self.terms) if isinstance(t, ir.Gen)), default=-1)
        for i, term in enumerate(self.terms):
            if isinstance(term, str):
                # Text after the last gen is the program's own; the model's rest is dropped.
                if i < last_gen and not rest.startswith(term):
                    raise ValueError(
                        f"speculative execution: the assistant message does not continue with the program's "
                        f"text {term!r} (it has {rest[:40]!r}); raise num_api_spec_tokens or drop it"
                    )
                pieces.append((term, None))
                rest = rest[len(term) :]
                continue
            pos = _first_stop(rest, _stops(next(gens)))
            if pos < 0:
                if i != last_gen:
                    raise ValueError(
                        f"speculative execution: gen {term.name!r} found none of its stop strings in the "
                        f"assistant message, so the program's later text cannot be matched"
                    )
                pos = len(rest)
            pieces.append((rest[:pos], term.name))
            rest = rest[pos:]
        return pieces
