"""SGLang's native endpoints on the real server with the default model."""

from __future__ import annotations

import json
import re
import threading
import time

import jsonschema
import pytest
import requests
from server_harness import HEADERS, Server, assert_no_leak, wait_idle

import radixlm_runtime as rt

pytestmark = pytest.mark.slow

PROMPT = "The capital of France is"
GREEDY = {"temperature": 0, "max_new_tokens": 12}


def post(url: str, path: str, body: dict, **kw) -> requests.Response:
    return requests.post(f"{url}{path}", json=body, headers=HEADERS, timeout=120, **kw)


def generate(url: str, body: dict) -> dict | list:
    r = post(url, "/generate", body)
    assert r.status_code == 200, r.text
    return r.json()


def stream_chunks(url: str, body: dict) -> list[dict]:
    chunks = []
    with post(url, "/generate", body | {"stream": True}, stream=True) as r:
        assert r.status_code == 200, r.text
        assert r.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in r.iter_lines(decode_unicode=True) if line]
    assert lines[-1] == "data: [DONE]"
    for line in lines[:-1]:
        assert line.startswith("data: ")
        chunks.append(json.loads(line[len("data: ") :]))
    return chunks


@pytest.fixture(scope="module")
def engine() -> rt.Engine:
    eng = rt.Engine(dtype="float32", max_total_tokens=4096, log_level="warning")
    yield eng
    eng.shutdown()


def test_greedy_matches_offline_engine(url: str, engine: rt.Engine) -> None:
    prompts = [PROMPT, "def fibonacci(n):", "Once upon a time"]
    offline = engine.generate(prompts, GREEDY)
    single = generate(url, {"text": PROMPT, "sampling_params": GREEDY})
    assert single["output_ids"] == offline[0]["output_ids"]
    assert single["text"] == offline[0]["text"]
    batch = generate(url, {"text": prompts, "sampling_params": GREEDY})
    assert isinstance(batch, list) and len(batch) == 3
    assert [o["output_ids"] for o in batch] == [o["output_ids"] for o in offline]
    meta = single["meta_info"]
    assert meta["prompt_tokens"] == len(engine.tokenizer.encode(PROMPT))
    assert meta["completion_tokens"] == 12
    assert meta["finish_reason"] == {"type": "length", "length": 12}


def test_input_ids_and_seeded_sampling(url: str, engine: rt.Engine) -> None:
    ids = engine.tokenizer.encode(PROMPT)
    by_text = generate(url, {"text": PROMPT, "sampling_params": GREEDY})
    by_ids = generate(url, {"input_ids": ids, "sampling_params": GREEDY})
    assert by_ids["output_ids"] == by_text["output_ids"]
    sampled = {"temperature": 1.0, "max_new_tokens": 10, "seed": 7, "ignore_eos": True}
    offline = engine.generate(PROMPT, sampled)
    a = generate(url, {"text": PROMPT, "sampling_params": sampled})
    b = generate(url, {"input_ids": [ids], "sampling_params": [sampled]})
    assert a["output_ids"] == b[0]["output_ids"] == offline["output_ids"]
    n3 = generate(url, {"text": PROMPT, "sampling_params": sampled | {"n": 3}})
    assert len(n3) == 3 and n3[0]["output_ids"] == a["output_ids"]
    assert len({tuple(o["output_ids"]) for o in n3}) > 1


def test_stream_is_cumulative_and_matches_non_stream(url: str) -> None:
    full = generate(url, {"text": PROMPT, "sampling_params": GREEDY})
    chunks = stream_chunks(url, {"text": PROMPT, "sampling_params": GREEDY})
    texts = [c["text"] for c in chunks]
    assert all(b.startswith(a) for a, b in zip(texts, texts[1:]))
    assert texts[-1] == full["text"]
    assert chunks[-1]["output_ids"] == full["output_ids"]
    assert chunks[-1]["meta_info"]["finish_reason"] == full["meta_info"]["finish_reason"]
    assert all(c["meta_info"]["finish_reason"] is None for c in chunks[:-1])


def test_stream_stop_string_never_shows_trimmed_text(url: str) -> None:
    params = {"temperature": 0, "max_new_tokens": 16, "stop": ["answer"]}
    full = generate(url, {"text": PROMPT, "sampling_params": params})
    assert full["meta_info"]["finish_reason"] == {"type": "stop", "matched": "answer"}
    assert "answer" not in full["text"]
    chunks = stream_chunks(url, {"text": PROMPT, "sampling_params": params})
    assert all(full["text"].startswith(c["text"]) for c in chunks)
    assert chunks[-1]["text"] == full["text"]


