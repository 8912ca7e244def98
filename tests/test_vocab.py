"""The shared vocabulary (sandboxkit/vocab.py) is defined once: no other module of the
package defines an info model, lists the consumer states, gives them colours, sets a
blocked/starved threshold, a default sandbox timeout or envd's port; the browser gets the
state colours from the kernel; and the client decodes the daemon's answers with the very
structs the daemon's API is described by."""

from __future__ import annotations

import ast
import re
from pathlib import Path
from typing import Any, get_args

import msgspec

from sandboxkit import vocab
from sandboxkit.client import results as client_results
from sandboxkit.daemon import schema
from sandboxkit.notebook.charts import STATE_COLORS, ChartWidget

PACKAGE = Path(vocab.__file__).parent
VOCAB = Path(vocab.__file__)

CONSUMER_STATES = set(get_args(vocab.ConsumerState))
VALUE_SETS = {
    name: frozenset(get_args(getattr(vocab, name)))
    for name in (
        "SandboxState",
        "ProcessState",
        "ConsumerState",
        "OnTimeout",
        "LogStorage",
        "LimitEnforcement",
    )
}
"""The vocabulary's sets of values: none is written out again elsewhere."""
INFO_CLASSES = {"ProcessInfo", "SandboxInfo", "ProcessSpecInfo"}
CONSTANTS = {
    "BLOCKED_AFTER",
    "STARVED_AFTER",
    "_STARVED_AFTER",
    "STATE_COLORS",
    "CONSUMER_STATES",
    "ConsumerState",
    "DEFAULT_ROLE",
    "DEFAULT_TIMEOUT",
    "DEFAULT_SANDBOX_TIMEOUT",
    "ENVD_PORT",
    "ROLE_PATTERN",
    "_ROLE_TEXT",
    "ROLE_TEXT",
    "PANEL_ROLE",
    "GHOST_ROLE",
    "ENVD_ROLE",
}
"""Names only vocab.py assigns (others import them)."""


def _modules() -> list[Path]:
    return sorted(p for p in PACKAGE.rglob("*.py") if p != VOCAB)


def _docstrings(tree: ast.Module) -> set[int]:
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            # A string statement: a docstring, or an attribute's docstring after it.
            for stmt in body:
                if isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Constant):
                    found.add(id(stmt.value))
    return found


def _name(node: ast.AST) -> str | None:
    return getattr(node, "id", None) or getattr(node, "attr", None)


def _const(node: ast.AST | None) -> Any:
    return node.value if isinstance(node, ast.Constant) else None


def _is_str(node: ast.AST | None) -> bool:
    return isinstance(_const(node), str)


def _strings(node: ast.AST) -> list[Any]:
    return [e.value for e in getattr(node, "elts", []) if isinstance(e, ast.Constant)]


def redefinitions(path: Path, source: str) -> list[str]:
    """What ``source`` defines that is the vocabulary's to define."""
    tree = ast.parse(source)
    docs = _docstrings(tree)
    where = path.relative_to(PACKAGE.parent) if path.is_absolute() else path
    found: list[str] = []
    for node in ast.walk(tree):
        line = f"{where}:{getattr(node, 'lineno', '?')}"
        if isinstance(node, ast.ClassDef) and node.name in INFO_CLASSES:
            found.append(f"{line}: class {node.name}")
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for target in targets:
                name = getattr(target, "id", None)
                value = node.value
                aliased = isinstance(value, (ast.Name, ast.Attribute))
                if name in CONSTANTS and not aliased:
                    found.append(f"{line}: {name} =")
                elif name and name.lower().endswith("role") and _is_str(value):
                    found.append(f"{line}: {name} = {_const(value)!r}")
        elif isinstance(node, ast.keyword) and node.arg == "role" and _is_str(node.value):
            found.append(f"{line}: role={_const(node.value)!r}")
        elif isinstance(node, ast.BoolOp) and any(
            "role" in (_name(v) or "").lower() for v in node.values
        ):
            found.extend(f"{line}: a default role {_const(v)!r}" for v in node.values if _is_str(v))
        elif isinstance(node, ast.JoinedStr) and any(
            re.search(r"[?&]role=[a-z0-9_-]", str(_const(v))) for v in node.values
        ):
            found.append(f"{line}: a role in a query string")
        elif isinstance(node, ast.Constant) and id(node) not in docs:
            value = node.value
            if value == vocab.ENVD_PORT or (isinstance(value, str) and "49983" in value):
                found.append(f"{line}: envd's port {value!r}")
        elif isinstance(node, (ast.Tuple, ast.List, ast.Set)):
            # Two or more consumer states written out together: a list of states (a
            # ``Literal[...]`` of them too, whose subscript is such a tuple).
            strings = {s for s in _strings(node) if isinstance(s, str)}
            states = CONSUMER_STATES & strings
            if len(states) >= 2:
                found.append(f"{line}: consumer states {sorted(states)}")
        elif isinstance(node, ast.Subscript) and _name(node.value) == "Literal":
            strings = {s for s in _strings(node.slice) if isinstance(s, str)}
            for name, values in VALUE_SETS.items():
                if strings == values and name != "ConsumerState":
                    found.append(f"{line}: Literal of {name}'s values {sorted(values)}")
        elif isinstance(node, ast.Dict):
            keys = [k.value for k in node.keys if isinstance(k, ast.Constant)]
            states = CONSUMER_STATES.intersection(k for k in keys if isinstance(k, str))
            if len(states) >= 2:
                found.append(f"{line}: a table of consumer states {sorted(states)}")
    return found


