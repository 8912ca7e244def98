"""A sandbox's resource limits, shared by the client and the daemon.

``Sandbox.create(limits={"memory": "256M", "pids": 128, "cpu": 0.5, "open_files": 1024,
"disk": "1G"})`` — or a :class:`Limits` — is sent as the ``limits`` object of
``POST /sandboxes``; the daemon validates it with this same model and enforces what the
host allows (``sandboxkit/daemon/limits.py``: cgroups where it may write them, rlimits
otherwise), and reports in ``get_info().limits_enforced`` how each one holds.

Bottom of the package (it imports only msgspec), like :mod:`sandboxkit.lab_options`.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Final

import msgspec
from msgspec import Meta, Struct

from sandboxkit.errors import InvalidArgument

__all__ = ["LIMIT_NAMES", "Limits", "parse_size", "to_limits"]

LIMIT_NAMES: Final = ("memory", "pids", "cpu", "open_files", "disk")

_UNITS: Final = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
_SIZE = re.compile(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(?:I?B)?\s*", re.IGNORECASE)

Size = Annotated[int, Meta(ge=1 << 20, le=1 << 50)] | Annotated[str, Meta(max_length=32)]


def parse_size(value: int | str, name: str = "size") -> int:
    """Bytes from ``value``: an int, or a string like ``"64M"``, ``"1.5G"``, ``"512KiB"``
    (powers of 1024). ValueError with the name of the limit for anything else."""
    if isinstance(value, bool):
        raise ValueError(f"{name} must be a size in bytes or a string like '64M'")
    if isinstance(value, int):
        return value
    match = _SIZE.fullmatch(value)
    if match is None:
        raise ValueError(f"{name} {value!r} is not a size (bytes, or like '64M', '1G')")
    return int(float(match.group(1)) * _UNITS[match.group(2).upper()])


class Limits(Struct, forbid_unknown_fields=True, omit_defaults=True):
    """What one sandbox may use; ``None`` (the default) leaves a resource unlimited.

    ``memory``: bytes of RAM for all its processes together (past it: an OOM kill,
    reason ``oom``). ``pids``: processes and threads at once (past it, ``fork`` fails).
    ``cpu``: cores' worth of CPU time (``0.5``: half a core). ``open_files``: files each
    process may hold open. ``disk``: bytes it may write (``/tmp``, and each file).
    Sizes are bytes, or strings like ``"64M"``."""

    memory: Size | None = None
    pids: Annotated[int, Meta(ge=8, le=1 << 22)] | None = None
    cpu: Annotated[float, Meta(gt=0.0, le=1024.0)] | None = None
    open_files: Annotated[int, Meta(ge=16, le=1 << 20)] | None = None
    disk: Size | None = None

    def __post_init__(self) -> None:
        # Normalised to bytes here, so both sides see one form; msgspec turns the
        # ValueError into a validation error naming the field.
        for name in ("memory", "disk"):
            value = getattr(self, name)
            if value is not None:
                size = parse_size(value, name)
                if not (1 << 20) <= size <= (1 << 50):
                    raise ValueError(f"{name} must be between 1 MiB and 1 PiB, not {size} bytes")
                setattr(self, name, size)

    def given(self) -> dict[str, int | float]:
        """The limits that are set, by name."""
        return {n: v for n in LIMIT_NAMES if (v := getattr(self, n)) is not None}


def to_limits(value: Limits | dict[str, Any] | None) -> Limits | None:
    """A :class:`Limits` from a dict (validated here, with the daemon's rules) or one;
    InvalidArgument (``field="limits"``) for anything else."""
    if value is None or isinstance(value, Limits):
        return value
    try:
        return msgspec.convert(value, Limits)
    except msgspec.ValidationError as exc:
        raise InvalidArgument(f"limits: {exc}", field="limits") from None
