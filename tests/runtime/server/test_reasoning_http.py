"""--reasoning-parser through the real server and the official OpenAI client: reasoning_content and
content of /v1/chat/completions, streamed and not, and chat_template_kwargs reaching the template.

A random-init model writes no think block of its own, so a `regex` constraint forces one. The tiny
Qwen3's `<think>` and `</think>` are special tokens (real Qwen3's are not), so requests keep them in
the text with skip_special_tokens false."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
import requests
from server_harness import API_KEY, HEADERS, Server, launch_server
from transformers import AutoTokenizer

MESSAGES = [{"role": "user", "content": "Think, then answer."}]
KEEP_TAGS = {"skip_special_tokens": False}
# Fully forced: the text around and inside the block looks like tags without being one.
FORCED = r"<think>a < b </thinking</think>c <thinker d"
FORCED_REASONING, FORCED_CONTENT = "a < b </thinking", "c <thinker d"


@pytest.fixture(scope="module")
def server(tiny_qwen3_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    # xgrammar: llguidance (1.9) lets its mask admit the `<think>` token where the regex has that
    # text, then refuses to consume it, which aborts the request.
    srv = launch_server(
        tmp_path_factory.mktemp("reasoning"),
        *("--model-path", str(tiny_qwen3_dir), "--reasoning-parser", "qwen3"),
        *("--grammar-backend", "xgrammar"),
    )
    yield srv
    assert srv.stop() == 0, srv.log()[-3000:]


@pytest.fixture(scope="module")
def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0, timeout=120)


def _model(client: openai.OpenAI) -> str:
    return client.models.list().data[0].id


def _chat(client: openai.OpenAI, regex: str, **kwargs: Any) -> Any:
    extra_body = {"regex": regex} | KEEP_TAGS | kwargs.pop("extra_body", {})
    return client.chat.completions.create(
        model=_model(client), messages=MESSAGES, temperature=0, extra_body=extra_body, **kwargs
    )


def _streamed(client: openai.OpenAI, regex: str, n: int = 1, **kwargs: Any) -> list[dict[str, Any]]:
    """Each choice's reasoning_content and content joined over the stream, its finish reason, and
    every delta it got."""
    out = [{"reasoning": "", "content": "", "finish": None, "deltas": []} for _ in range(n)]
    for chunk in _chat(client, regex, n=n, stream=True, **kwargs):
        for choice in chunk.choices:
            got = out[choice.index]
            delta = choice.delta.model_dump(exclude_none=True)
            got["deltas"].append(delta)
            got["reasoning"] += delta.get("reasoning_content", "")
            got["content"] += delta.get("content", "")
            got["finish"] = got["finish"] or choice.finish_reason
    return out


def _no_tag_anywhere(deltas: list[dict[str, Any]]) -> bool:
    return not any(tag in str(v) for d in deltas for v in d.values() for tag in ("<think>", "</think>"))


def test_forced_block_is_split_exactly(client: openai.OpenAI) -> None:
    resp = _chat(client, FORCED, max_tokens=64, n=2)
    for choice in resp.choices:
        assert choice.message.reasoning_content == FORCED_REASONING
        assert choice.message.content == FORCED_CONTENT
        assert choice.finish_reason == "stop"
    for got in _streamed(client, FORCED, n=2, max_tokens=64):
        assert (got["reasoning"], got["content"], got["finish"]) == (FORCED_REASONING, FORCED_CONTENT, "stop")
        assert _no_tag_anywhere(got["deltas"])


def test_an_answer_with_reasoning_goes_back_as_history(client: openai.OpenAI) -> None:
    message = _chat(client, FORCED, max_tokens=64).choices[0].message
    history = [*MESSAGES, message.model_dump(), {"role": "user", "content": "And?"}]
    follow = client.chat.completions.create(
        model=_model(client), messages=history, max_tokens=2, extra_body={"ignore_eos": True}
    )
    assert follow.choices[0].finish_reason == "length"


def test_sampled_block_matches_the_raw_output(client: openai.OpenAI, server: Server) -> None:
    """Free text inside and after the block, token by token: the split is the raw output's (read
    from /generate, which parses nothing), and the stream carries the same text."""
    regex = r"<think>[a-z ]{4,16}</think>[a-z ]{4,16}"
    resp = _chat(client, regex, max_tokens=48)
    message = resp.choices[0].message
    ids = requests.post(f"{server.url}/tokenize", json={"messages": MESSAGES}, headers=HEADERS, timeout=60)
    raw = requests.post(
        f"{server.url}/generate",
        json={
            "input_ids": ids.json()["tokens"],
            "sampling_params": {"regex": regex, "temperature": 0, "max_new_tokens": 48} | KEEP_TAGS,
        },
        headers=HEADERS,
        timeout=120,
    ).json()["text"]
    assert raw == f"<think>{message.reasoning_content}</think>{message.content}"
    (got,) = _streamed(client, regex, max_tokens=48)
    assert (got["reasoning"], got["content"]) == (message.reasoning_content, message.content)
    assert len(got["deltas"]) > 3 and _no_tag_anywhere(got["deltas"])


def test_output_cut_off_inside_the_block_is_all_reasoning(client: openai.OpenAI) -> None:
    # The answer is optional, so a budget that ends inside the block still leaves a valid output.
    regex = r"<think>[a-z]{1,30}(</think>done)?"
    choice = _chat(client, regex, max_tokens=4).choices[0]
    assert choice.finish_reason == "length"
    assert choice.message.content is None
    assert choice.message.reasoning_content and choice.message.reasoning_content.isalpha()
    (got,) = _streamed(client, regex, max_tokens=4)
    assert (got["reasoning"], got["content"], got["finish"]) == (
        choice.message.reasoning_content,
        "",
        "length",
    )


def test_enable_thinking_false_reaches_the_template(
    client: openai.OpenAI, server: Server, tiny_qwen3_dir: Path
) -> None:
    """The template then closes an empty block in the prompt; the output is all content."""

    def prompt_ids(kwargs: dict[str, Any] | None) -> list[int]:
        body = {"messages": MESSAGES} | ({"chat_template_kwargs": kwargs} if kwargs else {})
        r = requests.post(f"{server.url}/tokenize", json=body, headers=HEADERS, timeout=60)
        assert r.status_code == 200, r.text
        return r.json()["tokens"]

    thinking, plain = prompt_ids(None), prompt_ids({"enable_thinking": False})
    empty_block = AutoTokenizer.from_pretrained(tiny_qwen3_dir).encode(
        "<think>\n\n</think>\n\n", add_special_tokens=False
    )
    assert plain == thinking + empty_block
    off = {"chat_template_kwargs": {"enable_thinking": False}}
    resp = _chat(client, r"[a-z]{3,8}", max_tokens=16, extra_body=off)
    assert resp.usage.prompt_tokens == len(plain)
    assert resp.choices[0].message.reasoning_content is None
    assert resp.choices[0].message.content.isalpha()
    (got,) = _streamed(client, r"[a-z]{3,8}", max_tokens=16, extra_body=off)
    assert (got["reasoning"], got["content"]) == ("", resp.choices[0].message.content)


def test_template_kwargs_cannot_override_the_renderer(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        _chat(client, "x", extra_body={"chat_template_kwargs": {"tokenize": True}})
    assert "chat_template_kwargs: ['tokenize'] are arguments of the renderer" in str(e.value)
