"""Primitive construction: what programs are made of, and the errors bad ones get at once."""

from __future__ import annotations

import pytest

import radixlm as sgl
from radixlm.lang import ir


def test_concatenation_flattens_in_order() -> None:
    expr = "Q: " + sgl.gen("a", max_tokens=3) + "\n" + sgl.select("b", choices=["x", "y"])
    leaves = ir.flatten(expr)
    assert [type(e).__name__ for e in leaves] == ["ConstantText", "Gen", "ConstantText", "Select"]
    assert leaves[0].text == "Q: " and leaves[2].text == "\n"


def test_gen_params_override_run_defaults() -> None:
    gen = sgl.gen("x", max_tokens=7, stop="\n", temperature=0)
    merged = gen.params.merged_over(ir.RUN_DEFAULTS)
    assert merged.max_new_tokens == 7 and merged.temperature == 0 and merged.top_p == 1.0
    runtime = merged.to_runtime()
    assert runtime["stop"] == ["\n"] and runtime["max_new_tokens"] == 7 and "regex" not in runtime


def test_dtype_maps_to_regex() -> None:
    from radixlm_runtime.constrained import REGEX_BOOL, REGEX_INT

    assert sgl.gen_int("n").params.to_runtime()["regex"] == REGEX_INT
    assert sgl.gen_int("n", stop=".").params.to_runtime()["stop"] == [".", " ", "\n"]
    assert sgl.gen("b", dtype=bool).params.to_runtime()["regex"] == REGEX_BOOL
    assert sgl.gen_string("s").params.to_runtime()["regex"].startswith('"')


def test_gen_with_choices_is_a_select() -> None:
    expr = sgl.gen("c", choices=["yes", "no"])
    assert isinstance(expr, ir.Select) and expr.choices == ["yes", "no"] and expr.temperature == 0.0


def test_ebnf_goes_to_the_runtime_as_is() -> None:
    grammar = 'root ::= "a" | "b"'
    assert sgl.gen("e", ebnf=grammar).params.to_runtime()["ebnf"] == grammar


def test_json_schema_dict_is_serialized() -> None:
    expr = sgl.gen("j", json_schema={"type": "object", "properties": {"a": {"type": "integer"}}})
    assert expr.params.to_runtime()["json_schema"].startswith('{"type": "object"')


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: sgl.select("pick", choices=[]), "select('pick'): choices must be a non-empty list"),
        (lambda: sgl.select("pick", choices=None), "choices must be a non-empty list"),
        (lambda: sgl.select("pick", choices="ab"), "choices must be a non-empty list"),
        (lambda: sgl.select("pick", choices=["a", 1]), "every choice must be a string"),
        (lambda: sgl.select("pick", choices=["a"], temperature=-1), "temperature must be >= 0"),
        (lambda: sgl.gen("g", choices=["a"], regex="a"), "choices cannot be combined with regex"),
        (lambda: sgl.gen("g", regex="[a-", max_tokens=3), "gen: invalid regex"),
        (lambda: sgl.gen("g", regex="a", json_schema="{}"), "at most one of regex, json_schema, ebnf, dtype"),
        (lambda: sgl.gen("g", ebnf="root ::= x", dtype=int), r"got \['ebnf', 'dtype'\]"),
        (lambda: sgl.gen("g", choices=["a"], ebnf="root ::= x"), "choices cannot be combined"),
        (lambda: sgl.gen("g", dtype=list), "dtype must be one of int, float, str, bool"),
        (lambda: sgl.image("cat.png"), "image inputs are not supported by this model"),
        (lambda: sgl.function(num_api_spec_tokens=0), "num_api_spec_tokens must be a positive int"),
    ],
)
def test_bad_primitives_fail_clearly(make, message: str) -> None:
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        make()


def test_appending_a_non_text_object_is_a_type_error() -> None:
    with pytest.raises(TypeError, match="cannot append a int"):
        "a" + sgl.gen("x") + 3  # noqa: B018


def test_function_needs_a_state_parameter() -> None:
    with pytest.raises(TypeError, match="first parameter must be the program state"):
        sgl.function(lambda: None)


def test_run_without_backend_names_the_fix() -> None:
    sgl.set_default_backend(None)

    @sgl.function
    def hello(s):
        s += "hi"

    with pytest.raises(ValueError, match="set_default_backend"):
        hello.run()