def test_stream_batch_has_indices(url: str) -> None:
    chunks = stream_chunks(
        url, {"text": [PROMPT, "Hello"], "sampling_params": GREEDY | {"max_new_tokens": 4}}
    )
    finals = {c["index"]: c for c in chunks if c["meta_info"]["finish_reason"]}
    assert set(finals) == {0, 1}


def test_logprobs(url: str, engine: rt.Engine) -> None:
    body = {
        "text": PROMPT,
        "sampling_params": GREEDY | {"max_new_tokens": 4},
        "return_logprob": True,
        "logprob_start_len": 0,
        "top_logprobs_num": 3,
        "return_text_in_logprobs": True,
    }
    out = generate(url, body)
    meta = out["meta_info"]
    n_prompt = meta["prompt_tokens"]
    assert len(meta["input_token_logprobs"]) == n_prompt
    assert meta["input_token_logprobs"][0][0] is None
    assert all(lp <= 0 for lp, _, _ in meta["input_token_logprobs"][1:])
    assert [t for _, t, _ in meta["output_token_logprobs"]] == out["output_ids"]
    assert all(len(top) == 3 for top in meta["output_top_logprobs"])
    # Greedy: the chosen token is the top-1 candidate.
    assert [top[0][1] for top in meta["output_top_logprobs"]] == out["output_ids"]
    assert meta["output_token_logprobs"][0][2] == engine.tokenizer.decode([out["output_ids"][0]])
    offline = engine.generate(
        PROMPT, GREEDY | {"max_new_tokens": 4}, return_logprob=True, logprob_start_len=0
    )
    want = [lp for lp, _, _ in offline["meta_info"]["output_token_logprobs"]]
    got = [lp for lp, _, _ in meta["output_token_logprobs"]]
    assert got == pytest.approx(want, abs=1e-3)


def test_per_prompt_logprob_lists(url: str, engine: rt.Engine) -> None:
    """return_logprob / logprob_start_len / top_logprobs_num as lists, one entry per prompt, give
    what the offline engine gives for the same lists."""
    texts = ["The capital of France is", "Two plus two equals"]
    body = {
        "text": texts,
        "sampling_params": GREEDY | {"max_new_tokens": 2},
        "return_logprob": [True, True],
        "logprob_start_len": [2, 4],
        "top_logprobs_num": [0, 2],
    }
    outs = generate(url, body)
    offline = engine.generate(
        texts,
        GREEDY | {"max_new_tokens": 2},
        return_logprob=True,
        logprob_start_len=[2, 4],
        top_logprobs_num=[0, 2],
    )
    for out, ref, start in zip(outs, offline, (2, 4)):
        meta, ref_meta = out["meta_info"], ref["meta_info"]
        assert len(meta["input_token_logprobs"]) == meta["prompt_tokens"] - start
        assert [t for _, t, _ in meta["input_token_logprobs"]] == [
            t for _, t, _ in ref_meta["input_token_logprobs"]
        ]
        got = [lp for lp, _, _ in meta["output_token_logprobs"]]
        want = [lp for lp, _, _ in ref_meta["output_token_logprobs"]]
        assert got == pytest.approx(want, abs=1e-4)
    assert [len(t) for t in outs[1]["meta_info"]["output_top_logprobs"]] == [2, 2]


def test_max_new_tokens_zero_scores_prompt_and_warms_cache(url: str) -> None:
    text = "Radix trees share prefixes between many requests, " * 4
    out = generate(
        url,
        {
            "text": text,
            "sampling_params": {"max_new_tokens": 0},
            "return_logprob": True,
            "logprob_start_len": 0,
        },
    )
    meta = out["meta_info"]
    assert out["output_ids"] == [] and meta["completion_tokens"] == 0
    assert len(meta["input_token_logprobs"]) == meta["prompt_tokens"]
    again = generate(url, {"text": text, "sampling_params": {"max_new_tokens": 1}})
    assert again["meta_info"]["cached_tokens"] == meta["prompt_tokens"] - 1


