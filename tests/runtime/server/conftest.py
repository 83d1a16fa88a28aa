"""The session's shared server (API key required, 1 MiB body limit); see server_harness.py."""

from __future__ import annotations

from collections.abc import Iterator

import openai
import pytest
from server_harness import API_KEY, MAX_REQUEST_BYTES, Server, launch_server


@pytest.fixture(scope="session")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """The shared server: API key required, 1 MiB body limit."""
    srv = launch_server(tmp_path_factory.mktemp("server"), "--max-request-bytes", str(MAX_REQUEST_BYTES))
    yield srv
    assert srv.stop() == 0, srv.log()[-3000:]


@pytest.fixture(scope="session")
def url(server: Server) -> str:
    return server.url


@pytest.fixture(scope="session")
def client(url: str) -> openai.OpenAI:
    """The official OpenAI client on the shared server."""
    return openai.OpenAI(base_url=f"{url}/v1", api_key=API_KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="session")
def model(client: openai.OpenAI) -> str:
    """The served model name, as /v1/models lists it."""
    return client.models.list().data[0].id
