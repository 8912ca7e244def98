"""The API's bodies, defined once as typed models: they validate requests (strictly, before
anything changes), describe responses, and generate the OpenAPI document's schemas.

Validation is msgspec's: JSON is decoded straight into these structs, so a value that is the
wrong type, out of range, too long or unknown never reaches the daemon's state. What JSON
itself cannot carry (NaN, Infinity, lone surrogates) is refused as well, since whatever the
daemon stores must serialise back, in every list and every event, forever.
"""

from __future__ import annotations

import json
import math
import re
from typing import Annotated, Any, Literal, TypeVar

import msgspec
import msgspec.inspect
from msgspec import Meta, Struct

from sandboxkit.errors import DAEMON_ERROR_TABLE, InvalidArgument, MalformedFrame
from sandboxkit.lab_options import LabOptions
from sandboxkit.limits import Limits
from sandboxkit.vocab import (
    ROLE_PATTERN,
    ConsumerState,
    OnTimeout,
    ProcessInfo,
    ProcessSpecInfo,
    SandboxInfo,
)

__all__ = [
    "ERROR_SCHEMA",
    "REQUEST_MODELS",
    "RESPONSE_MODELS",
    "SENT_IN_FULL",
    "ConsumerRow",
    "CreateSandbox",
    "EventRow",
    "EventsQuery",
    "Health",
    "KilledProcess",
    "ProcessInfo",
    "SandboxInfo",
    "SetTimeout",
    "StartProcess",
    "StdinAck",
    "StdinBatch",
    "StreamQuery",
    "decode_body",
    "decode_query",
    "encode_json",
    "require_sent_fields",
]

# -- bounds --------------------------------------------------------------------------------

MAX_INT = 2**63 - 1
MAX_EVENTS_WAIT = 25.0
"""The longest long poll of ``GET /events?wait=`` (s): under the client's read timeout."""
MAX_SECONDS = 10**9
"""About 31 years: any longer timeout is a mistake, and ``asyncio.sleep`` would overflow."""
MAX_ARG = 128 * 1024 - 1
"""Linux refuses any single argv or environment string of 128 KiB or more (MAX_ARG_STRLEN)."""
MAX_ENVS = 4096
MAX_ARGV = 4096
MAX_METADATA = 256

_NO_NUL = r"^[^\x00]*$"
_ENV_KEY = r"^[^=\x00]+$"

Seconds = Annotated[float, Meta(gt=0, le=MAX_SECONDS, description="seconds, > 0")]
ExecText = Annotated[str, Meta(max_length=MAX_ARG, pattern=_NO_NUL)]
"""A string that reaches ``execve``: no NUL, shorter than the kernel's per-string limit."""
EnvKey = Annotated[str, Meta(min_length=1, max_length=4096, pattern=_ENV_KEY)]
EnvValue = Annotated[str, Meta(max_length=MAX_ARG, pattern=_NO_NUL)]
Envs = Annotated[dict[EnvKey, EnvValue], Meta(max_length=MAX_ENVS)]
Label = Annotated[str, Meta(max_length=256)]
Count = Annotated[int, Meta(ge=0, le=MAX_INT)]
Role = Annotated[str, Meta(pattern=f"^{ROLE_PATTERN.pattern}$")]


# -- requests ------------------------------------------------------------------------------


class CreateSandbox(Struct, forbid_unknown_fields=True, omit_defaults=True):
    """``POST /sandboxes``."""

    envs: Envs = {}
    timeout: Seconds | None = None
    on_timeout: OnTimeout = "pause"
    auto_resume: bool = False
    metadata: Annotated[
        dict[Label, Annotated[str, Meta(max_length=64 * 1024)]], Meta(max_length=MAX_METADATA)
    ] = {}
    lab: LabOptions | None = None
    """Fault-lab options (:mod:`sandboxkit.lab_options`); absent: a production sandbox."""
    isolation: Literal["auto", "namespaces", "none"] | None = None
    """Namespaces for its processes (``docs/isolation.md``); absent: the daemon's default."""
    allow_internet_access: bool = True
    """``false``: a network namespace with loopback only (under isolation)."""
    limits: Limits | None = None
    """Resource limits (:mod:`sandboxkit.limits`)."""


class SetTimeout(Struct, forbid_unknown_fields=True):
    """``POST /sandboxes/{sid}/timeout``: ``null`` means no idle timeout."""

    timeout: Seconds | None = None


class StartProcess(Struct, forbid_unknown_fields=True):
    """``POST /sandboxes/{sid}/processes``: exactly one of ``cmd`` (run by ``/bin/sh -c``)
    and ``argv``."""

    cmd: ExecText | None = None
    argv: Annotated[list[ExecText], Meta(min_length=1, max_length=MAX_ARGV)] | None = None
    cwd: Annotated[str, Meta(max_length=4096, pattern=_NO_NUL)] | None = None
    envs: Envs = {}
    pty: bool = False
    timeout: Seconds | None = None
    tag: Label | None = None


