"""Valid under any budget: a constrained request whose max_new_tokens runs out ends on the shortest
completion of its output, so it parses (finish_reason length); a budget below the shortest output
the constraint admits is refused before anything runs. Random schemas (hypothesis) and an EBNF
grammar, sampled at temperature 1 on the tiny random model, whose tokens go anywhere the mask lets."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import jsonschema
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_constrained_engine import ARITHMETIC, parse_arithmetic

import radixlm_runtime as rt

PROMPT = "the theater then an answer"


@pytest.fixture(scope="module")
def engine(tiny_llama_dir: Path) -> rt.Engine:
    return rt.Engine(str(tiny_llama_dir), max_total_tokens=8192, context_length=512, log_level="warning")


def leaf() -> st.SearchStrategy[dict[str, Any]]:
    bounded = st.integers(-50, 50).flatmap(
        lambda lo: st.just({"type": "integer", "minimum": lo, "maximum": lo + 99})
    )
    return st.one_of(
        st.just({"type": "integer"}),  # unbounded: the model may write digits until the budget ends
        bounded,
        st.just({"type": "number"}),
        st.just({"type": "boolean"}),
        st.just({"type": "string"}),
        st.integers(1, 12).map(lambda n: {"type": "string", "maxLength": n}),
        st.just({"enum": ["red", "green", 3]}),
        st.just({"type": ["string", "null"]}),
    )


def extend(children: st.SearchStrategy[dict[str, Any]]) -> st.SearchStrategy[dict[str, Any]]:
    arrays = st.tuples(children, st.integers(0, 2)).map(
        lambda t: {"type": "array", "items": t[0], "minItems": t[1]}
    )
    objects = st.dictionaries(
        st.sampled_from(["a", "bb", "name", "x1"]), children, min_size=1, max_size=3
    ).map(lambda props: {"type": "object", "properties": props, "required": sorted(props)})
    return st.one_of(arrays, objects)


SCHEMAS = st.recursive(leaf(), extend, max_leaves=5).map(
    lambda s: (
        s if s.get("type") == "object" else {"type": "object", "properties": {"v": s}, "required": ["v"]}
    )
)


def shortest(engine: rt.Engine, params: dict[str, Any]) -> int:
    """The shortest output the engine admits for the constraint, from its refusal of a 1-token budget."""
    try:
        engine.generate(PROMPT, params | {"max_new_tokens": 1})
    except ValueError as e:
        found = re.search(r"fewer than the (\d+) tokens", str(e))
        assert found, e
        return int(found.group(1))
    return 1


@settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(schema=SCHEMAS, seed=st.integers(0, 1000))
def test_random_schemas_parse_at_every_budget(engine: rt.Engine, schema: dict[str, Any], seed: int) -> None:
    params = {"json_schema": json.dumps(schema), "temperature": 1.0, "seed": seed}
    need = shortest(engine, params)
    budgets = [need, need + 1, need + 3, need + 8, need + 30]
    outs = engine.generate([PROMPT] * len(budgets), [params | {"max_new_tokens": b} for b in budgets])
    for budget, out in zip(budgets, outs):
        assert out["meta_info"]["completion_tokens"] <= budget
        jsonschema.validate(json.loads(out["text"]), schema)


@pytest.mark.parametrize("seed", range(3))
def test_ebnf_parses_at_every_budget(engine: rt.Engine, seed: int) -> None:
    params = {"ebnf": ARITHMETIC, "temperature": 1.0, "seed": seed}
    budgets = [1, 2, 3, 5, 8, 13, 30]
    outs = engine.generate([PROMPT] * len(budgets), [params | {"max_new_tokens": b} for b in budgets])
    for out in outs:
        assert parse_arithmetic(out["text"]) == len(out["text"]) > 0, out["text"]


def test_budget_below_the_shortest_output_is_refused(engine: rt.Engine) -> None:
    """A ValueError naming max_new_tokens, as the server's 400 (io/finish.py FinishReason.refusal)."""
    schema = {"type": "object", "properties": {"first_name": {"type": "string"}}, "required": ["first_name"]}
    with pytest.raises(ValueError, match=r"^max_new_tokens: 2 is fewer than the") as e:
        engine.generate(PROMPT, {"json_schema": json.dumps(schema), "max_new_tokens": 2})
    assert getattr(e.value, "param", None) == "max_new_tokens"
    assert not engine.scheduler.has_work()