def test_model_info_server_info_and_metrics(server: Server) -> None:
    info = requests.get(f"{server.url}/get_model_info", headers=HEADERS, timeout=10).json()
    assert info["is_generation"] is True and info["model_path"]
    server_info = wait_idle(server)
    assert server_info["max_total_tokens"] == 20000
    assert_no_leak(server_info)
    metrics = requests.get(f"{server.url}/metrics", headers=HEADERS, timeout=10)
    assert metrics.status_code == 200
    text = metrics.text
    for name in (
        "radixlm_requests_total",
        "radixlm_prompt_tokens_total",
        "radixlm_generation_tokens_total",
        "radixlm_cached_tokens_total",
        "radixlm_cache_hit_rate",
        "radixlm_num_queue_reqs",
        "radixlm_num_running_reqs",
        'radixlm_time_to_first_token_seconds_bucket{le="+Inf"}',
        "radixlm_inter_token_latency_seconds_count",
    ):
        assert name in text
    values = {
        line.split()[0]: float(line.split()[1]) for line in text.splitlines() if not line.startswith("#")
    }
    assert values["radixlm_requests_total"] > 0 and values["radixlm_generation_tokens_total"] > 0


def test_flush_cache(server: Server) -> None:
    generate(server.url, {"text": PROMPT, "sampling_params": GREEDY})
    wait_idle(server)
    r = post(server.url, "/flush_cache", {})
    assert r.status_code == 200 and r.json()["success"] is True
    info = server.info()
    assert info["cached_tokens_in_tree"] == 0 and info["free_tokens"] == info["max_total_tokens"]
    cold = generate(server.url, {"text": PROMPT, "sampling_params": GREEDY})
    assert cold["meta_info"]["cached_tokens"] == 0


def test_abort_request_ends_a_long_stream(server: Server) -> None:
    rid = "long-stream-to-abort"
    body = {"text": "Count to a thousand:", "rid": rid, "stream": True}
    body["sampling_params"] = {"max_new_tokens": 2000, "ignore_eos": True, "temperature": 0}
    got: list[dict] = []

    def consume() -> None:
        got.extend(stream_chunks(server.url, body))

    thread = threading.Thread(target=consume)
    thread.start()
    deadline = time.monotonic() + 60
    while not got and time.monotonic() < deadline and thread.is_alive():
        time.sleep(0.05)
        # The stream only lands in `got` at the end; wait until the request is known to the server.
        if server.info()["num_running"]:
            break
    r = post(server.url, "/abort_request", {"rid": rid})
    assert r.status_code == 200 and r.json()["success"] is True
    thread.join(60)
    assert not thread.is_alive()
    assert got[-1]["meta_info"]["finish_reason"]["type"] == "abort"
    assert got[-1]["meta_info"]["completion_tokens"] < 2000
    assert post(server.url, "/abort_request", {"rid": rid}).json()["success"] is False
    assert_no_leak(wait_idle(server))


def test_health_generate(url: str) -> None:
    assert requests.get(f"{url}/health", timeout=10).status_code == 200
    assert requests.get(f"{url}/health_generate", headers=HEADERS, timeout=60).status_code == 200


def test_generate_with_ebnf(url: str) -> None:
    grammar = 'root ::= answer "."\nanswer ::= "Paris" | "Lyon" | "Marseille"'
    body = {"text": PROMPT, "sampling_params": GREEDY | {"ebnf": grammar, "max_new_tokens": 10}}
    out = generate(url, body)
    assert (
        out["text"] in ("Paris.", "Lyon.", "Marseille.")
        and out["meta_info"]["finish_reason"]["type"] == "stop"
    )


def test_generate_with_regex_and_json_schema(url: str) -> None:
    ip = r"(\d{1,3}\.){3}\d{1,3}"
    out = generate(
        url,
        {
            "text": "The IP address of the local host is ",
            "sampling_params": GREEDY | {"regex": ip, "max_new_tokens": 30},
        },
    )
    assert re.fullmatch(ip, out["text"]) and out["meta_info"]["finish_reason"]["type"] == "stop"
    schema = {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 20}},
        "required": ["city"],
    }
    body = {
        "text": PROMPT,
        "sampling_params": {
            "temperature": 0,
            "max_new_tokens": 30,
            "json_schema": json.dumps(schema),
            "n": 2,
        },
    }
    outs = generate(url, body)
    for o in outs:
        jsonschema.validate(json.loads(o["text"]), schema)
