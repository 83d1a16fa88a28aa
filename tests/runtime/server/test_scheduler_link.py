"""The HTTP process's link to the scheduler never blocks its event loop: with no scheduler connected
(dead, or not started), a send fails at once instead of hanging the loop and the watchdog with it."""

from __future__ import annotations

from pathlib import Path

import pytest

from radixlm_runtime.io import messages as msg
from radixlm_runtime.io.tokenizer import load_tokenizer
from radixlm_runtime.server.errors import RequestError
from radixlm_runtime.server.tokenizer_manager import TokenizerManager
from radixlm_runtime.server_args import ServerArgs


def test_send_without_a_scheduler_fails_fast(tiny_llama_dir: Path) -> None:
    tm = TokenizerManager(ServerArgs(), tiny_llama_dir, load_tokenizer(tiny_llama_dir))
    try:
        with pytest.raises(RequestError, match="scheduler process is not accepting requests") as info:
            tm._send(msg.FlushCacheReq(call_id=1))
        assert info.value.status == 503
        tm._send(msg.AbortReq("gone"), quiet=True)  # aborts from cleanup paths never raise
    finally:
        tm.shutdown()
