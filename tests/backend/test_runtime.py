"""Backends: a local Runtime's lifecycle, and the OpenAI backend driving a radixlm server's /v1."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

import radixlm as sgl

pytestmark = pytest.mark.slow


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _descendants(pid: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError):
                continue
            if ppid == pid:
                found += [int(entry.name), *_descendants(int(entry.name))]
    return found


def test_runtime_rejects_unknown_flags_before_starting() -> None:
    with pytest.raises(ValueError, match=r"unknown engine argument\(s\) \['max_tokens_total'\]"):
        sgl.Runtime(max_tokens_total=100)


def test_runtime_shutdown_leaves_no_process(runtime: sgl.Runtime) -> None:
    # A second, short-lived Runtime: the shared one keeps serving the other tests.
    rt = sgl.Runtime(max_total_tokens=4096, log_level="warning")
    pids = [rt.process.pid, *_descendants(rt.process.pid)]
    assert len(pids) >= 2  # the HTTP process and its scheduler process
    assert sgl.get_server_info(rt)["max_total_tokens"] == 4096
    rt.shutdown()
    deadline = time.monotonic() + 10
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [p for p in pids if _alive(p)]


def test_runtime_stops_when_the_python_process_exits(tmp_path: Path) -> None:
    script = (
        "import radixlm as sgl\n"
        "rt = sgl.Runtime(max_total_tokens=4096, log_level='warning')\n"
        "print(rt.process.pid, flush=True)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=300, env=os.environ.copy()
    )
    assert out.returncode == 0, out.stderr
    pid = int(out.stdout.split()[0])
    deadline = time.monotonic() + 10
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(pid)


def test_flush_cache_and_server_info(backend) -> None:
    assert sgl.flush_cache(backend) is True
    info = sgl.get_server_info(backend)
    assert info["cached_tokens_in_tree"] == 0 and info["num_sessions"] == 0


@pytest.fixture
def openai_backend(runtime: sgl.Runtime) -> sgl.OpenAI:
    name = runtime.endpoint.get_server_info()["served_model_name"]
    return sgl.OpenAI(name, base_url=f"{runtime.url}/v1", api_key="unused")


def test_openai_backend_chat_turns(openai_backend: sgl.OpenAI) -> None:
    @sgl.function
    def chat(s, question):
        s += sgl.system("Answer in one short sentence.")
        s += sgl.user(question)
        s += sgl.assistant(sgl.gen("answer", max_tokens=16))

    state = chat.run(question="What is the capital of France?", backend=openai_backend, temperature=0)
    assert "Paris" in state["answer"]
    assert state.messages()[-1] == {"role": "assistant", "content": state["answer"]}
    assert state.get_meta_info("answer")["completion_tokens"] <= 16


def test_openai_backend_regex_select_and_stream(openai_backend: sgl.OpenAI) -> None:
    @sgl.function
    def structured(s):
        s += sgl.user("Pick a number and a city.")
        with s.assistant():
            s += sgl.gen("number", regex="[0-9]{2}")
        s += "The capital of France is" + sgl.select("city", choices=[" Paris", " London"])

    state = structured.run(backend=openai_backend, temperature=0)
    assert re.fullmatch("[0-9]{2}", state["number"]) and state["city"] == " Paris"
    streamed = structured.run(backend=openai_backend, temperature=0, stream=True)
    assert "".join(streamed.text_iter("number")) == state["number"]


def test_openai_chat_backend_needs_gen_to_start_the_turn(openai_backend: sgl.OpenAI) -> None:
    @sgl.function
    def mid_turn(s):
        s += sgl.user("Hi")
        with s.assistant():
            s += "Sure: " + sgl.gen("x", max_tokens=4)

    with pytest.raises(sgl.ProgramError, match="put gen\\(\\) first inside"):
        mid_turn.run(backend=openai_backend).sync()


def test_openai_chat_turn_under_api_speculation(openai_backend: sgl.OpenAI) -> None:
    """With num_api_spec_tokens a chat model's assistant turn may hold text and several gens: one
    chat completion writes the turn and is split at each gen's stop string; where the message does
    not follow the program's text, the error says so."""
    calls = []
    generate = openai_backend.generate

    def counting(prompt, params):
        calls.append(prompt.role)
        return generate(prompt, params)

    openai_backend.generate = counting

    @sgl.function(num_api_spec_tokens=32)
    def capital(s):
        s += sgl.user("What is the capital of France? Answer in two short sentences.")
        with s.assistant():
            s += sgl.gen("first", stop=".") + "." + sgl.gen("rest", stop="\n")

    state = capital.run(backend=openai_backend, temperature=0).sync()
    assert calls == ["assistant"]
    assert "Paris" in state["first"] and "." not in state["first"]
    assert state.messages()[-1]["content"] == state["first"] + "." + state["rest"]

    @sgl.function(num_api_spec_tokens=16)
    def mid_turn(s):
        s += sgl.user("Hi")
        with s.assistant():
            s += "Sure thing, friend: " + sgl.gen("x", stop="!") + "!"

    with pytest.raises(sgl.ProgramError, match="does not continue with the program's text 'Sure thing"):
        mid_turn.run(backend=openai_backend, temperature=0).sync()


def test_openai_backend_json_schema(openai_backend: sgl.OpenAI) -> None:
    schema = {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 12}},
        "required": ["name"],
    }

    @sgl.function
    def person(s):
        s += sgl.user("Invent a person.")
        s += sgl.assistant(sgl.gen("p", max_tokens=32, json_schema=schema))

    assert isinstance(json.loads(person.run(backend=openai_backend, temperature=0)["p"])["name"], str)


ANSWER_GRAMMAR = 'root ::= "The answer is " ("yes" | "no") "."'


def test_ebnf_gen_through_both_backends(backend: sgl.RuntimeEndpoint, openai_backend: sgl.OpenAI) -> None:
    """gen(ebnf=...) as SGLang's language takes it: over /generate and as /v1's ebnf extra field."""

    @sgl.function
    def completion(s):
        s += "Is Paris in France? " + sgl.gen("a", max_tokens=16, ebnf=ANSWER_GRAMMAR)

    @sgl.function
    def chat(s):
        s += sgl.user("Is Paris in France?")
        s += sgl.assistant(sgl.gen("a", max_tokens=16, ebnf=ANSWER_GRAMMAR))

    for program, be in ((completion, backend), (chat, openai_backend)):
        answer = program.run(backend=be, temperature=0)["a"]
        assert re.fullmatch(r"The answer is (yes|no)\.", answer), answer


def test_openai_backend_unreachable_names_the_url() -> None:
    be = sgl.OpenAI("m", base_url="http://127.0.0.1:9/v1", api_key="x")

    @sgl.function
    def hi(s):
        s += sgl.user("hi") + sgl.assistant(sgl.gen("x", max_tokens=2))

    with pytest.raises(
        sgl.ProgramError, match="cannot reach the OpenAI-compatible server at http://127.0.0.1:9/v1"
    ):
        hi.run(backend=be).sync()


def test_runtime_server_dies_with_a_killed_parent(tmp_path: Path) -> None:
    """SIGKILL skips atexit: the kernel's parent-death signal still stops the server."""
    script = (
        "import os, signal, radixlm as sgl\n"
        "rt = sgl.Runtime(max_total_tokens=4096, log_level='warning')\n"
        "print(rt.process.pid, flush=True)\n"
        "os.kill(os.getpid(), signal.SIGKILL)\n"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert out.returncode == -9, out.stderr
    pid = int(out.stdout.split()[0])
    deadline = time.monotonic() + 30
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(pid)
