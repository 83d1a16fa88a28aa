"""The disk KV tier through the real server: a server started again on the same model and
--kv-disk-dir serves a prompt it saw before the restart from disk, with the same tokens, and says so
in /server_info and /metrics."""

from __future__ import annotations

from pathlib import Path

import requests
from prometheus_client.parser import text_string_to_metric_families
from server_harness import HEADERS, Server, launch_server

PROMPT = "a long shared document: " + "the theater then an answer abc " * 15
BODY = {"text": PROMPT, "sampling_params": {"temperature": 0, "max_new_tokens": 12, "ignore_eos": True}}


def _start(tmp_path: Path, model_dir: Path, disk_dir: Path) -> Server:
    flags = ["--model-path", str(model_dir), "--kv-host-tokens", "256", "--kv-disk-dir", str(disk_dir)]
    return launch_server(tmp_path, *flags, "--deterministic")


def _generate(server: Server) -> dict:
    r = requests.post(f"{server.url}/generate", json=BODY, headers=HEADERS, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def _metric(server: Server, name: str) -> float:
    r = requests.get(f"{server.url}/metrics", headers=HEADERS, timeout=10)
    assert r.status_code == 200
    samples = {s.name: s.value for f in text_string_to_metric_families(r.text) for s in f.samples}
    return samples[name]


def test_a_restarted_server_serves_the_prefix_from_disk(tiny_llama_dir: Path, tmp_path: Path) -> None:
    disk_dir = tmp_path / "kv"
    first = _start(tmp_path, tiny_llama_dir, disk_dir)
    try:
        before = _generate(first)
        assert before["meta_info"]["cached_tokens"] == 0
        assert first.info()["disk_stored_tokens"] >= before["meta_info"]["prompt_tokens"]
    finally:
        assert first.stop() == 0, first.log()[-3000:]
    assert list(disk_dir.glob("*/*.kv")), "nothing written to the disk tier"

    second = _start(tmp_path, tiny_llama_dir, disk_dir)
    try:
        after = _generate(second)
        assert after["output_ids"] == before["output_ids"]
        prompt_tokens = after["meta_info"]["prompt_tokens"]
        assert after["meta_info"]["cached_tokens"] == prompt_tokens - 1
        info = second.info()
        assert info["disk_hit_tokens"] == prompt_tokens - 1 and info["disk_failed_tokens"] == 0
        assert info["cached_tokens_on_disk"] > 0 and info["disk_reads"] == 1
        assert _metric(second, "radixlm_kv_disk_tier_hit_tokens_total") == prompt_tokens - 1
        assert _metric(second, "radixlm_kv_disk_tier_load_seconds_count") == 1
    finally:
        assert second.stop() == 0, second.log()[-3000:]
