"""The options of ``commands.run``/``connect``/``start`` are defined once
(``sandboxkit/client/options.py``): the keyword forms (TypedDicts, for ``Unpack``) and the
resolved form (``FollowOptions``, with the defaults) hold together, and every reader —
``run``, ``connect``, a ``ProcessStream`` made by hand — starts from the same defaults."""

from __future__ import annotations

import dataclasses

import pytest

from sandboxkit.client import options as opts
from sandboxkit.client.commands import AsyncCommands
from sandboxkit.client.stream import ProcessStream


def _keys(typed_dict: type) -> set[str]:
    return set(typed_dict.__required_keys__ | typed_dict.__optional_keys__)  # type: ignore[attr-defined]


def test_follow_options_has_exactly_the_keywords_of_connect() -> None:
    fields = {f.name for f in dataclasses.fields(opts.FollowOptions)}
    assert fields == _keys(opts.ConnectOptions)
    assert _keys(opts.RunOptions) == _keys(opts.ProcessOptions) | _keys(opts.OutputOptions)
    assert _keys(opts.StartOptions) == _keys(opts.ProcessOptions) | {"tag"}


def test_a_stream_made_by_hand_has_the_defaults_of_run_and_connect() -> None:
    # ProcessStream once defaulted to raw chunks (lines=False) where run and connect
    # delivered whole lines: one default now, FollowOptions'.
    stream = ProcessStream(None, "sbx", 1)  # type: ignore[arg-type]  # never attaches
    assert stream.lines is True
    assert stream.lines == opts.FollowOptions().lines
    assert stream.keep_output == opts.FollowOptions().keep_output


async def test_an_unknown_keyword_is_still_a_type_error() -> None:
    commands = AsyncCommands(None, None)  # type: ignore[arg-type]  # never called
    with pytest.raises(TypeError, match="on_stdot"):
        await commands.run("true", on_stdot=print)  # type: ignore[call-arg]
    with pytest.raises(TypeError, match="tag"):
        await commands.run("true", tag="x")  # type: ignore[call-arg]
    with pytest.raises(TypeError, match="role"):
        await commands.start("true", role="x")  # type: ignore[call-arg]
    with pytest.raises(TypeError, match="envs"):
        await commands.connect(1, envs={})  # type: ignore[call-arg]
