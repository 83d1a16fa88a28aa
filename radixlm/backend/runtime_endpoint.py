"""A radixlm (or SGLang) server's native API as a backend: /generate with sessions, prompt logprobs
for select, zero-token requests to warm the cache."""

from __future__ import annotations

import dataclasses
import json
import random
import threading
from collections.abc import Iterator
from typing import Any

import httpx

from radixlm.backend.base import BackendConnectionError
from radixlm.lang.backend_api import BaseBackend, Prompt
from radixlm.lang.chat_template import ChatTemplate, get_chat_template, guess_chat_template
from radixlm.lang.choices import ChoicesMethod, decide
from radixlm.lang.ir import ChoiceDecision, GenParams

# Generation can take minutes under load; only connecting is expected to be quick.
TIMEOUT = httpx.Timeout(None, connect=10.0)
# Enough for run_batch's default thread count to keep every request in flight.
LIMITS = httpx.Limits(max_connections=256, max_keepalive_connections=128)


class RuntimeEndpoint(BaseBackend):
    def __init__(
        self,
        base_url: str,
        api_key: str | None = None,
        chat_template_name: str | None = None,
        verify: bool | str = True,
        use_sessions: bool = True,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._client = httpx.Client(headers=headers, timeout=TIMEOUT, limits=LIMITS, verify=verify)
        self.model_info = self._get("/get_model_info")
        self.chat_template: ChatTemplate = (
            get_chat_template(chat_template_name)
            if chat_template_name
            else guess_chat_template(self.model_info.get("model_path", ""))
        )
        # Sessions (KV pinned per program run) are radixlm's extension of the native API; an SGLang
        # server gets none.
        self.supports_sessions = use_sessions and "num_sessions" in self.get_server_info()
        self._rng = random.Random()
        self._rng_lock = threading.Lock()

    # -- HTTP -----------------------------------------------------------------------------------
    def _request(self, method: str, path: str, body: dict[str, Any] | None = None) -> httpx.Response:
        url = self.base_url + path
        try:
            response = self._client.request(method, url, json=body)
        except httpx.TransportError as e:
            raise BackendConnectionError(f"cannot reach the radixlm server at {url}: {e}") from e
        _raise_for_status(response, url)
        return response

    def _get(self, path: str) -> dict[str, Any]:
        return self._request("GET", path).json()

    def _session_fields(self, prompt: Prompt | None) -> dict[str, Any]:
        """radixlm's extensions of the native API, sent to radixlm servers only: the session pinning
        the program's KV, and the call's place in the run's call graph (the dashboard draws it)."""
        if prompt is None or not self.supports_sessions:
            return {}
        fields: dict[str, Any] = {}
        if prompt.session_id:
            fields["session_id"] = prompt.session_id
        if prompt.call is not None:
            fields["program_call"] = dataclasses.asdict(prompt.call)
        return fields

    def _generate(self, body: dict[str, Any], prompt: Prompt | None = None) -> Any:
        return self._request("POST", "/generate", body | self._session_fields(prompt)).json()

    @staticmethod
    def _gen_body(prompt: Prompt, params: GenParams) -> dict[str, Any]:
        return {"text": prompt.text, "sampling_params": params.to_runtime(), **params.logprob_fields()}

    # -- backend API ----------------------------------------------------------------------------
    def generate(self, prompt: Prompt, params: GenParams) -> tuple[str, dict[str, Any]]:
        out = self._generate(self._gen_body(prompt, params), prompt)
        return out["text"], out["meta_info"]

    def generate_stream(self, prompt: Prompt, params: GenParams) -> Iterator[tuple[str, dict[str, Any]]]:
        body = self._gen_body(prompt, params) | {"stream": True} | self._session_fields(prompt)
        url = self.base_url + "/generate"
        sent = ""
        try:
            with self._client.stream("POST", url, json=body) as response:
                if response.status_code != 200:
                    response.read()
                    _raise_for_status(response, url)
                for line in response.iter_lines():
                    if not line.startswith("data:") or line == "data: [DONE]":
                        continue
                    chunk = json.loads(line[len("data:") :])
                    if "error" in chunk:
                        raise ValueError(f"{url}: {_error_message(chunk)}")
                    # Chunks carry the cumulative text.
                    text = chunk["text"]
                    yield text[len(sent) :], chunk.get("meta_info", {})
                    sent = text
        except httpx.TransportError as e:
            raise BackendConnectionError(f"cannot reach the radixlm server at {url}: {e}") from e

    def select(
        self, prompt: Prompt, choices: list[str], temperature: float, method: ChoicesMethod
    ) -> ChoiceDecision:
        """Scores every choice in one batched zero-token request. The prompt alone rides along so the
        choice tokens can be found by comparing token ids, even where the tokenizer merges text across
        the prompt/choice boundary."""
        warm = self._generate({"text": prompt.text, "sampling_params": {"max_new_tokens": 0}}, prompt)
        # Two tokens of slack before the boundary for merges across it.
        start = max(warm["meta_info"]["prompt_tokens"] - 2, 0)
        outs = self._generate(
            {
                "text": [prompt.text] + [prompt.text + c for c in choices],
                "sampling_params": {"max_new_tokens": 0, "temperature": 0},
                "return_logprob": True,
                "logprob_start_len": start,
            },
            prompt,
        )
        entries = [o["meta_info"]["input_token_logprobs"] for o in outs]
        base_ids = [e[1] for e in entries[0]]
        token_ids: list[list[int]] = []
        token_logprobs: list[list[float]] = []
        for choice_entries in entries[1:]:
            k = _common_prefix_len(base_ids, [e[1] for e in choice_entries])
            token_ids.append([e[1] for e in choice_entries[k:]])
            token_logprobs.append([e[0] for e in choice_entries[k:] if e[0] is not None])
        unconditional = (
            self._unconditional_logprobs(token_ids) if method.requires_unconditional_logprobs else None
        )
        with self._rng_lock:
            return decide(method, choices, token_logprobs, unconditional, temperature, self._rng)

    def _unconditional_logprobs(self, token_ids: list[list[int]]) -> list[list[float]]:
        """Logprobs of each choice's tokens with no prompt (the first token has none to condition on)."""
        outs = self._generate(
            {
                "input_ids": [ids or [0] for ids in token_ids],
                "sampling_params": {"max_new_tokens": 0},
                "return_logprob": True,
                "logprob_start_len": 0,
            }
        )
        return [[e[0] for e in o["meta_info"]["input_token_logprobs"][1:]] for o in outs]

    def commit_lazy(self, prompt: Prompt) -> None:
        self._generate({"text": prompt.text, "sampling_params": {"max_new_tokens": 0}}, prompt)

    def cache_prefix(self, text: str, session_id: str | None = None) -> None:
        self.commit_lazy(Prompt(text, session_id=session_id))

    def end_session(self, session_id: str) -> None:
        if self.supports_sessions:
            self._request("POST", "/close_session", {"session_id": session_id})

    def flush_cache(self) -> bool:
        return bool(self._request("POST", "/flush_cache").json().get("success", True))

    def get_server_info(self) -> dict[str, Any]:
        return self._get("/server_info")

    def shutdown(self) -> None:
        self._client.close()


def _common_prefix_len(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def _error_message(body: Any) -> str:
    if isinstance(body, dict) and isinstance(body.get("error"), dict):
        return str(body["error"].get("message", body["error"]))
    if isinstance(body, dict) and "error" in body:
        return str(body["error"])
    return str(body)


def _raise_for_status(response: httpx.Response, url: str) -> None:
    """Client errors become ValueError with the server's message (it names the bad field)."""
    if response.status_code < 400:
        return
    try:
        message = _error_message(response.json())
    except ValueError:
        message = response.text[:500]
    if response.status_code < 500 and response.status_code not in (404, 408, 429):
        raise ValueError(f"{url}: {message}")
    raise RuntimeError(f"{url} answered HTTP {response.status_code}: {message}")
