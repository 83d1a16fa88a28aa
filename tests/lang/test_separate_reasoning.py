"""separate_reasoning (SGLang's primitive): a gen's think block goes to `<name>_reasoning_content`,
its answer to `<name>` and the program's text, streamed and not; then once through a real server."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

import radixlm as sgl
from radixlm.lang.backend_api import BaseBackend, Prompt
from radixlm.lang.chat_template import CHATML
from radixlm.lang.ir import GenParams


class Scripted(BaseBackend):
    """Answers the i-th gen with outputs[i], streamed one character at a time; records the prompts."""

    chat_template = CHATML

    def __init__(self, *outputs: str, is_chat_model: bool = False) -> None:
        self.outputs = list(outputs)
        self.prompts: list[str] = []
        self.is_chat_model = is_chat_model

    def generate(self, prompt: Prompt, params: GenParams) -> tuple[str, dict[str, Any]]:
        self.prompts.append(prompt.text)
        return self.outputs.pop(0), {"call": len(self.prompts)}

    def generate_stream(self, prompt: Prompt, params: GenParams) -> Iterator[tuple[str, dict[str, Any]]]:
        text, meta = self.generate(prompt, params)
        for ch in text:
            yield ch, meta


@sgl.function
def two_turns(s, model_type):
    s += sgl.user("Why?")
    s += sgl.assistant(sgl.separate_reasoning(sgl.gen("answer"), model_type=model_type))
    s += sgl.user("And then?")
    s += sgl.assistant(sgl.gen("next"))


def _turns(answer: str) -> list[dict[str, str]]:
    return [
        {"role": "user", "content": "Why?"},
        {"role": "assistant", "content": answer},
        {"role": "user", "content": "And then?"},
        {"role": "assistant", "content": "fine"},
    ]


@pytest.mark.parametrize("stream", [False, True])
def test_reasoning_and_answer_become_two_variables(stream: bool) -> None:
    backend = Scripted("<think>a < b</think>So b.", "fine")
    state = two_turns.run("qwen3", backend=backend, stream=stream)
    assert state["answer"] == "So b." and state["answer_reasoning_content"] == "a < b"
    assert state.get_meta_info("answer_reasoning_content") == state.get_meta_info("answer") == {"call": 1}
    # Later calls see the answer only, as reasoning models' chat templates replay past turns.
    assert state.messages() == _turns("So b.")
    assert "a < b" not in backend.prompts[1] and backend.prompts[1].endswith("<|im_start|>assistant\n")
    assert "think" not in state.text()


def test_text_iter_streams_reasoning_and_answer_apart() -> None:
    state = two_turns.run("deepseek-r1", backend=Scripted("step one</think>Done.", "fine"), stream=True)
    assert "".join(state.text_iter("answer_reasoning_content")) == "step one"
    assert "".join(state.text_iter("answer")) == "Done."
    assert "".join(state.text_iter()) == state.text() and "step one" not in state.text()


@pytest.mark.parametrize(
    ("model_type", "output", "reasoning", "answer"),
    [
        ("qwen3", "no block", "", "no block"),
        ("deepseek-r1", "cut off inside the blo", "cut off inside the blo", ""),
        ("deepseek-r1", "<think>r</think>a", "r", "a"),
    ],
)
def test_parsers(model_type: str, output: str, reasoning: str, answer: str) -> None:
    state = two_turns.run(model_type, backend=Scripted(output, "fine"))
    assert (state["answer_reasoning_content"], state["answer"]) == (reasoning, answer)


def test_under_speculative_execution_the_taken_text_is_split() -> None:
    """A completion backend's gens share text generated ahead; each gen's own part is split."""

    @sgl.function(num_api_spec_tokens=64)
    def spec(s):
        s += "Q: " + sgl.separate_reasoning(sgl.gen("a", stop="\n"), "qwen3") + "\n"
        s += "R: " + sgl.gen("b", stop="\n")

    state = spec.run(backend=Scripted("<think>hm</think>yes\nR: ok\n"))
    assert (state["a_reasoning_content"], state["a"], state["b"]) == ("hm", "yes", "ok")
    assert state.text() == "Q: yes\nR: ok"


def test_inside_a_speculative_chat_turn_it_is_refused() -> None:
    @sgl.function(num_api_spec_tokens=16)
    def chat(s):
        s += sgl.user("hi") + sgl.assistant(sgl.separate_reasoning(sgl.gen("a"), "qwen3"))

    with pytest.raises(sgl.ProgramError, match="separate_reasoning inside an assistant turn"):
        chat.run(backend=Scripted("x", is_chat_model=True)).sync()


@pytest.mark.parametrize(
    ("expr", "model_type", "message"),
    [
        (sgl.gen("a"), "r1", r"model_type: unknown reasoning parser 'r1'; known: \['qwen3', 'deepseek-r1'\]"),
        (sgl.gen(), "qwen3", "the gen needs a name"),
        (sgl.select("a", choices=["x", "y"]), "qwen3", r"select\('a'\) picks a fixed text"),
        ("just text", "qwen3", "expects a gen"),
    ],
)
def test_bad_arguments_are_refused_where_written(expr: Any, model_type: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        sgl.separate_reasoning(expr, model_type)


@pytest.mark.slow
def test_through_the_server(backend: sgl.RuntimeEndpoint) -> None:
    """The split of what the server generated: the same program without separate_reasoning (same
    greedy tokens) reads the raw text."""
    regex = r"<think>[a-z ]{3,12}</think>[a-z ]{3,12}"

    @sgl.function
    def ask(s, split):
        s += sgl.user("Think, then answer.")
        answer = sgl.gen("answer", max_tokens=40, regex=regex, temperature=0)
        s += sgl.assistant(sgl.separate_reasoning(answer, "qwen3") if split else answer)

    raw = ask.run(False, backend=backend)["answer"]
    state = ask.run(True, backend=backend)
    assert raw == f"<think>{state['answer_reasoning_content']}</think>{state['answer']}"
    assert state["answer"] and state["answer_reasoning_content"]
