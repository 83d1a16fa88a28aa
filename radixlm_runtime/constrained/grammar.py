"""Per-request constraint state: the sampler's mask, advancing on sampled tokens, and jump-forward.

The token index is built for every live state of the character DFA, so the token-level state is the
character-level state: after the runtime appends forced text or retokenizes the output boundary, the
state is recovered from text alone (`advance_text` / `resync`) without any token bookkeeping.
"""

from __future__ import annotations

import numpy as np

from radixlm_runtime.constrained.regex_fsm import TokenIndex


class RegexGuide:
    """Tracks one request through a compiled `TokenIndex`; cheap to create, one per request."""

    def __init__(self, index: TokenIndex) -> None:
        self.index = index
        self.state = index.initial_state
        self.terminated = False  # EOS was accepted
        # The state before each token consumed by `advance` since the last text change (never
        # terminated: an ended constraint advances no further), so speculative decoding can take
        # back draft tokens (`rollback`).
        self._trail: list[int] = []

    def allowed_mask(self, vocab_size: int) -> np.ndarray:
        """Bool [vocab_size], True = allowed; EOS only in accepting states. Shared per state: read-only."""
        if self.terminated:
            return np.zeros(vocab_size, dtype=np.bool_)
        return self.index.mask(self.state, vocab_size)

    def advance(self, token_id: int) -> None:
        """Consumes a sampled token; ValueError if the mask did not allow it."""
        if self.terminated:
            raise ValueError(f"token {token_id}: the constraint already ended")
        if self.index.eos_allowed(self.state) and token_id in self.index.eos_ids:
            self._trail.append(self.state)
            self.terminated = True
            return
        nxt = self.index.next_state(self.state, token_id)
        if nxt < 0:
            raise ValueError(f"token {token_id} is not allowed by the constraint at state {self.state}")
        self._trail.append(self.state)
        self.state = nxt

    def rollback(self, num_tokens: int) -> None:
        """Takes back the last num_tokens tokens consumed by `advance` (rejected speculative draft
        tokens); ValueError past the tokens advanced since the guide last consumed text."""
        if not 0 <= num_tokens <= len(self._trail):
            raise ValueError(
                f"num_tokens: cannot roll back {num_tokens} tokens, {len(self._trail)} were advanced"
            )
        if num_tokens:
            self.state, self.terminated = self._trail[-num_tokens], False
            del self._trail[-num_tokens:]

    def is_accepting(self) -> bool:
        return self.terminated or self.index.is_accepting(self.state)

    def is_finished(self) -> bool:
        """True when the request should end: EOS was taken, or the output is complete and cannot grow."""
        return self.terminated or (
            self.index.is_accepting(self.state) and not self.index.has_continuation(self.state)
        )

    def jump_forward(self) -> str | None:
        """Text every valid continuation starts with (e.g. `{"name":"`), which the runtime may append
        without decode steps; None when the next character is not determined."""
        return None if self.terminated else self.index.forced_string(self.state)

    def advance_text(self, text: str) -> None:
        """Consumes appended text (e.g. the jump-forward string) character by character."""
        nxt = self.index.dfa.walk(self.state, text)
        if nxt < 0:
            raise ValueError(f"text {text!r} is not allowed by the constraint at state {self.state}")
        self.state = nxt
        self._trail.clear()

    def resync(self, output_text: str) -> None:
        """Recomputes the state from the request's whole constrained output text, e.g. after the runtime
        retokenized the boundary between generated and jump-forward text."""
        nxt = self.index.dfa.walk(self.index.initial_state, output_text)
        if nxt < 0:
            raise ValueError(f"output {output_text!r} is not allowed by the constraint")
        self.state = nxt
        self.terminated = False
        self._trail.clear()

    def copy(self) -> RegexGuide:
        """Independent guide at the same position (parallel samples of one prompt)."""
        other = RegexGuide(self.index)
        other.state, other.terminated = self.state, self.terminated
        other._trail = list(self._trail)
        return other