def test_the_scan_finds_each_kind_of_redefinition() -> None:
    # The scan itself: each thing it looks for, written the way the package once had it.
    source = '''
"""A docstring may say envd listens on 49983."""
from typing import Literal
ConsumerState = Literal["streaming", "blocked", "starved", "kicked", "closed"]
STATE_COLORS = {"streaming": "#2ca02c", "starved": "#e6ab02"}
_STARVED_AFTER = 1.0
DEFAULT_PORT = 49983
URL = "http://localhost:49983"
class ProcessInfo: ...
def f(state):
    return state in ("closed", "kicked")
OnTimeout = Literal["pause", "kill"]
class Panel:
    role = "panel"
def attach(options, name, sid):
    follow(role="sdk")
    who = options.role or "sdk"
    return f"/sandboxes/{sid}/stream?name={name}&role=ghost"
'''
    found = redefinitions(Path("example.py"), source)
    lines = {int(hit.split(":")[1]) for hit in found}
    # All but the docstring (2) and the import; the roles (14, 16, 17, 18) too.
    assert lines == {4, 5, 6, 7, 8, 9, 11, 12, 14, 16, 17, 18}, found
    # An import, or a name bound to the vocabulary's, is not a definition.
    fine = "from sandboxkit.vocab import STARVED_AFTER\nDEFAULT_PORT = ENVD_PORT\n"
    assert redefinitions(Path("fine.py"), fine) == []


def test_no_module_defines_the_vocabulary_again() -> None:
    found = [hit for path in _modules() for hit in redefinitions(path, path.read_text("utf-8"))]
    assert not found, "defined outside sandboxkit/vocab.py:\n" + "\n".join(found)


def test_the_browser_gets_the_state_colours_from_the_kernel() -> None:
    js = (PACKAGE / "notebook" / "charts.js").read_text("utf-8").lower()
    assert not [c for c in vocab.STATE_COLORS.values() if c.lower() in js]
    assert "state_colors" in js and "final_states" in js
    assert not [s for s in sorted(vocab.FINAL_CONSUMER_STATES) if f'!== "{s}"' in js]
    traits = ChartWidget.class_traits()
    assert traits["final_states"].make_dynamic_default() == sorted(vocab.FINAL_CONSUMER_STATES)
    assert ChartWidget.class_traits()["state_colors"].make_dynamic_default() == vocab.STATE_COLORS
    assert STATE_COLORS is vocab.STATE_COLORS
    # The OpenAPI document's consumer states are the vocabulary's.
    assert set(vocab.CONSUMER_STATES) == CONSUMER_STATES == set(vocab.STATE_COLORS)


def test_the_client_decodes_with_the_daemons_structs() -> None:
    assert client_results.ProcessInfo is schema.ProcessInfo is vocab.ProcessInfo
    assert client_results.SandboxInfo is schema.SandboxInfo is vocab.SandboxInfo
    assert issubclass(schema.KilledProcess, vocab.ProcessInfo)
    # What the daemon sends for a process: the client's flat attributes read its spec.
    wire = {
        "pid": 7,
        "sandbox_id": "sbx-1",
        "spec": {
            "cmd": "ls",
            "argv": None,
            "cwd": None,
            "envs": {},
            "pty": False,
            "timeout": 2.5,
            "tag": "t",
        },
        "state": "exited",
        "exit_code": 0,
        "started_at": 1.0,
        "ended_at": 2.0,
        "kill_reason": None,
        "restarted_from": None,
        "restarted_to": None,
        "head": 3,
        "first_seq": 0,
        "total_bytes": 3,
        "evicted_bytes": 0,
        "log_storage": "disk",
        "log_retention_bytes": 1024,
        "log_error": None,
        "consumers": 0,
        "stdin_buffered": 0,
        "stdin_limit": 10,
        "stdin_sessions": 0,
        "killed": True,  # a field of another model: kept in raw, not refused
    }
    info = vocab.ProcessInfo.from_json(wire)
    assert (info.cmd, info.timeout, info.tag, info.head) == ("ls", 2.5, "t", 3)
    assert info.raw is wire
    assert msgspec.to_builtins(info) == {k: v for k, v in wire.items() if k != "killed"}
    bad = {**wire, "state": "sleeping"}
    try:
        vocab.ProcessInfo.from_json(bad)
    except msgspec.ValidationError as exc:
        assert "state" in str(exc)
    else:
        raise AssertionError("a state the vocabulary lacks was taken")
