"""The reasoning parser (radixlm_runtime/server/reasoning.py) without a server: both parsers' splits,
the same split whatever pieces a stream cuts the text into, and the --reasoning-parser flag."""

from __future__ import annotations

import argparse
import itertools

import pytest

from radixlm_runtime.server.reasoning import ReasoningParser, Split, split_reasoning
from radixlm_runtime.server_args import ServerArgs

# (parser, output, reasoning, content)
CASES = [
    ("qwen3", "<think>plan it</think>the answer", "plan it", "the answer"),
    ("qwen3", "<think>\nstep 1\n</think>\n\nok", "\nstep 1\n", "\n\nok"),
    ("qwen3", "no block at all", "", "no block at all"),
    ("qwen3", "<think>cut off by max_tok", "cut off by max_tok", ""),
    ("qwen3", "lead <think>r</think> tail", "r", "lead  tail"),
    ("qwen3", "stray</think> end tag", "", "stray end tag"),
    ("qwen3", "<think>a</think>b<think>c</think>d", "ac", "bd"),
    ("qwen3", "<think>a < b </thinking</think>c <thinker d", "a < b </thinking", "c <thinker d"),
    ("qwen3", "ends with <thi", "", "ends with <thi"),
    ("qwen3", "<think>é≠</think>ü", "é≠", "ü"),
    ("qwen3", "", "", ""),
    ("deepseek-r1", "opened by the template</think>answer", "opened by the template", "answer"),
    ("deepseek-r1", "<think>repeated tag</think>answer", "repeated tag", "answer"),
    ("deepseek-r1", "never closed", "never closed", ""),
    ("deepseek-r1", "</think>empty reasoning", "", "empty reasoning"),
    ("deepseek-r1", "r</think>a</thi", "r", "a</thi"),
]
TAGS = ("<think>", "</think>")


@pytest.mark.parametrize(("name", "text", "reasoning", "content"), CASES)
def test_whole_output(name: str, text: str, reasoning: str, content: str) -> None:
    assert split_reasoning(name, text) == Split(reasoning, content)


def _feed_pieces(name: str, pieces: list[str]) -> list[Split]:
    parser = ReasoningParser(name)
    return [parser.feed(p, final=i == len(pieces) - 1) for i, p in enumerate(pieces)]


def _check_stream(name: str, pieces: list[str], reasoning: str, content: str) -> None:
    splits = _feed_pieces(name, pieces)
    assert "".join(s.reasoning for s in splits) == reasoning, pieces
    assert "".join(s.content for s in splits) == content, pieces
    for s in splits:  # no piece carries a tag, nor the start of one that later completes
        assert not any(tag in part for tag in TAGS for part in s), (pieces, s)


@pytest.mark.parametrize(("name", "text", "reasoning", "content"), CASES)
def test_stream_cut_at_every_boundary(name: str, text: str, reasoning: str, content: str) -> None:
    """Every cut into two and three pieces (empty pieces included), and one character at a time."""
    for i, j in itertools.combinations_with_replacement(range(len(text) + 1), 2):
        _check_stream(name, [text[:i], text[i:j], text[j:]], reasoning, content)
    _check_stream(name, [*text, ""], reasoning, content)


def test_a_possible_tag_is_held_until_the_next_piece_decides() -> None:
    parser = ReasoningParser("qwen3")
    assert parser.feed("answer <th") == Split("", "answer ")
    assert parser.feed("ink>why") == Split("why", "")
    assert parser.feed("</") == Split("", "")
    assert parser.feed("b>") == Split("</b>", "")
    assert parser.feed("</think") == Split("", "")
    assert parser.feed("", final=True) == Split("</think", "")


def test_unknown_parser_is_refused() -> None:
    with pytest.raises(
        ValueError, match=r"unknown reasoning parser 'deepseek'; known: \['qwen3', 'deepseek-r1'\]"
    ):
        ReasoningParser("deepseek")


def _cli() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    return parser


def test_flag_parses_and_defaults_to_off() -> None:
    assert ServerArgs.from_cli_args(_cli().parse_args([])).server.reasoning_parser is None
    args = _cli().parse_args(["--reasoning-parser", "deepseek-r1"])
    assert ServerArgs.from_cli_args(args).server.reasoning_parser == "deepseek-r1"
    assert "reasoning_content" in _cli().format_help()


def test_bad_flag_value_names_the_flag(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        _cli().parse_args(["--reasoning-parser", "r1"])
    assert "--reasoning-parser: invalid choice: 'r1'" in capsys.readouterr().err
    with pytest.raises(ValueError, match=r"reasoning_parser \(--reasoning-parser\) must be one of"):
        ServerArgs.from_kwargs(reasoning_parser="r1")
