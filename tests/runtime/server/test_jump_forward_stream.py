"""Jump-forward through the HTTP server: a constrained stream grows by whole forced runs, each chunk
extends the last (retokenization never rewrites reported tokens), and /server_info counts the jumps."""

from __future__ import annotations

import json

import jsonschema
import pytest
import requests
from server_harness import HEADERS, Server, assert_no_leak, wait_idle

pytestmark = pytest.mark.slow

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "city": {"type": "string", "maxLength": 20},
    },
    "required": ["name", "age", "city"],
    "additionalProperties": False,
}
BODY = {
    "text": "Describe a fictional person as JSON with name, age and city.\n",
    "sampling_params": {"temperature": 0, "max_new_tokens": 60, "json_schema": json.dumps(SCHEMA)},
}


def test_constrained_stream_with_jumps(server: Server) -> None:
    url = server.url
    full = requests.post(f"{url}/generate", json=BODY, headers=HEADERS, timeout=120).json()
    jsonschema.validate(json.loads(full["text"]), SCHEMA)
    before = requests.get(f"{url}/server_info", headers=HEADERS, timeout=10).json()["jump_forwards"]
    with requests.post(
        f"{url}/generate", json=BODY | {"stream": True}, headers=HEADERS, timeout=120, stream=True
    ) as r:
        assert r.status_code == 200, r.text
        lines = [line for line in r.iter_lines(decode_unicode=True) if line]
    assert lines[-1] == "data: [DONE]"
    chunks = [json.loads(line[len("data: ") :]) for line in lines[:-1]]
    texts = [c["text"] for c in chunks]
    assert all(b.startswith(a) for a, b in zip(texts, texts[1:]))
    assert texts[-1] == full["text"] and chunks[-1]["output_ids"] == full["output_ids"]
    # Fewer chunks than tokens: forced runs arrive several tokens at a time.
    assert len(chunks) < len(full["output_ids"])
    info = wait_idle(server)
    assert info["jump_forwards"] > before
    assert_no_leak(info)
