"""What a handle keeps of a stream's output: the newest ``keep`` bytes (and gap markers),
exactly, however the chunks fall and however often the oldest piece is cut."""

from __future__ import annotations

import tracemalloc

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


_CHUNKS = st.lists(
    st.binary(min_size=1, max_size=40)
    | st.text(st.characters(max_codepoint=127), min_size=1, max_size=40).map(str.encode)
    | st.text(min_size=1, max_size=10).map(str.encode),
    max_size=30,
)


@settings(max_examples=300, deadline=None)
@given(chunks=_CHUNKS, keep=st.sampled_from([True, 1, 7, 64, 10_000]))
def test_text_callers_keep_the_exact_bytes_from_views_of_a_reused_buffer(
    chunks: list[bytes], keep: bool | int
) -> None:
    # Each chunk arrives as a view into one receive buffer, written over by the next
    # read: what is kept (the decoded text where it is the chunk's ASCII bytes, else the
    # bytes) must be the output's own, and the text and the bytes exactly what was sent.
    out = StreamOutput(keep)
    buffer = bytearray(64)
    texts: list[str] = []
    for chunk in chunks:
        buffer[: len(chunk)] = chunk
        texts.append(out.add(memoryview(buffer)[: len(chunk)], decode=True))
        buffer[:] = b"\xff" * len(buffer)  # the next read lands here
    sent = b"".join(chunks)
    kept = sent if keep is True else sent[len(sent) - keep :] if keep < len(sent) else sent
    assert out.data == kept
    assert out.dropped == len(sent) - len(kept)
    assert "".join(texts) + out.tail.decode("utf-8", "replace") == sent.decode("utf-8", "replace")
    if keep is True:
        assert out.text(final=True) == sent.decode("utf-8", "replace")
        assert out.text() == sent[: len(sent) - len(out.tail)].decode("utf-8", "replace")


def test_ascii_text_is_kept_as_decoded_not_copied_again() -> None:
    # A text callback's chunk of ASCII is kept as the text it decoded to (the same
    # characters as bytes): no second copy of every byte, and the bytes on request.
    out = StreamOutput(True)
    received = bytearray(b"plain ascii \n")
    text = out.add(memoryview(received), decode=True)
    assert out._pieces[0] is text
    received[:] = b"X" * len(received)
    assert out.data == b"plain ascii \n" and out.text() == "plain ascii \n"
    # A character split across chunks (and anything not ASCII) keeps the bytes.
    out.add(b"caf\xc3", decode=True)
    out.add(b"\xa9!", decode=True)
    assert [type(p) for p in out._pieces] == [str, bytes, bytes]
    assert out.data == b"plain ascii \ncaf\xc3\xa9!" and out.text() == "plain ascii \ncafé!"


def test_a_gap_marker_among_kept_text_is_shown_not_kept_as_output() -> None:
    out = StreamOutput(12)
    out.add(b"abcdef", decode=True)
    out.mark("<gap>")
    out.add(b"ghijkl", decode=True)
    assert out.text() == "f<gap>ghijkl"
    assert out.data == b"fghijkl" and out.dropped == 5


def test_kept_text_is_held_once_after_it_is_read() -> None:
    # The text of ended output kept as ASCII text joins its pieces: from then on the joined
    # text is what is kept, not the pieces beside it (a finished handle held it twice).
    received = bytearray(b"0123456789abcdef" * 4096)  # 64 KiB a chunk
    tracemalloc.start()
    try:
        out = StreamOutput(1 << 20)
        for _ in range(16):
            out.add(memoryview(received), decode=True)
        text = out.text(final=True)
        held, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert len(text) == 1 << 20 and out.data == bytes(received) * 16
    assert held < 1.25 * len(text), held  # the text, and the pieces let go
    out.add(b"more\n", decode=True)
    assert out.text() == (bytes(received) * 16)[5:].decode() + "more\n"
