"""Text cut into lines for a line-by-line callback: exactly the lines of the text, with one
copy of each character, whatever the chunks and however long the lines."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from sandboxkit.client import lines
from sandboxkit.client.lines import LONGEST_LINE, split_lines


def _reference(partial: str, text: str) -> tuple[list[str], str]:
    """The plain way: join, split, cut what is left into pieces."""
    *complete, rest = (partial + text).split("\n")
    while len(rest) > LONGEST_LINE:
        complete.append(rest[:LONGEST_LINE])
        rest = rest[LONGEST_LINE:]
    return complete, rest


_TEXT = st.text(alphabet="ab\n\r\u00e9", max_size=60) | st.builds(
    lambda n, tail: "x" * n + tail,
    st.integers(0, 3 * LONGEST_LINE),
    st.sampled_from(["", "\n", "\nab"]),
)


@settings(max_examples=300, deadline=None)
@given(
    partial=st.text(alphabet="ab\r", max_size=20)
    | st.integers(0, LONGEST_LINE + 5).map(lambda n: "p" * n),
    texts=st.lists(_TEXT, max_size=5),
)
def test_lines_match_a_plain_split_for_any_chunks(partial: str, texts: list[str]) -> None:
    got_all, want_all = [], []
    got_rest = want_rest = partial
    for text in texts:
        got, got_rest = split_lines(got_rest, text)
        want, want_rest = _reference(want_rest, text)
        got_all += got
        want_all += want
        assert got_rest == want_rest
        assert len(got_rest) <= max(LONGEST_LINE, len(partial))
    assert got_all == want_all


def test_a_long_line_goes_out_in_pieces_of_the_longest_size(monkeypatch) -> None:
    monkeypatch.setattr(lines, "LONGEST_LINE", 4)
    assert split_lines("ab", "cdefghij") == (["abcd", "efgh"], "ij")
    assert split_lines("ab", "cd\nefghijklm") == (["abcd", "efgh", "ijkl"], "m")
    assert split_lines("", "abcd") == ([], "abcd")
