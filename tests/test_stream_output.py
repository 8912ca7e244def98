"""What a handle keeps of a stream's output: the newest ``keep`` bytes (and gap markers),
exactly, however the chunks fall and however often the oldest piece is cut."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from sandboxkit.client.output import StreamOutput

_ITEMS = st.lists(
    st.binary(min_size=1, max_size=40).map(lambda b: ("data", b))
    | st.sampled_from([("mark", "<gap>"), ("mark", "")]),
    max_size=30,
)


@settings(max_examples=300, deadline=None)
@given(items=_ITEMS, keep=st.integers(1, 120))
def test_the_newest_bytes_and_markers_are_kept_exactly(
    items: list[tuple[str, object]], keep: int
) -> None:
    out = StreamOutput(keep)
    units: list[tuple[str, int | str]] = []  # every byte and marker character, in order
    for kind, item in items:
        if kind == "data":
            assert isinstance(item, bytes)
            out.add(item, decode=False)
            units += [("b", byte) for byte in item]
        else:
            assert isinstance(item, str)
            out.mark(item)
            units += [("m", char) for char in item]
    kept = units[-keep:] if units else []
    assert out.data == bytes(u for k, u in kept if k == "b")  # type: ignore[misc]
    total = sum(1 for k, _ in units if k == "b")
    assert out.dropped == total - len(out.data)


def test_trimming_keeps_no_copy_of_the_oldest_piece() -> None:
    # The oldest piece is skipped into, not sliced: its bytes object stays the one added.
    out = StreamOutput(10)
    first = b"a" * 8
    out.add(first, decode=False)
    out.add(b"b" * 5, decode=False)
    assert out.data == b"aaaaabbbbb" and out.dropped == 3
    assert out._pieces[0] is first