class StdinBatch(Struct, forbid_unknown_fields=True):
    """``POST .../stdin``: batch ``seq`` of writer ``session``; ``data`` is base64.
    ``end``: the writer holds every ack of the session and sends nothing more, so the
    daemon forgets it (no ``data``; ``seq`` is not checked; ending twice is harmless)."""

    session: Annotated[str, Meta(min_length=1, max_length=128, pattern=_NO_NUL)]
    seq: Count
    data: bytes = b""
    end: bool = False


class StreamQuery(Struct):
    """Query of ``GET .../stream``."""

    cursor: Count | None = None
    name: Label | None = None
    role: Role | None = None


class StartStreamQuery(Struct):
    """Query of ``POST .../processes/stream`` (the stream starts at the first chunk)."""

    name: Label | None = None
    role: Role | None = None


class EventsQuery(Struct):
    """Query of ``GET /events``."""

    since: Count = 0
    pid: Annotated[int, Meta(ge=-MAX_INT, le=MAX_INT)] | None = None
    wait: Annotated[float, Meta(ge=0, le=MAX_EVENTS_WAIT)] = 0.0
    """Seconds to wait for a first matching event when there is none yet (a long poll)."""


REQUEST_MODELS: tuple[type[Struct], ...] = (CreateSandbox, SetTimeout, StartProcess, StdinBatch)

# -- responses (documentation and tests: the daemon's views are plain dicts) --------------
#
# SandboxInfo and ProcessInfo are the shared vocabulary's (sandboxkit/vocab.py): the client
# decodes the daemon's answers with the same structs.


class IsolationSupport(Struct):
    available: bool
    """Whether ``isolation="namespaces"`` can be had on this daemon's host."""
    reason: str
    """What is missing when it cannot (empty when it can)."""
    default: str
    """What a sandbox created without ``isolation`` asks for."""


class Health(Struct):
    status: str
    version: str
    started_at: float
    sandboxes: int
    closing: bool
    isolation: IsolationSupport
    launcher: Literal["launcher", "shell", "off"]
    """What each sandbox keeps started for its commands: a ``launcher`` that forks them,
    a ``shell`` that the next command takes (also where no launcher was built at install),
    or nothing (``off``)."""
    spare: Literal["ready", "pending", "off"]
    """The sandbox the daemon keeps made ahead for the next ``create()`` that asks for
    the defaults (``sandboxkit/daemon/spare.py``): ``ready``, ``pending`` (made once the
    daemon is quiet), or ``off`` (``--spare off``, or no launcher to keep up in it)."""
    root: str
    """The daemon's directory of working directories."""
    root_missing: bool
    """True if the root was removed from outside the daemon: it can create nothing more."""
    next_event: int
    """The sequence number of the next event: where a reader of ``/events`` starts."""


class KilledProcess(ProcessInfo, frozen=True, kw_only=True):
    killed: bool


class StdinAck(Struct):
    session: str
    acked: int
    next_seq: int
    duplicate: bool
    ended: bool = False


class ConsumerRow(Struct):
    """One consumer. ``state``: ``streaming`` (keeping up), ``blocked`` (the peer takes no
    more bytes: its own send is stuck, or the peer's receive window stays full),
    ``starved`` (output waits for it, yet it is not sending: held back by someone else,
    e.g. the lab's shared loop), ``kicked``/``closed``
    (final: ``lag_bytes`` and ``head`` are frozen at that moment). ``role`` is the client's
    label (default ``sdk``); ``ghost`` marks a pause-snapshot ghost."""

    consumer_id: str
    name: str
    role: str
    sandbox_id: str
    pid: int
    peer: str | None
    ghost: bool
    cursor: int
    head: int
    lag_bytes: int
    bytes_sent: int
    frames_sent: int
    state: ConsumerState
    blocked_since: float | None
    starved_since: float | None
    last_send: float | None
    attached_at: float
    closed_at: float | None
    close_reason: str | None


class EventRow(Struct):
    seq: int
    ts: float
    kind: str
    sandbox_id: str | None
    pid: int | None
    reason: str | None
    data: dict[str, Any]


RESPONSE_MODELS: tuple[type[Any], ...] = (
    Health,
    SandboxInfo,
    ProcessInfo,
    KilledProcess,
    StdinAck,
    ConsumerRow,
    EventRow,
)

SENT_IN_FULL: tuple[type[Struct], ...] = (SandboxInfo, ProcessInfo, KilledProcess, ProcessSpecInfo)
"""Responses the daemon always sends every field of. The shared structs give some fields
defaults, for describers that cannot know them (the E2B provider); the daemon's own
document says they are all there."""


def require_sent_fields(components: dict[str, Any]) -> None:
    """Mark every field of :data:`SENT_IN_FULL` required (and without a default) in the
    OpenAPI ``components`` that ``msgspec.json.schema_components`` generated."""
    for model in SENT_IN_FULL:
        schema = components.get(model.__name__)
        if schema is None:
            continue
        properties: dict[str, Any] = schema.get("properties", {})
        schema["required"] = list(properties)
        for name, prop in properties.items():
            properties[name] = {k: v for k, v in prop.items() if k != "default"}


