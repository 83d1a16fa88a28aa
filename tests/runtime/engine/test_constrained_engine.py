"""Constrained decoding through the offline Engine: outputs match their regex / JSON schema, other
requests in the batch are unaffected, and bad constraints fail before anything runs."""

from __future__ import annotations

import json
import re
from pathlib import Path

import jsonschema
import pytest

import radixlm_runtime as rt

PROMPT = "the theater then an answer"
IP = r"(\d{1,3}\.){3}\d{1,3}"
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "city": {"type": "string", "maxLength": 20},
        "member": {"type": "boolean"},
    },
    "required": ["name", "age", "city", "member"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def engine(tiny_llama_dir: Path) -> rt.Engine:
    return rt.Engine(
        str(tiny_llama_dir), dtype="float32", max_total_tokens=4096, context_length=256, log_level="warning"
    )


@pytest.mark.parametrize(
    "pattern",
    [IP, "(yes|no)", r"-?[1-9][0-9]{0,5}", r"[a-z]{3,8}"],
    ids=["ip", "yes-no", "integer", "word"],
)
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_regex_output_fullmatches(engine: rt.Engine, pattern: str, temperature: float) -> None:
    params = {"regex": pattern, "temperature": temperature, "max_new_tokens": 40, "seed": 3}
    out = engine.generate(PROMPT, params)
    assert re.fullmatch(pattern, out["text"]), out["text"]
    assert out["meta_info"]["finish_reason"]["type"] == "stop"


def test_ignore_eos_keeps_a_constrained_output_going_while_it_can(engine: rt.Engine) -> None:
    # EOS is made the likeliest token wherever the constraint allows it.
    eos = engine.tokenizer.eos_token_id
    params = {"temperature": 0, "max_new_tokens": 30, "ignore_eos": True, "logit_bias": {eos: 100}}
    for out in engine.generate([PROMPT, "a b c"], params | {"regex": r"[a-z ]+"}):
        assert re.fullmatch(r"[a-z ]+", out["text"]), out["text"]
        assert out["meta_info"]["finish_reason"] == {"type": "length", "length": 30}
    # Where EOS is all the constraint allows, the output still ends there.
    out = engine.generate(PROMPT, params | {"regex": "(yes|no)"})
    assert out["text"] in ("yes", "no") and out["meta_info"]["finish_reason"]["type"] == "stop"


def test_parallel_samples_each_follow_the_regex(engine: rt.Engine) -> None:
    outs = engine.generate(PROMPT, {"regex": r"[a-z]{2,6}", "temperature": 1.0, "n": 4, "max_new_tokens": 20})
    assert len(outs) == 4
    for out in outs:
        assert re.fullmatch(r"[a-z]{2,6}", out["text"]), out["text"]


def test_json_schema_on_tiny_model(engine: rt.Engine) -> None:
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    out = engine.generate(PROMPT, {"json_schema": json.dumps(schema), "temperature": 0, "max_new_tokens": 40})
    jsonschema.validate(json.loads(out["text"]), schema)


def test_unconstrained_neighbour_is_unaffected(engine: rt.Engine) -> None:
    greedy = {"temperature": 0, "max_new_tokens": 12, "ignore_eos": True}
    alone = engine.generate("abc abc", greedy)["output_ids"]
    constrained = {"temperature": 0, "max_new_tokens": 40, "regex": IP}
    outs = engine.generate([PROMPT, "abc abc"], [constrained, greedy])
    assert re.fullmatch(IP, outs[0]["text"])
    assert outs[1]["output_ids"] == alone


def test_constraint_survives_retraction(tiny_llama_dir: Path) -> None:
    """A KV pool too small for the batch forces retraction; the guide keeps its place in the output."""
    small = rt.Engine(str(tiny_llama_dir), max_total_tokens=160, context_length=128, log_level="warning")
    pattern = r"[a-z ]{40,60}"
    outs = small.generate(
        [PROMPT] * 4, {"regex": pattern, "temperature": 1.0, "max_new_tokens": 70, "seed": 1}
    )
    assert small.get_server_info()["num_retractions"] > 0
    for out in outs:
        assert re.fullmatch(pattern, out["text"]), out["text"]


@pytest.mark.parametrize(
    ("params", "field"),
    [
        ({"regex": "([a-z"}, "regex"),
        ({"regex": "a(?=b)"}, "regex"),
        ({"json_schema": "{not json"}, "json_schema"),
        ({"json_schema": '{"type": 12}'}, "json_schema"),
        ({"json_schema": '{"type": "string", "minLength": "x"}'}, "json_schema"),
        ({"json_schema": "false"}, "json_schema"),
        ({"regex": "a", "json_schema": "{}"}, "only one of regex, json_schema and ebnf"),
        ({"ebnf": "root ::= undefined_rule"}, "ebnf"),
        ({"json_schema": '{"type": "string", "format": "iri"}'}, "json_schema: unsupported format"),
    ],
)
def test_bad_constraint_raises_before_running(engine: rt.Engine, params: dict, field: str) -> None:
    before = engine.get_server_info()["num_requests"]
    with pytest.raises(ValueError, match=re.escape(field)):
        engine.generate([PROMPT, "abc"], [{"max_new_tokens": 4}, params])
    assert engine.get_server_info()["num_requests"] == before
    assert not engine.scheduler.has_work()


def test_multibyte_characters_split_across_tokens_match(engine: rt.Engine) -> None:
    """Matching is byte-level: the tiny vocabulary spells this character only in byte tokens, and a
    regex over it is followed exactly."""
    out = engine.generate(PROMPT, {"regex": "\u4e2d{1,2}!", "max_new_tokens": 16, "temperature": 0})
    assert re.fullmatch("\u4e2d{1,2}!", out["text"]), out["text"]
    assert out["meta_info"]["finish_reason"]["type"] == "stop"


ARITHMETIC = 'root ::= expr\nexpr ::= term (("+" | "-") term)*\nterm ::= [0-9]+ | "(" expr ")"'


def parse_arithmetic(text: str) -> int:
    """Characters of `text` that ARITHMETIC parses as a prefix (recursive descent); len(text) = all."""

    def expr(i: int) -> int:
        i = term(i)
        while i < len(text) and text[i] in "+-":
            i = term(i + 1)
        return i

    def term(i: int) -> int:
        if i < len(text) and text[i] == "(":
            i = expr(i + 1)
            if i >= len(text) or text[i] != ")":
                raise ValueError(f"')' expected at {i} in {text!r}")
            return i + 1
        j = i
        while j < len(text) and text[j].isdigit():
            j += 1
        if j == i:
            raise ValueError(f"a number expected at {i} in {text!r}")
        return j

    return expr(0)


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_ebnf_output_parses(engine: rt.Engine, seed: int) -> None:
    out = engine.generate(
        PROMPT, {"ebnf": ARITHMETIC, "temperature": 1.0, "max_new_tokens": 30, "seed": seed}
    )
    if out["meta_info"]["finish_reason"]["type"] == "stop":
        assert parse_arithmetic(out["text"]) == len(out["text"]), out["text"]
    assert re.fullmatch(r"[0-9+\-()]*", out["text"]), out["text"]


def test_guide_out_of_step_fails_only_its_request(engine: rt.Engine, monkeypatch: pytest.MonkeyPatch) -> None:
    from radixlm_runtime.constrained.llguidance_backend import LLGuidanceGuide

    def broken(self: LLGuidanceGuide, token_id: int) -> None:
        raise ValueError(f"token {token_id} is not allowed")

    monkeypatch.setattr(LLGuidanceGuide, "advance", broken)
    outs = engine.generate(
        ["abc", "abc"], [{"regex": "(yes|no)", "temperature": 0}, {"temperature": 0, "max_new_tokens": 4}]
    )
    reason = outs[0]["meta_info"]["finish_reason"]
    assert reason == {
        "type": "constraint_error",
        "message": f"regex: token {outs[0]['output_ids'][-1]} is not allowed",
    }
    assert len(outs[1]["output_ids"]) == 4
    assert not engine.scheduler.has_work()


@pytest.fixture(scope="module")
def smol() -> rt.Engine:
    return rt.Engine(dtype="float32", log_level="warning")


@pytest.mark.slow
class TestDefaultModel:
    def test_regexes(self, smol: rt.Engine) -> None:
        cases = [
            ("The IP address of the local host is ", IP),
            ("Is the sky blue? Answer yes or no: ", "(yes|no)"),
            ("The year the Eiffel Tower was finished: ", r"[0-9]{1,4}"),
        ]
        outs = smol.generate([p for p, _ in cases], [{"regex": r, "temperature": 0} for _, r in cases])
        for out, (_, pattern) in zip(outs, cases):
            assert re.fullmatch(pattern, out["text"]), out["text"]

    def test_json_schema(self, smol: rt.Engine) -> None:
        prompt = "Describe a fictional person as JSON with name, age, city and member fields.\n"
        params = {"json_schema": json.dumps(PERSON), "temperature": 0, "max_new_tokens": 120}
        out = smol.generate(prompt, params)
        jsonschema.validate(json.loads(out["text"]), PERSON)
        sampled = smol.generate(prompt, {**params, "temperature": 0.8, "seed": 5, "n": 2})
        for o in sampled:
            jsonschema.validate(json.loads(o["text"]), PERSON)

    def test_unconstrained_neighbour_is_unaffected(self, smol: rt.Engine) -> None:
        greedy = {"temperature": 0, "max_new_tokens": 16}
        prompt = "def fibonacci(n):"
        alone = smol.generate(prompt, greedy)["output_ids"]
        outs = smol.generate(["My IP is ", prompt], [{**greedy, "regex": IP, "max_new_tokens": 40}, greedy])
        assert re.fullmatch(IP, outs[0]["text"])
        assert outs[1]["output_ids"] == alone
