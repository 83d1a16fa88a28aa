"""API speculative execution's text bookkeeping: what generated-ahead text each gen and constant
text claim, and how an assistant message is matched against a collected chat turn."""

from __future__ import annotations

import pytest

from radixlm.lang import ir
from radixlm.lang.speculative import ChatTurn, HeldText, eligible, speculative_params


def gen(name: str, **params: object) -> ir.Gen:
    return ir.Gen(name, ir.GenParams(**params))


def test_held_text_serves_gens_while_the_program_agrees() -> None:
    held = HeldText(" Alice\nAge: 31\nCity: Oslo\n")
    assert held.take(ir.GenParams(stop="\n")) == " Alice"
    held.fill("\nAge:")
    assert held.take(ir.GenParams(stop=["\n", "."])) == " 31"
    held.fill("\nTown:")  # the program says something else: the rest is stale
    assert held.text == ""


def test_held_text_without_a_stop_takes_at_most_the_limit() -> None:
    held = HeldText("abcdefgh")
    assert held.take(ir.GenParams(max_new_tokens=3)) == "abc"
    assert held.take(ir.GenParams(stop="z", max_new_tokens=100)) == "defgh"
    assert held.text == ""


def test_the_earliest_stop_string_wins() -> None:
    assert HeldText("one. two\nthree").take(ir.GenParams(stop=["\n", "."])) == "one"


def test_speculative_call_drops_stops_and_asks_for_enough_tokens() -> None:
    params = ir.GenParams(stop="\n", max_new_tokens=16, temperature=0.0)
    ahead = speculative_params(params, 64)
    assert ahead.max_new_tokens == 64 and ahead.temperature == 0.0
    assert "stop" not in ahead.to_runtime()
    assert speculative_params(ir.GenParams(max_new_tokens=200), 64).max_new_tokens == 200


def test_constrained_and_logprob_gens_are_not_speculated() -> None:
    assert eligible(ir.GenParams(stop="\n"))
    assert not eligible(ir.GenParams(regex="[0-9]+"))
    assert not eligible(ir.GenParams(json_schema="{}"))
    assert not eligible(ir.GenParams(dtype=int))
    assert not eligible(ir.GenParams(return_logprob=True))


def test_chat_turn_matches_text_and_gens_in_order() -> None:
    turn = ChatTurn(["Name:", gen("name"), "\nAge:", gen("age"), "\n"])
    params = [ir.GenParams(stop="\n"), ir.GenParams(stop="\n")]
    pieces = turn.match("Name: Bob\nAge: 40\nextra words", params)
    assert pieces == [("Name:", None), (" Bob", "name"), ("\nAge:", None), (" 40", "age"), ("\n", None)]


def test_chat_turn_last_gen_takes_the_rest_and_trailing_text_is_the_programs() -> None:
    turn = ChatTurn([gen("first", stop="."), ".", gen("rest"), " (end)"])
    params = [ir.GenParams(stop="."), ir.GenParams()]
    pieces = turn.match("Paris is the capital. It is large", params)
    assert pieces == [
        ("Paris is the capital", "first"),
        (".", None),
        (" It is large", "rest"),
        (" (end)", None),
    ]


def test_chat_turn_reports_where_the_message_strays() -> None:
    turn = ChatTurn(["Sure: ", gen("x"), "!"])
    with pytest.raises(ValueError, match="does not continue with the program's text 'Sure: '"):
        turn.match("Hello there", [ir.GenParams(stop="!")])
    turn = ChatTurn([gen("a"), "\nB:", gen("b")])
    with pytest.raises(ValueError, match="gen 'a' found none of its stop strings"):
        turn.match("no newline here", [ir.GenParams(stop="\n"), ir.GenParams(stop="\n")])
