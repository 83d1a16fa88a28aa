"""A ReAct-style agent: the model thinks, picks an action with select, and a Python tool (an exact
arithmetic evaluator) answers; the loop ends when the model picks Finish.

python examples/react_agent.py [--url URL] [--question "What is 17 * 23 + 4?"]
"""

from __future__ import annotations

import argparse
import ast
import operator

import radixlm as sgl

_OPS = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.USub: operator.neg,
}


def calculator(expression: str) -> str:
    """Evaluates + - * / over numbers only (never eval() on model output)."""

    def value(node: ast.AST) -> float:
        if isinstance(node, ast.Constant) and isinstance(node.value, int | float):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](value(node.left), value(node.right))
        if isinstance(node, ast.UnaryOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](value(node.operand))
        raise ValueError("only numbers and + - * / are allowed")

    try:
        result = value(ast.parse(expression.strip(), mode="eval").body)
    except (SyntaxError, ValueError, ZeroDivisionError) as e:
        return f"error: {e}"
    return str(int(result) if float(result).is_integer() else round(result, 6))


PROMPT = """Answer the question using the Calculator tool for arithmetic.
Actions: Calculate[expression] computes an arithmetic expression. Finish[answer] gives the final answer.

Question: What is 12 * 12 - 4?
Thought: I need to compute 12 * 12 - 4.
Action: Calculate[12 * 12 - 4]
Observation: 140
Thought: The result is 140.
Action: Finish[140]

"""


@sgl.function
def react(s, question, max_steps=4):
    s += PROMPT + f"Question: {question}\n"
    for step in range(max_steps):
        s += "Thought:" + sgl.gen(f"thought_{step}", max_tokens=32, stop="\n") + "\n"
        s += "Action: " + sgl.select(f"action_{step}", choices=["Calculate", "Finish"])
        s += "[" + sgl.gen(f"arg_{step}", max_tokens=24, stop=["]", "\n"]) + "]\n"
        if s[f"action_{step}"] == "Finish":
            return {"answer": s[f"arg_{step}"].strip(), "steps": step + 1}
        s += f"Observation: {calculator(s[f'arg_{step}'])}\n"
    return {"answer": None, "steps": max_steps}


def run(backend, question: str = "What is 17 * 23 + 4?") -> dict:
    state = react.run(question=question, backend=backend, temperature=0)
    return {**state.ret_value, "transcript": state.text()[len(PROMPT) :]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", help="a running radixlm server; default: start one locally")
    parser.add_argument("--question", default="What is 17 * 23 + 4?")
    args = parser.parse_args()
    backend = sgl.RuntimeEndpoint(args.url) if args.url else sgl.Runtime()
    try:
        result = run(backend, args.question)
        print(result["transcript"])
        print(f"answer: {result['answer']} after {result['steps']} step(s)")
    finally:
        backend.shutdown()


if __name__ == "__main__":
    main()
