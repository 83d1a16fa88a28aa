"""SGLang's own frontend client (`sglang.RuntimeEndpoint` and the `@sgl.function` language) runs
unchanged against this server.

SGLang itself is never installed (its server runtime pulls in CUDA kernels and much more): its wheel
is downloaded once (`pip download --no-deps`, into ~/.cache/radixlm) and only the frontend language
(sglang/lang, sglang/utils.py and the one stdlib-only module they import from sglang/srt) is
extracted, under a stand-in `sglang/__init__.py` that exports the same language API as the real one
minus the server runtime. The light dependencies of that code are in the `test` extra.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import jsonschema
import pytest
import requests
from server_harness import API_KEY, HEADERS, Server, assert_no_leak, wait_idle

pytestmark = pytest.mark.slow

SGLANG_VERSION = "0.5.23"
# Any platform's wheel holds the same Python sources; naming one lets pip fetch it from anywhere.
WHEEL_TAGS = ["--python-version", "3.11", "--implementation", "cp", "--platform", "manylinux_2_34_x86_64"]
FRONTEND_FILES = re.compile(r"sglang/(lang/.*\.py|utils\.py|_?version\.py|srt/environ\.py)")
STUB_INIT = '''"""Stand-in for SGLang's __init__.py: the frontend language, not the server runtime."""
from sglang.lang.api import (
    assistant, assistant_begin, assistant_end, flush_cache, function, gen, gen_int, gen_string,
    get_server_info, image, select, separate_reasoning, set_default_backend, system, system_begin,
    system_end, user, user_begin, user_end, video,
)
from sglang.lang.backend.runtime_endpoint import RuntimeEndpoint
from sglang.lang.choices import (
    greedy_token_selection, token_length_normalized, unconditional_likelihood_normalized,
)
from sglang.lang.global_config import global_config
from sglang.version import __version__
'''
# pip's words for a registry it cannot reach; any other download failure is a real failure.
NO_NETWORK = ("NewConnectionError", "Max retries exceeded", "Temporary failure in name resolution")


def _frontend_dir() -> Path:
    """The extracted frontend for SGLANG_VERSION, downloading and extracting it on first use."""
    cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "radixlm"
    target = cache / f"sglang-frontend-{SGLANG_VERSION}"
    if (target / "sglang" / "__init__.py").exists():
        return target
    cache.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache) as tmp:
        cmd = [sys.executable, "-m", "pip", "download", f"sglang=={SGLANG_VERSION}", "--no-deps"]
        cmd += ["--only-binary=:all:", *WHEEL_TAGS, "-d", tmp]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        if proc.returncode != 0:
            log = proc.stdout + proc.stderr
            if any(word in log for word in NO_NETWORK):
                pytest.skip(f"cannot download sglang=={SGLANG_VERSION} (no network): {log[-500:]}")
            pytest.fail(f"pip download sglang=={SGLANG_VERSION} failed:\n{log[-3000:]}")
        (wheel,) = Path(tmp).glob("sglang-*.whl")
        out = Path(tmp) / "frontend"
        with zipfile.ZipFile(wheel) as zf:
            zf.extractall(out, [n for n in zf.namelist() if FRONTEND_FILES.fullmatch(n)])
        (out / "sglang" / "srt" / "__init__.py").touch()
        (out / "sglang" / "__init__.py").write_text(STUB_INIT)
        try:
            out.rename(target)
        except OSError:  # another test run got there first
            shutil.rmtree(out)
    return target


@pytest.fixture(scope="module")
def sgl() -> Iterator[ModuleType]:
    """`import sglang as sgl`, the frontend language only; removed from sys.modules afterwards."""
    path = str(_frontend_dir())
    sys.path.insert(0, path)
    try:
        import sglang

        assert sglang.__version__ == SGLANG_VERSION
        yield sglang
    finally:
        sys.path.remove(path)
        for name in [m for m in sys.modules if m == "sglang" or m.startswith("sglang.")]:
            del sys.modules[name]


@pytest.fixture(scope="module")
def backend(sgl: ModuleType, server: Server):
    endpoint = sgl.RuntimeEndpoint(server.url, api_key=API_KEY)
    sgl.set_default_backend(endpoint)
    return endpoint


def _run(program, **kwargs):
    state = program.run(**kwargs)
    assert state.error() is None, state.error()
    return state


def test_gen_with_stop_then_select(sgl: ModuleType, backend) -> None:
    @sgl.function
    def qa(s, question):
        s += "Question: " + question + "\nAnswer:"
        s += sgl.gen("answer", max_tokens=24, temperature=0, stop="\n")
        s += "\nIs that answer correct? Reply yes or no:"
        s += sgl.select("verdict", choices=[" yes", " no"])

    state = _run(qa, question="What is the capital of France?")
    assert "\n" not in state["answer"]
    assert state["verdict"] in (" yes", " no")
    assert state.text().endswith(state["verdict"])
    meta = state.get_meta_info("answer")
    assert meta["completion_tokens"] <= 24 and meta["finish_reason"]["type"] in ("stop", "length")


@pytest.mark.parametrize("method", ["token_length_normalized", "greedy_token_selection"])
def test_select_methods(sgl: ModuleType, backend, method: str) -> None:
    choices = [" blue", " green", " a red sports car"]

    @sgl.function
    def sky(s):
        s += "On a clear day the color of the sky is"
        s += sgl.select("color", choices=choices, choices_method=getattr(sgl, method))

    state = _run(sky)
    assert state["color"] in choices
    meta = state.get_meta_info("color")
    assert len(meta["normalized_prompt_logprobs"]) == len(choices)
    # Each choice's prompt logprobs cover at least its own tokens: [logprob, token id, token text].
    for entries in meta["input_token_logprobs"]:
        assert entries and all(len(e) == 3 and isinstance(e[2], str) for e in entries)
    if method == "token_length_normalized":
        best = max(range(len(choices)), key=lambda i: meta["normalized_prompt_logprobs"][i])
        assert state["color"] == choices[best]


def test_regex_json_schema_and_typed_gen(sgl: ModuleType, backend) -> None:
    ip = r"((25[0-5]|2[0-4]\d|1\d\d|[1-9]?\d)\.){3}(25[0-5]|2[0-4]\d|1\d\d|[1-9]?\d)"
    schema = {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer"}},
        "required": ["name", "age"],
    }

    @sgl.function
    def constrained(s):
        s += "The IP address of the local host is "
        s += sgl.gen("ip", max_tokens=30, temperature=0, regex=ip)
        s += "\nA person as JSON: "
        s += sgl.gen("person", max_tokens=40, temperature=0, json_schema=json.dumps(schema))
        s += "\nThe number of legs of a dog: "
        s += sgl.gen_int("legs", max_tokens=5)

    state = _run(constrained)
    assert re.fullmatch(ip, state["ip"])
    jsonschema.validate(json.loads(state["person"]), schema)
    assert re.fullmatch(r"[-+]?[0-9]+[ \n]*", state["legs"])


def test_fork_and_join(sgl: ModuleType, backend) -> None:
    @sgl.function
    def tips(s):
        s += "Two tips for staying healthy: 1. Balanced diet. 2. Regular exercise.\n\n"
        forks = s.fork(2)
        for i, f in enumerate(forks):
            f += f"Now, expand tip {i + 1} into a paragraph:\n"
            f += sgl.gen("detail", max_tokens=16, temperature=0, ignore_eos=True)
        s += "Tip 1:" + forks[0]["detail"] + "\nTip 2:" + forks[1]["detail"] + "\n"
        s += "In summary," + sgl.gen("summary", max_tokens=8, temperature=0, ignore_eos=True)

    state = _run(tips)
    text = state.text()
    assert "Tip 1:" in text and "Tip 2:" in text and state["summary"]
    assert text.endswith(state["summary"])


def test_streaming_matches_the_final_text(sgl: ModuleType, backend) -> None:
    @sgl.function
    def story(s):
        s += "Once upon a time"
        s += sgl.gen("story", max_tokens=24, temperature=0, ignore_eos=True)

    streamed = story.run(stream=True)
    pieces = list(streamed.text_iter("story"))
    assert len(pieces) > 1
    assert "".join(pieces) == streamed["story"] == _run(story)["story"]


def test_chat_roles_and_run_batch(sgl: ModuleType, server: Server) -> None:
    chat_backend = sgl.RuntimeEndpoint(server.url, api_key=API_KEY, chat_template_name="chatml")

    @sgl.function
    def chat(s, question):
        s += sgl.system("You are a concise assistant.")
        s += sgl.user(question)
        s += sgl.assistant(sgl.gen("reply", max_tokens=16, temperature=0))

    states = chat.run_batch(
        [{"question": "Name a fruit."}, {"question": "Name a color."}], backend=chat_backend
    )
    for state in states:
        assert state.error() is None, state.error()
        assert "<|im_start|>assistant\n" in state.text() and isinstance(state["reply"], str)


def test_flush_cache_server_info_and_no_leak(sgl: ModuleType, backend, server: Server) -> None:
    wait_idle(server)
    sgl.flush_cache()
    info = sgl.get_server_info()
    assert info["cached_tokens_in_tree"] == 0 and info["max_total_tokens"] > 0
    assert_no_leak(wait_idle(server))


def test_logprob_start_len_follows_sglang(server: Server) -> None:
    """SGLang's semantics of logprob_start_len, as the client relies on them: -1 (the default)
    returns output logprobs only, and a start at the prompt's end is valid and returns none."""
    ids = [[1, 504, 3575, 282, 4649, 314], [1, 504, 3575]]
    body = {"input_ids": ids, "sampling_params": {"max_new_tokens": 0}, "return_logprob": True}
    r = requests.post(f"{server.url}/generate", json=body, headers=HEADERS, timeout=60)
    assert r.status_code == 200, r.text
    assert [o["meta_info"]["input_token_logprobs"] for o in r.json()] == [[], []]
    body = {"input_ids": ids[0], "sampling_params": {"max_new_tokens": 1}, "return_logprob": True}
    body["logprob_start_len"] = len(ids[0])
    r = requests.post(f"{server.url}/generate", json=body, headers=HEADERS, timeout=60)
    assert r.status_code == 200, r.text
    meta = r.json()["meta_info"]
    assert meta["input_token_logprobs"] == [] and len(meta["output_token_logprobs"]) == 1
    # Set stop_regex (not implemented here) is refused rather than ignored; the client's empty one
    # passes (every test above).
    bad = {"text": "Hi", "sampling_params": {"stop_regex": ["\\d"]}}
    r = requests.post(f"{server.url}/generate", json=bad, headers=HEADERS, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "sampling_params.stop_regex"
