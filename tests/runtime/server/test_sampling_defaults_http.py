"""--sampling-defaults model through the real server: a model whose generation_config.json recommends
top_k=1 answers /generate and /v1/completions greedily when the request leaves top_k unset (OpenAI's
client sends no top_k), and samples when the request sets its own."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
import requests
from server_harness import API_KEY, HEADERS, Server, launch_server
from tiny_models import with_generation_config

PROMPT = "the theater then an answer"
NEW_TOKENS = 12


@pytest.fixture(scope="module")
def server(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    model_dir = with_generation_config(tiny_llama_dir, tmp_path_factory.mktemp("gen_config"), {"top_k": 1})
    srv = launch_server(tmp_path_factory.mktemp("sampling_defaults"), "--model-path", str(model_dir))
    yield srv
    assert srv.stop() == 0, srv.log()[-3000:]


def _generate(server: Server, params: dict) -> list[int]:
    body = {"text": PROMPT, "sampling_params": {"max_new_tokens": NEW_TOKENS, "ignore_eos": True, **params}}
    r = requests.post(f"{server.url}/generate", json=body, headers=HEADERS, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()["output_ids"]


def test_generate_takes_the_model_defaults(server: Server) -> None:
    greedy = _generate(server, {"temperature": 0})
    assert [_generate(server, {"seed": s}) for s in range(3)] == [greedy] * 3
    assert any(_generate(server, {"seed": s, "top_k": -1}) != greedy for s in range(4))


def test_openai_completions_take_the_model_defaults(server: Server) -> None:
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0, timeout=60)
    model = client.models.list().data[0].id
    texts = {
        client.completions.create(model=model, prompt=PROMPT, max_tokens=NEW_TOKENS, seed=s).choices[0].text
        for s in range(3)
    }
    greedy = client.completions.create(model=model, prompt=PROMPT, max_tokens=NEW_TOKENS, temperature=0)
    assert texts == {greedy.choices[0].text}
