"""Clients that reset the connection while still sending their request body: each is one debug
line and one abort in /metrics, never an "unexpected error" or a traceback, and the server keeps
serving."""

from __future__ import annotations

import socket
import struct
import time
from pathlib import Path
from urllib.parse import urlsplit

import pytest
import requests
from prometheus_client.parser import text_string_to_metric_families
from server_harness import launch_server

pytestmark = pytest.mark.slow

NUM_CLIENTS = 200
DEBUG_LINE = "client disconnected while sending its request"


def send_half_a_body(url: str) -> socket.socket:
    """A connection that sent its headers and half of its declared body."""
    parts = urlsplit(url)
    sock = socket.create_connection((parts.hostname, parts.port))
    body = b'{"text": "' + b"x" * 4000
    head = (
        f"POST /generate HTTP/1.1\r\nHost: {parts.netloc}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {2 * len(body)}\r\n\r\n"
    ).encode()
    sock.sendall(head + body)
    return sock


def reset(sock: socket.socket) -> None:
    """Closes with an RST instead of a FIN, as a client that crashed or lost its network."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    sock.close()


def aborts(url: str) -> float:
    text = requests.get(f"{url}/metrics", timeout=10).text
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }
    return samples[("radixlm_requests_finished_total", (("finish_reason", "abort"),))]


def test_resets_while_sending_are_debug_lines_and_aborts(tmp_path: Path) -> None:
    server = launch_server(tmp_path, "--log-level", "debug", api_key=None)
    try:
        before = aborts(server.url)
        socks = [send_half_a_body(server.url) for _ in range(NUM_CLIENTS)]
        time.sleep(2)  # the server has read every request's headers and waits for the rest
        for sock in socks:
            reset(sock)
        deadline = time.monotonic() + 60
        while aborts(server.url) < before + NUM_CLIENTS and time.monotonic() < deadline:
            time.sleep(0.2)
        assert aborts(server.url) == before + NUM_CLIENTS
        body = {"text": "Hi", "sampling_params": {"max_new_tokens": 2}}
        r = requests.post(f"{server.url}/generate", json=body, timeout=120)
        assert r.status_code == 200, r.text
        log = server.log()
        assert log.count(DEBUG_LINE) == NUM_CLIENTS, log[-3000:]
        assert "Traceback" not in log and "unexpected error" not in log, log[-3000:]
    finally:
        assert server.stop() == 0, server.log()[-3000:]
