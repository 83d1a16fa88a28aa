"""A program that only talks HTTP must not load torch: writing, tracing and running one (against any
backend) uses the language package and the runtime's dtype regexes, never the model stack."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

from radixlm_runtime.constrained.dtypes import REGEX_BOOL, REGEX_FLOAT, REGEX_INT, REGEX_STR

# Runs in a fresh interpreter so modules the test session already loaded do not hide a heavy import.
PROGRAM = textwrap.dedent(
    """
    import json, socket, sys

    import radixlm as sgl
    from radixlm.lang.backend_api import BaseBackend
    from radixlm.lang.chat_template import CHATML
    from radixlm.lang.ir import ChoiceDecision


    class Scripted(BaseBackend):
        '''Answers every gen with "7", every select with its first choice; records the regexes sent.'''

        chat_template = CHATML

        def __init__(self):
            self.regexes = []

        def generate(self, prompt, params):
            self.regexes.append(params.to_runtime().get("regex"))
            return "7", {}

        def select(self, prompt, choices, temperature, method):
            return ChoiceDecision(choices[0])


    @sgl.function
    def quiz(s, question):
        s += sgl.user(f"Q: {question}")
        with s.assistant():
            s += sgl.gen_int("n") + " " + sgl.gen_string("word") + " " + sgl.gen("x", dtype=float)
        s += sgl.gen("flag", dtype=bool) + sgl.select("pick", choices=["yes", "no"])


    graph = quiz.trace()
    backend = Scripted()
    state = quiz.run("How many?", backend=backend)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    try:
        sgl.RuntimeEndpoint(f"http://127.0.0.1:{port}")
        connection_error = None
    except sgl.BackendConnectionError as e:
        connection_error = str(e)
    heavy = ["torch", "transformers", "llguidance", "radixlm_runtime.constrained.backend"]
    print(json.dumps({
        "trace": [type(n).__name__ for n in graph.nodes],
        "truncated": graph.truncated,
        "regexes": backend.regexes,
        "vars": {name: state[name] for name in ("n", "word", "x", "flag", "pick")},
        "text": state.text(),
        "connection_error": connection_error,
        "loaded": [m for m in heavy if m in sys.modules],
    }))
    """
)


def test_an_http_program_runs_without_torch() -> None:
    repo = Path(__file__).resolve().parents[2]  # the checkout under test, not another install
    done = subprocess.run(
        [sys.executable, "-c", PROGRAM], capture_output=True, text=True, timeout=120, cwd=repo
    )
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout)
    assert out["loaded"] == []
    assert out["truncated"] is None
    assert out["trace"] == [
        "RoleBegin", "ConstantText", "Argument", "RoleEnd",
        "RoleBegin", "Gen", "ConstantText", "Gen", "ConstantText", "Gen", "RoleEnd",
        "Gen", "Select",
    ]  # fmt: skip
    assert out["regexes"] == [REGEX_INT, REGEX_STR, REGEX_FLOAT, REGEX_BOOL]
    assert out["vars"] == {"n": "7", "word": "7", "x": "7", "flag": "7", "pick": "yes"}
    user, assistant = "<|im_start|>user\nQ: How many?<|im_end|>\n", "<|im_start|>assistant\n7 7 7<|im_end|>\n"
    assert out["text"] == user + assistant + "7yes"
    assert out["connection_error"].startswith("cannot reach the radixlm server at http://127.0.0.1:")
