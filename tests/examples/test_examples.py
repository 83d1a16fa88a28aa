"""Every example in examples/ runs against the default model and produces what it promises."""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path
from types import ModuleType

import jsonschema
import pytest

pytestmark = pytest.mark.slow

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def load(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_few_shot_qa(backend) -> None:
    rows = load("few_shot_qa").run(backend)
    assert [r["answer"] for r in rows][:2] == ["Madrid", "Cairo"]
    assert all(r["cached_tokens"] >= r["prompt_tokens"] - 12 for r in rows)


def test_react_agent(backend) -> None:
    example = load("react_agent")
    assert example.calculator("17 * 23 + 4") == "395" and example.calculator("__import__('os')").startswith(
        "error"
    )
    result = example.run(backend)
    assert 1 <= result["steps"] <= 4
    assert "Observation: 395" in result["transcript"] or result["answer"] is not None
    actions = re.findall(r"Action: (\w+)\[", result["transcript"])
    assert actions and set(actions) <= {"Calculate", "Finish"}


def test_rag_fork(backend) -> None:
    example = load("rag_fork")
    passages = example.retrieve("How tall is the Eiffel Tower?")
    assert len(passages) == 3 and all("Eiffel" in p for p in passages[:2])
    result = example.run(backend)
    assert len(result["notes"]) == 3 and all(isinstance(n, str) and n for n in result["notes"])
    assert result["answer"]


def test_json_extraction(backend) -> None:
    example = load("json_extraction")
    people = example.run(backend)
    assert len(people) == len(example.TEXTS)
    for person in people:
        jsonschema.validate(person, example.SCHEMA)
    assert people[0]["name"].startswith("Maria")


def test_batch_eval(backend, tmp_path: Path) -> None:
    example = load("batch_eval")
    result = example.run(backend, num_questions=4, output=tmp_path / "out.json")
    saved = json.loads((tmp_path / "out.json").read_text())
    assert saved["num_questions"] == 4 and 0.0 <= saved["accuracy"] <= 1.0
    assert result["cache_hit_rate"] > 0.5


def test_quickstart_main_job(capsys) -> None:
    load("quickstart").main()
    out = capsys.readouterr().out
    assert "server ready at http://127.0.0.1:" in out
    assert out.count("(prompt tokens from cache:") == 3 and "-> '" in out
