"""Call graphs: what f.trace() records, and the prefix run_batch warms from it."""

from __future__ import annotations

import radixlm as sgl
from radixlm.lang import ir
from radixlm.lang.chat_template import CHATML
from radixlm.lang.tracer import Argument, ForkNode, JoinNode, VarRef

SYSTEM = "You are a careful assistant."


@sgl.function
def agent(s, question, shots=("2+2=4", "3+3=6")):
    s += sgl.system(SYSTEM)
    for shot in shots:
        s += shot + "\n"
    s += sgl.user(f"Question: {question}")
    with s.assistant():
        s += sgl.gen("plan", max_tokens=16, stop="\n", temperature=0)
    s += "Plan was: " + s["plan"] + "\n"
    forks = s.fork(2)
    forks += lambda i: f"Option {i}: " + sgl.select("opt", choices=["yes", "no"])
    forks.join("concate_and_append")
    with s.var_scope("final"):
        s += sgl.gen("answer", regex="[0-9]+")


def test_trace_records_the_program_structure() -> None:
    graph = agent.trace()
    kinds = [type(n).__name__ for n in graph.nodes]
    assert kinds == [
        "RoleBegin", "ConstantText", "RoleEnd",  # system
        "ConstantText", "ConstantText",  # default shots
        "RoleBegin", "ConstantText", "Argument", "RoleEnd",  # user turn with the argument
        "RoleBegin", "Gen", "RoleEnd",
        "ConstantText", "VarRef", "ConstantText",
        "ForkNode", "JoinNode",
        "VarScopeBegin", "Gen", "VarScopeEnd",
    ]  # fmt: skip
    assert graph.truncated is None
    arg = next(n for n in graph.nodes if isinstance(n, Argument))
    assert arg.name == "question"
    assert next(n for n in graph.nodes if isinstance(n, VarRef)).name == "plan"
    plan = graph.gen_nodes()[0]
    assert plan.name == "plan" and plan.params.max_new_tokens == 16 and plan.params.stop == "\n"
    fork = next(n for n in graph.nodes if isinstance(n, ForkNode))
    assert fork.size == 2 and [type(n).__name__ for n in fork.branches[1]] == ["ConstantText", "Select"]
    assert fork.branches[1][0].text == "Option 1: "
    assert next(n for n in graph.nodes if isinstance(n, JoinNode)).mode == "concate_and_append"
    assert [n.name for n in graph.gen_nodes()] == ["plan", "opt", "opt", "answer"]


def test_trace_prints_readably() -> None:
    text = str(agent.trace())
    assert text.startswith("CallGraph agent(question, shots)")
    assert "  arg question" in text and "  fork 2" in text and "select 'opt' choices=['yes', 'no']" in text


def test_leading_text_stops_at_the_first_unknown() -> None:
    static = agent.trace().leading_text(CHATML)
    assert static == f"<|im_start|>system\n{SYSTEM}<|im_end|>\n2+2=4\n3+3=6\n<|im_start|>user\nQuestion: "
    with_args = agent.trace(question="What is 5+5?").leading_text(CHATML)
    assert with_args.endswith("Question: What is 5+5?<|im_end|>\n<|im_start|>assistant\n")


def test_control_flow_on_an_argument_truncates_the_trace() -> None:
    @sgl.function
    def loop(s, items):
        s += "Items:\n"
        for item in items:
            s += item + sgl.gen("x", max_tokens=2)

    graph = loop.trace()
    assert "items" in graph.truncated and [type(n) for n in graph.nodes] == [ir.ConstantText]
    full = loop.trace(items=["a", "b"])
    assert full.truncated is None and len(full.gen_nodes()) == 2
