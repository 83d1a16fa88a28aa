"""Issue 17's OpenAI-compatibility findings over a real server: every field OpenAI defines is
accepted (ignored where harmless) or refused with a 400 naming it, tool messages and SDK-dumped
assistant messages render, logit_bias works end to end, logprobs carry the sampled token, the
`model` name is checked, and /tokenize and /detokenize answer in vLLM's and SGLang's shapes."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
import requests
from openai.types.chat import ChatCompletionMessage
from server_harness import API_KEY, HEADERS, Server, assert_no_leak, launch_server, wait_idle

pytestmark = pytest.mark.slow

PROMPT = "The capital of France is"
USER = [{"role": "user", "content": "What is 2+2?"}]


def post(url: str, path: str, body: dict) -> requests.Response:
    return requests.post(f"{url}{path}", json=body, headers=HEADERS, timeout=120)


def chat_prompt(url: str, messages: list[dict]) -> str:
    """The prompt text the server renders for messages (through /tokenize and /detokenize)."""
    ids = post(url, "/tokenize", {"messages": messages}).json()["tokens"]
    return post(url, "/detokenize", {"tokens": ids}).json()["prompt"]


def test_sdk_dumped_assistant_message_and_tool_message_are_accepted(
    client: openai.OpenAI, model: str, url: str
) -> None:
    first = client.chat.completions.create(model=model, messages=USER, max_tokens=4, temperature=0)
    dumped = first.choices[0].message.model_dump()
    assert {"refusal", "annotations", "audio", "function_call", "tool_calls"} <= set(dumped)
    again = client.chat.completions.create(
        model=model, messages=[*USER, dumped, {"role": "user", "content": "And 3+3?"}], max_tokens=4
    )
    assert again.choices[0].message.content is not None
    call = {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a": 2, "b": 2}'}}
    with_call = ChatCompletionMessage(role="assistant", content=None, tool_calls=[call]).model_dump()
    history = [*USER, with_call, {"role": "tool", "tool_call_id": "call_1", "content": "4"}]
    out = client.chat.completions.create(model=model, messages=history, max_tokens=4, temperature=0)
    assert out.choices[0].finish_reason == "length"
    rendered = chat_prompt(url, history)
    assert '<tool_call>\n{"name":"add","arguments":{"a": 2, "b": 2}}\n</tool_call>' in rendered
    assert "<|im_start|>user\n<tool_response>\n4\n</tool_response>" in rendered
    refused = {"role": "assistant", "content": None, "refusal": "I cannot help with that."}
    assert "I cannot help with that." in chat_prompt(url, [*USER, refused])


def test_harmless_openai_fields_are_ignored(client: openai.OpenAI, model: str) -> None:
    plain = client.chat.completions.create(model=model, messages=USER, max_tokens=6, temperature=0)
    extras = {
        "store": False,
        "metadata": {"team": "a"},
        "service_tier": "auto",
        "reasoning_effort": "low",
        "verbosity": "medium",
        "user": "u-1",
        "prediction": {"type": "content", "content": "4"},
        "modalities": ["text"],
        "parallel_tool_calls": False,
        "tool_choice": "none",
        "tools": None,
        "function_call": "auto",
        "prompt_cache_key": "k",
        "safety_identifier": "s",
        "audio": None,
        "logit_bias": {},
    }
    same = client.chat.completions.create(
        model=model, messages=USER, max_tokens=6, temperature=0, extra_body=extras
    )
    assert same.choices[0].message.content == plain.choices[0].message.content
    text = client.completions.create(
        model=model, prompt=PROMPT, max_tokens=4, temperature=0, n=2, best_of=2, suffix=None, user="u"
    )
    assert len(text.choices) == 2


CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
# (path, extra body fields, the field the 400 must name)
REFUSED = [
    (COMPLETIONS, {"suffix": "!"}, "suffix"),
    (COMPLETIONS, {"best_of": 3}, "best_of"),
    (COMPLETIONS, {"best_of": 1, "n": 2}, "best_of"),
    (COMPLETIONS, {"stream_options": {"include_usage": True}}, "stream_options"),
    (COMPLETIONS, {"stream": False, "stream_options": {"include_usage": True}}, "stream_options"),
    (COMPLETIONS, {"logit_bias": {"5": 101}}, "logit_bias"),
    (COMPLETIONS, {"logit_bias": {"x": 1}}, "logit_bias"),
    (COMPLETIONS, {"logit_bias": {"1000000": 1}}, "logit_bias"),
    (COMPLETIONS, {"logit_bias": {str(i): 1 for i in range(301)}}, "logit_bias"),
    (COMPLETIONS, {"best_of_all": 2}, "best_of_all"),
    (CHAT, {"modalities": ["text", "audio"]}, "modalities"),
    (CHAT, {"audio": {"voice": "alloy", "format": "wav"}}, "audio"),
    (CHAT, {"tools": [{"type": "function", "function": {}}]}, "tools[0].function.name"),
    (CHAT, {"tool_choice": "required"}, "tool_choice"),
    (CHAT, {"tool_choice": {"type": "function", "function": {"name": "f"}}}, "tool_choice"),
    (CHAT, {"functions": [{"name": "f"}]}, "functions"),
    (CHAT, {"function_call": {"name": "f"}}, "function_call"),
    (CHAT, {"web_search_options": {}}, "web_search_options"),
    (CHAT, {"stream_options": {"include_usage": True}}, "stream_options"),
    (CHAT, {"reasoning": {"effort": "low"}}, "reasoning"),
    (CHAT, {"messages": [{"role": "tool", "content": "4"}]}, "messages[0].tool_call_id"),
    (CHAT, {"messages": [*USER, {"role": "assistant", "audio": {"id": "a1"}}]}, "messages[1].audio"),
    (CHAT, {"messages": [{"role": "user", "content": "x", "bogus": 1}]}, "bogus"),
]


@pytest.mark.parametrize(("path", "extra", "param"), REFUSED, ids=[f"{p[4:]}-{x}" for p, _, x in REFUSED])
def test_fields_that_would_change_the_answer_are_refused(
    url: str, model: str, path: str, extra: dict, param: str
) -> None:
    base = {"model": model, "max_tokens": 2}
    base |= {"prompt": PROMPT} if path == COMPLETIONS else {"messages": USER}
    r = post(url, path, base | extra)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["type"] == "invalid_request_error", err


def test_logit_bias_forces_and_bans_tokens(client: openai.OpenAI, model: str, url: str) -> None:
    greedy = post(
        url, "/generate", {"text": PROMPT, "sampling_params": {"temperature": 0, "max_new_tokens": 4}}
    )
    first = greedy.json()["output_ids"][0]
    forced = post(url, "/tokenize", {"prompt": " blue", "add_special_tokens": False}).json()["tokens"][0]
    banned = post(
        url,
        "/generate",
        {
            "text": PROMPT,
            "sampling_params": {"temperature": 0, "max_new_tokens": 4, "logit_bias": {first: -100}},
        },
    ).json()
    assert banned["output_ids"][0] != first
    out = client.completions.create(
        model=model,
        prompt=PROMPT,
        max_tokens=5,
        temperature=1.0,
        seed=1,
        logit_bias={str(forced): 100},
        logprobs=0,
    )
    assert (
        out.choices[0].logprobs.tokens == [post(url, "/detokenize", {"tokens": [forced]}).json()["text"]] * 5
    )
    chat = client.chat.completions.create(
        model=model, messages=USER, max_tokens=3, temperature=0, logit_bias={str(forced): 100}
    )
    assert (
        chat.choices[0].message.content == post(url, "/detokenize", {"tokens": [forced] * 3}).json()["text"]
    )


def test_completion_logprobs_carry_the_sampled_token(client: openai.OpenAI, model: str) -> None:
    zero = client.completions.create(model=model, prompt=PROMPT, max_tokens=4, temperature=0, logprobs=0)
    lp = zero.choices[0].logprobs
    assert lp.top_logprobs == [{tok: val} for tok, val in zip(lp.tokens, lp.token_logprobs)]
    hot = client.completions.create(
        model=model, prompt=PROMPT, max_tokens=24, temperature=2.0, seed=7, logprobs=1
    )
    lp = hot.choices[0].logprobs
    assert all(tok in top and 1 <= len(top) <= 2 for tok, top in zip(lp.tokens, lp.top_logprobs))
    assert any(len(top) == 2 for top in lp.top_logprobs), "a hot sample should leave the top-1 once"


def test_chat_top_logprobs_carry_the_sampled_token(client: openai.OpenAI, model: str) -> None:
    hot = client.chat.completions.create(
        model=model, messages=USER, max_tokens=24, temperature=2.0, seed=7, logprobs=True, top_logprobs=1
    )
    items = hot.choices[0].logprobs.content
    assert all(it.token in [t.token for t in it.top_logprobs] for it in items)
    assert any(len(it.top_logprobs) == 2 for it in items)
    none = client.chat.completions.create(
        model=model, messages=USER, max_tokens=3, temperature=0, logprobs=True, top_logprobs=0
    )
    assert all(it.top_logprobs == [] for it in none.choices[0].logprobs.content)


@pytest.mark.parametrize("path", [COMPLETIONS, CHAT, "/tokenize", "/v1/detokenize"])
def test_another_model_name_is_404_model_not_found(url: str, path: str) -> None:
    body = {
        COMPLETIONS: {"prompt": PROMPT, "max_tokens": 1},
        CHAT: {"messages": USER, "max_tokens": 1},
        "/tokenize": {"prompt": PROMPT},
        "/v1/detokenize": {"tokens": [1]},
    }[path] | {"model": "gpt-4o"}
    r = post(url, path, body)
    assert r.status_code == 404, r.text
    assert r.json()["error"] | {"message": ""} == {
        "message": "",
        "type": "invalid_request_error",
        "param": "model",
        "code": "model_not_found",
    }


def test_tokenize_and_detokenize_in_vllm_and_sglang_shapes(url: str, model: str) -> None:
    one = post(url, "/tokenize", {"model": model, "prompt": PROMPT}).json()
    assert set(one) == {"tokens", "count", "max_model_len"} and one["count"] == len(one["tokens"])
    assert one["max_model_len"] == post(url, "/v1/tokenize", {"prompt": "x"}).json()["max_model_len"] > 0
    native = post(url, "/generate", {"text": PROMPT, "sampling_params": {"max_new_tokens": 1}}).json()
    assert one["count"] == native["meta_info"]["prompt_tokens"]
    back = post(url, "/detokenize", {"model": model, "tokens": one["tokens"]}).json()
    assert back["prompt"] == back["text"] and back["text"].endswith(PROMPT)
    bare = post(url, "/tokenize", {"prompt": PROMPT, "add_special_tokens": False, "return_token_strs": True})
    assert len(bare.json()["token_strs"]) == bare.json()["count"]
    batch = post(url, "/v1/tokenize", {"prompt": [PROMPT, "Hi"]}).json()
    assert batch["tokens"][0] == one["tokens"] and batch["count"] == [len(t) for t in batch["tokens"]]
    texts = post(url, "/v1/detokenize", {"tokens": batch["tokens"], "skip_special_tokens": True}).json()
    assert texts["text"] == [PROMPT, "Hi"]
    chat = post(url, "/tokenize", {"messages": USER}).json()
    assert chat["count"] > len(post(url, "/tokenize", {"prompt": USER[0]["content"]}).json()["tokens"])
    for path, body, param in [
        ("/tokenize", {}, "prompt"),
        ("/tokenize", {"prompt": "x", "messages": USER}, "prompt"),
        ("/tokenize", {"prompt": "x", "bogus": 1}, "bogus"),
        ("/detokenize", {"tokens": [10**9]}, "tokens"),
        ("/detokenize", {"tokens": [1, [2]]}, "tokens"),
    ]:
        r = post(url, path, body)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_server_healthy_and_kv_pool_whole(server: Server) -> None:
    r = post(server.url, "/generate", {"text": "Hi", "sampling_params": {"max_new_tokens": 2}})
    assert r.status_code == 200
    assert_no_leak(wait_idle(server))


@pytest.fixture(scope="module")
def renamed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    srv = launch_server(
        Path(tmp_path_factory.mktemp("renamed")),
        "--served-model-name",
        "team-model",
        "--allow-any-model-name",
    )
    yield srv
    assert srv.stop() == 0, srv.log()[-3000:]


def test_served_model_name_and_allow_any_model_name(renamed: Server) -> None:
    client = openai.OpenAI(base_url=f"{renamed.url}/v1", api_key=API_KEY, max_retries=0, timeout=120)
    assert [m.id for m in client.models.list().data] == ["team-model"]
    assert client.models.retrieve("team-model").id == "team-model"
    out = client.completions.create(model="gpt-3.5-turbo-instruct", prompt=PROMPT, max_tokens=2)
    assert out.model == "team-model"
    chat = client.chat.completions.create(model="anything", messages=USER, max_tokens=2)
    assert chat.model == "team-model"
    assert renamed.info()["served_model_name"] == "team-model"
