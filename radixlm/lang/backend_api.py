"""What the interpreter needs from a backend. A backend sees prompts, never program state.

It lives in the language package, beside the interpreter that calls it, so the backends in
radixlm.backend depend on the language and never the reverse.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from radixlm.lang.chat_template import ChatTemplate
from radixlm.lang.choices import ChoicesMethod
from radixlm.lang.ir import ChoiceDecision, GenParams


@dataclass(frozen=True)
class ProgramCall:
    """A call's place in its program run's call graph: the run, the call's id (`<stream>.<index>`,
    a forked stream named `<parent stream>/<branch>`), the call it follows (None for the first) and
    the variable or primitive it serves. A radixlm server shows the graph on its dashboard."""

    run: str
    call: str
    parent: str | None
    name: str


@dataclass
class Prompt:
    """One call's view of a program: its text so far, its finished chat turns, the role it is in
    (with that role's text so far), the session its KV is pinned under, and its place in the run."""

    text: str
    messages: list[dict[str, str]] = field(default_factory=list)
    role: str | None = None
    role_text: str = ""
    session_id: str | None = None
    call: ProgramCall | None = None


class BaseBackend:
    chat_template: ChatTemplate

    def generate(self, prompt: Prompt, params: GenParams) -> tuple[str, dict[str, Any]]:
        """Returns the generated text and its meta info."""
        raise NotImplementedError

    def generate_stream(self, prompt: Prompt, params: GenParams) -> Iterator[tuple[str, dict[str, Any]]]:
        """Yields (new text, meta info so far) pieces."""
        raise NotImplementedError

    def select(
        self, prompt: Prompt, choices: list[str], temperature: float, method: ChoicesMethod
    ) -> ChoiceDecision:
        raise NotImplementedError

    def commit_lazy(self, prompt: Prompt) -> None:
        """Makes the backend hold the KV of prompt.text (a no-op where there is no cache to fill)."""

    def cache_prefix(self, text: str, session_id: str | None = None) -> None:
        """Prefills text once so later prompts starting with it hit the cache."""

    def end_session(self, session_id: str) -> None:
        """Releases the KV pinned for a finished program run."""

    def flush_cache(self) -> bool:
        return False

    def get_server_info(self) -> dict[str, Any]:
        return {}

    def shutdown(self) -> None:
        pass
