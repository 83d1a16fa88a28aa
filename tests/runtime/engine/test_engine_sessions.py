"""Program sessions through the offline Engine API (tiny random-init model): session_id on
generate and generate_stream, close_session, the idle timeout and session_id validation."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

import radixlm_runtime as rt

GREEDY = {"temperature": 0, "max_new_tokens": 12, "ignore_eos": True}
SYSTEM = "the theater then an answer " * 4


def _no_leak(engine: rt.Engine) -> dict:
    info = engine.get_server_info()
    assert info["num_sessions"] == 0 and info["pinned_tokens"] == 0
    assert info["protected_tokens"] == 0
    assert info["free_tokens"] + info["cached_tokens_in_tree"] == info["max_total_tokens"]
    return info


def _computed(engine: rt.Engine, out: dict) -> int:
    """Tokens whose KV a finished greedy sequence holds: its prompt and output but the last token,
    whose KV no step computes, except under overlap scheduling (on a GPU), where the step launched
    before the request was seen to finish computes that too."""
    return out["meta_info"]["prompt_tokens"] + GREEDY["max_new_tokens"] - (not engine.scheduler.overlap)


def test_program_calls_rehit_their_history_then_close(tiny_llama_dir: Path) -> None:
    engine = rt.Engine(str(tiny_llama_dir), max_total_tokens=2048, log_level="warning")
    text = SYSTEM + "Q: one"
    first = engine.generate(text, GREEDY, session_id="prog-1")
    info = engine.get_server_info()
    assert info["num_sessions"] == 1
    assert info["pinned_tokens"] == _computed(engine, first)
    text += first["text"] + " Q: two"
    second = engine.generate(text, GREEDY, session_id="prog-1")
    # The whole first prompt comes from the cache (its output too, as far as it re-tokenizes alike).
    assert second["meta_info"]["cached_tokens"] >= first["meta_info"]["prompt_tokens"]
    streamed = list(engine.generate_stream(text + second["text"], GREEDY, session_id="prog-1"))
    assert streamed[-1]["meta_info"]["finish_reason"]["type"] == "length"
    assert engine.get_server_info()["num_sessions"] == 1
    assert engine.close_session("prog-1") is True
    assert engine.close_session("prog-1") is False
    _no_leak(engine)


def test_batch_and_n_share_one_session(tiny_llama_dir: Path) -> None:
    engine = rt.Engine(str(tiny_llama_dir), max_total_tokens=2048, log_level="warning")
    outs = engine.generate([SYSTEM + "a", SYSTEM + "b"], GREEDY | {"n": 2}, session_id="fork")
    assert len(outs) == 4
    info = engine.get_server_info()
    # One pin per session: the sequence of whichever request finished last.
    assert info["num_sessions"] == 1 and info["pinned_tokens"] == info["protected_tokens"]
    assert info["pinned_tokens"] in {_computed(engine, o) for o in outs}
    assert engine.close_session("fork")
    _no_leak(engine)


def test_idle_session_expires(tiny_llama_dir: Path) -> None:
    engine = rt.Engine(
        str(tiny_llama_dir), max_total_tokens=2048, session_timeout_s=0.05, log_level="warning"
    )
    engine.generate(SYSTEM, GREEDY, session_id="short-lived")
    time.sleep(0.2)
    _no_leak(engine)
    assert engine.close_session("short-lived") is False


@pytest.fixture(scope="module")
def engine(tiny_llama_dir: Path) -> rt.Engine:
    return rt.Engine(str(tiny_llama_dir), max_total_tokens=2048, log_level="warning")


@pytest.mark.parametrize("bad", ["", "x" * 300, "tab\there", 12])
def test_bad_session_id_is_refused_before_anything_runs(engine: rt.Engine, bad: object) -> None:
    with pytest.raises(ValueError, match="session_id"):
        engine.generate(SYSTEM, GREEDY, session_id=bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="session_id"):
        engine.close_session(bad)  # type: ignore[arg-type]
    assert engine.scheduler.stats.num_requests == 0


def test_session_timeout_must_be_positive() -> None:
    with pytest.raises(ValueError, match="session_timeout_s"):
        rt.ServerArgs.from_kwargs(session_timeout_s=0)
    with pytest.raises(ValueError, match="session_pin_fraction"):
        rt.ServerArgs.from_kwargs(session_pin_fraction=1.5)
