"""Any OpenAI-compatible server as a backend (a radixlm server's /v1 included), through the official
`openai` client. Chat models generate whole assistant turns from the program's messages; select
scores choices with echoed prompt logprobs from /v1/completions."""

from __future__ import annotations

import json
import os
import random
import threading
from collections.abc import Iterator
from typing import Any

from radixlm.backend.base import BackendConnectionError
from radixlm.lang.backend_api import BaseBackend, Prompt
from radixlm.lang.chat_template import get_chat_template, guess_chat_template
from radixlm.lang.choices import ChoicesMethod, decide
from radixlm.lang.ir import ChoiceDecision, GenParams

# Sampling fields OpenAI's API has under its own names; the rest go in extra_body (radixlm and
# SGLang servers read them there).
_STANDARD = {
    "max_new_tokens": "max_tokens",
    "stop": "stop",
    "temperature": "temperature",
    "top_p": "top_p",
    "frequency_penalty": "frequency_penalty",
    "presence_penalty": "presence_penalty",
}
# name -> (name in the request, the value that means "off": those are not sent, so servers without
# the extension never see it unless a program asks for it).
_EXTRA = {
    "top_k": ("top_k", -1),
    "min_p": ("min_p", 0.0),
    "min_new_tokens": ("min_tokens", 0),
    "stop_token_ids": ("stop_token_ids", None),
    "ignore_eos": ("ignore_eos", False),
    "regex": ("regex", None),
    "ebnf": ("ebnf", None),
}


class OpenAI(BaseBackend):
    def __init__(
        self,
        model_name: str,
        base_url: str | None = None,
        api_key: str | None = None,
        is_chat_model: bool = True,
        chat_template_name: str | None = None,
    ) -> None:
        try:
            import openai
        except ImportError as e:
            raise ImportError("the OpenAI backend needs the openai client: pip install openai") from e
        self._openai = openai
        self.model_name = model_name
        self.base_url = base_url
        self.client = openai.OpenAI(
            base_url=base_url, api_key=api_key or os.environ.get("OPENAI_API_KEY", "none")
        )
        self.is_chat_model = is_chat_model
        self.chat_template = (
            get_chat_template(chat_template_name) if chat_template_name else guess_chat_template(model_name)
        )
        self._rng = random.Random()
        self._rng_lock = threading.Lock()

    def _call(self, create: Any, **kwargs: Any) -> Any:
        try:
            return create(model=self.model_name, **kwargs)
        except self._openai.APIConnectionError as e:
            raise BackendConnectionError(
                f"cannot reach the OpenAI-compatible server at {self.base_url}: {e}"
            ) from e
        except self._openai.BadRequestError as e:
            raise ValueError(f"{self.base_url}: {e.message}") from e

    def _request(self, prompt: Prompt, params: GenParams) -> tuple[Any, dict[str, Any]]:
        sp = params.to_runtime()
        kwargs: dict[str, Any] = {new: sp[old] for old, new in _STANDARD.items() if old in sp}
        extra = {name: sp[k] for k, (name, off) in _EXTRA.items() if sp.get(k, off) != off}
        if "json_schema" in sp:
            schema = {"name": "output", "schema": json.loads(sp["json_schema"])}
            kwargs["response_format"] = {"type": "json_schema", "json_schema": schema}
        if extra:
            kwargs["extra_body"] = extra
        if not self.is_chat_model:
            return self.client.completions.create, {"prompt": prompt.text, **kwargs}
        if prompt.role != "assistant" or prompt.role_text:
            raise ValueError(
                "an OpenAI chat model generates whole assistant turns: put gen() first inside "
                "assistant(...), or use is_chat_model=False for text completion"
            )
        return self.client.chat.completions.create, {"messages": prompt.messages, **kwargs}

    def generate(self, prompt: Prompt, params: GenParams) -> tuple[str, dict[str, Any]]:
        create, kwargs = self._request(prompt, params)
        out = self._call(create, **kwargs)
        choice = out.choices[0]
        text = choice.message.content if self.is_chat_model else choice.text
        return text or "", _meta(out, choice.finish_reason)

    def generate_stream(self, prompt: Prompt, params: GenParams) -> Iterator[tuple[str, dict[str, Any]]]:
        create, kwargs = self._request(prompt, params)
        for chunk in self._call(create, stream=True, **kwargs):
            if not chunk.choices:
                continue
            choice = chunk.choices[0]
            piece = (choice.delta.content if self.is_chat_model else choice.text) or ""
            yield piece, {"finish_reason": choice.finish_reason}

    def _echo_logprobs(self, texts: list[str]) -> list[tuple[list[float | None], list[int]]]:
        """Prompt logprobs and token offsets of every text, from one batched zero-token request."""
        out = self._call(self.client.completions.create, prompt=texts, max_tokens=0, echo=True, logprobs=0)
        ordered = sorted(out.choices, key=lambda c: c.index)
        return [(c.logprobs.token_logprobs, c.logprobs.text_offset) for c in ordered]

    def select(
        self, prompt: Prompt, choices: list[str], temperature: float, method: ChoicesMethod
    ) -> ChoiceDecision:
        """Tokens that end past the prompt belong to the choice (a token merged across the boundary
        counts for the choice)."""
        cut = len(prompt.text)
        token_logprobs = [
            [lp for lp, end in zip(lps, offsets[1:] + [10**12]) if end > cut and lp is not None]
            for lps, offsets in self._echo_logprobs([prompt.text + c for c in choices])
        ]
        unconditional = None
        if method.requires_unconditional_logprobs:
            unconditional = [
                [lp for lp in lps[1:] if lp is not None] for lps, _ in self._echo_logprobs(choices)
            ]
        with self._rng_lock:
            return decide(method, choices, token_logprobs, unconditional, temperature, self._rng)


def _meta(out: Any, finish_reason: str | None) -> dict[str, Any]:
    usage = out.usage
    meta: dict[str, Any] = {"id": out.id, "finish_reason": finish_reason}
    if usage is not None:
        meta |= {"prompt_tokens": usage.prompt_tokens, "completion_tokens": usage.completion_tokens}
        details = getattr(usage, "prompt_tokens_details", None)
        if details is not None and details.cached_tokens is not None:
            meta["cached_tokens"] = details.cached_tokens
    return meta
