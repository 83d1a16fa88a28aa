"""The stream's stop-string holdback: the longest suffix of the text so far that may still grow
into a stop string, computed incrementally with constant work per new character."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from radixlm_runtime.io.stop_holdback import StopHoldback


def _reference(text: str, stops: list[str]) -> int:
    """Brute force: the longest k such that text ends with the first k characters of a stop."""
    return max((k for s in stops for k in range(1, len(s) + 1) if text.endswith(s[:k])), default=0)


def test_examples() -> None:
    assert StopHoldback(["answer"]).update("the ans") == 3
    assert StopHoldback(["\n\n", "xyz"]).update("done\n") == 1
    assert StopHoldback([]).update("abc") == 0
    assert StopHoldback(["answer"]).update("the answer is") == 0
    # A whole stop string is held back whole: the final answer trims it.
    assert StopHoldback(["ab", "a"]).update("xa") == 1
    assert StopHoldback(["ab"]).update("xab") == 2


@given(
    stops=st.lists(st.text(alphabet="abc\n", min_size=1, max_size=5), max_size=4),
    chunks=st.lists(st.text(alphabet="abc\n", max_size=4), max_size=8),
)
def test_incremental_updates_equal_the_brute_force_holdback(stops: list[str], chunks: list[str]) -> None:
    holdback = StopHoldback(stops)
    text = ""
    for chunk in chunks:
        text += chunk
        assert holdback.update(text) == _reference(text, stops), (text, stops)