ERROR_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["code", "message", "details"],
    "properties": {
        "code": {"type": "string", "enum": sorted(DAEMON_ERROR_TABLE)},
        "message": {"type": "string"},
        "details": {"type": "object"},
    },
}

# -- decoding ------------------------------------------------------------------------------

T = TypeVar("T", bound=Struct)

_decoders: dict[type[Any], msgspec.json.Decoder[Any]] = {}
_AT = re.compile(r"`\$\.([A-Za-z_][A-Za-z0-9_.]*)")
_NAMED = re.compile(r"field `([^`]*)`")


def _field_of(message: str) -> str | None:
    found = _AT.search(message) or _NAMED.search(message)
    return found.group(1) if found else None


def _invalid(exc: msgspec.ValidationError) -> InvalidArgument:
    message = str(exc)
    return InvalidArgument(message, field=_field_of(message))


def decode_body(raw: bytes, model: type[T]) -> T:
    """The request body as ``model``; MalformedFrame if it is not a JSON object,
    InvalidArgument (naming the field) for anything the model refuses."""
    if not raw.strip():
        raw = b"{}"
    decoder = _decoders.get(model)
    if decoder is None:
        decoder = _decoders[model] = msgspec.json.Decoder(model)
    try:
        result: T = decoder.decode(raw)
        return result
    except msgspec.ValidationError as exc:
        message = str(exc)
        if message.startswith("Expected `object`, got") and "`$." not in message:
            raise MalformedFrame("request body must be a JSON object") from None
        raise _invalid(exc) from None
    except msgspec.DecodeError as exc:
        raise _not_json(raw, str(exc), model) from None


def _not_json(raw: bytes, reason: str, model: type[Struct]) -> Exception:
    """Bytes msgspec refuses as JSON: NaN, Infinity and lone surrogates (which Python's
    own parser takes, and which cannot be served back) are bad values of a named field;
    anything else is not JSON at all."""
    bad: list[str] = []

    def constant(name: str) -> float:
        bad.append(name)
        return math.nan

    try:
        value = json.loads(raw, parse_constant=constant)
    except (ValueError, RecursionError):
        return MalformedFrame(f"request body is not JSON: {reason}")
    if not isinstance(value, dict):
        return MalformedFrame("request body must be a JSON object")
    field = _unservable_field(value, model)
    what = f"{bad[0]} is not a number JSON can carry" if bad else "a lone surrogate"
    return InvalidArgument(f"{field or 'the body'}: {what}", field=field)


def _unservable_field(value: dict[str, Any], model: type[Struct]) -> str | None:
    """The first field of ``model`` holding an unservable value, as msgspec names it: a
    dotted path into a nested model (``lab.kick_grace``)."""
    nested = _nested_models(model)
    for key, item in value.items():
        if not _unservable(item):
            continue
        inner_model = nested.get(key)
        if inner_model is not None and isinstance(item, dict):
            inner = _unservable_field(item, inner_model)
            return f"{key}.{inner}" if inner else key
        return key
    return None


def _nested_models(model: type[Struct]) -> dict[str, type[Struct]]:
    """``model``'s fields whose value is itself a model (possibly optional)."""
    info = msgspec.inspect.type_info(model)
    found: dict[str, type[Struct]] = {}
    for field in getattr(info, "fields", ()):
        kind = field.type
        for option in kind.types if isinstance(kind, msgspec.inspect.UnionType) else (kind,):
            if isinstance(option, msgspec.inspect.StructType):
                found[field.encode_name] = option.cls
    return found


def _unservable(value: Any, depth: int = 0) -> bool:
    if depth > 64:
        return True
    if isinstance(value, float):
        return not math.isfinite(value)
    if isinstance(value, str):
        return _has_surrogate(value)
    if isinstance(value, dict):
        return any(_unservable(k, depth + 1) or _unservable(v, depth + 1) for k, v in value.items())
    if isinstance(value, list):
        return any(_unservable(v, depth + 1) for v in value)
    return False


def _has_surrogate(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


def decode_query(params: dict[str, str], model: type[T]) -> T:
    """Query parameters as ``model`` (strings converted to the declared types)."""
    try:
        return msgspec.convert(params, model, strict=False)
    except msgspec.ValidationError as exc:
        raise _invalid(exc) from None


# -- encoding ------------------------------------------------------------------------------

_encoder = msgspec.json.Encoder()
_SURROGATE = re.compile("[\ud800-\udfff]")


def encode_json(data: Any) -> bytes:
    """JSON for a response: never fails. Non-finite floats become ``null`` (msgspec) and
    strings that are not valid Unicode are repaired rather than refusing to answer."""
    try:
        return _encoder.encode(data)
    except (UnicodeEncodeError, TypeError, ValueError, OverflowError):
        return _encoder.encode(_repair(data))


def _repair(value: Any) -> Any:
    if isinstance(value, str):
        return _SURROGATE.sub("\ufffd", value)
    if isinstance(value, dict):
        return {str(_repair(k)): _repair(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_repair(v) for v in value]
    if value is None or isinstance(value, (bool, int, float)):
        return value
    return _repair(repr(value))
