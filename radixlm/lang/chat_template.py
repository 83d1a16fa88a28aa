"""Role markers for chat programs. The frontend renders roles as text itself so a program's prompt
is one string it can extend token-exactly (and the runtime's radix tree sees one growing prefix)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class ChatTemplate:
    name: str
    # role -> (text before the content, text after it)
    roles: dict[str, tuple[str, str]] = field(default_factory=dict)
    default_system_prompt: str | None = None

    def begin(self, role: str) -> str:
        return self._markers(role)[0]

    def end(self, role: str) -> str:
        return self._markers(role)[1]

    def _markers(self, role: str) -> tuple[str, str]:
        if role not in self.roles:
            raise ValueError(f"chat template {self.name!r} has no role {role!r}; roles: {sorted(self.roles)}")
        return self.roles[role]


CHATML = ChatTemplate(
    "chatml",
    {r: (f"<|im_start|>{r}\n", "<|im_end|>\n") for r in ("system", "user", "assistant")},
)
LLAMA3 = ChatTemplate(
    "llama-3-instruct",
    {
        r: (f"<|start_header_id|>{r}<|end_header_id|>\n\n", "<|eot_id|>")
        for r in ("system", "user", "assistant")
    },
)
# For base models and completion APIs: roles become plain "Role: " lines.
PLAIN = ChatTemplate(
    "plain",
    {"system": ("", "\n\n"), "user": ("User: ", "\n"), "assistant": ("Assistant: ", "\n")},
)

TEMPLATES = {t.name: t for t in (CHATML, LLAMA3, PLAIN)}
# Substrings of a model path (lower-cased) -> template; first match wins.
_BY_MODEL_PATH = [("smollm", CHATML), ("qwen", CHATML), ("llama-3", LLAMA3), ("llama3", LLAMA3)]


def get_chat_template(name: str) -> ChatTemplate:
    if name not in TEMPLATES:
        raise ValueError(f"unknown chat template {name!r}; known: {sorted(TEMPLATES)}")
    return TEMPLATES[name]


def guess_chat_template(model_path: str) -> ChatTemplate:
    """The template for a served model, by its path; ChatML (the default model's) otherwise."""
    lowered = model_path.lower()
    return next((t for key, t in _BY_MODEL_PATH if key in lowered), CHATML)
