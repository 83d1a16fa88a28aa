"""The session's shared server (API key required, 1 MiB body limit); see server_harness.py."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from server_harness import MAX_REQUEST_BYTES, Server, launch_server


@pytest.fixture(scope="session")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """The shared server: API key required, 1 MiB body limit."""
    srv = launch_server(tmp_path_factory.mktemp("server"), "--max-request-bytes", str(MAX_REQUEST_BYTES))
    yield srv
    assert srv.stop() == 0, srv.log()[-3000:]


@pytest.fixture(scope="session")
def url(server: Server) -> str:
    return server.url
