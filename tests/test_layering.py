"""Imports point down the layers only (docs/architecture.md): the daemon never imports the
client, the providers, the lab or the widgets; the client never imports the providers (the
provider layer sits above it and registers itself with the client's loader), the lab or
the widgets. Checked on the source — every ``import``, also inside a function or under
``TYPE_CHECKING`` — so an arrow pointing up fails here whether or not a test runs it."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import sandboxkit

PACKAGE = Path(sandboxkit.__file__).resolve().parent

# Layer → the packages (or modules) above it, which it must not import.
ABOVE = {
    "daemon": (
        "sandboxkit.client",
        "sandboxkit.providers",
        "sandboxkit.lab",
        "sandboxkit.notebook",
        "sandboxkit.cli",
        "sandboxkit.demo",
    ),
    "client": (
        "sandboxkit.providers",
        "sandboxkit.lab",
        "sandboxkit.notebook",
        "sandboxkit.cli",
        "sandboxkit.demo",
    ),
}


def imported_modules(source: str, package: str) -> set[str]:
    """Every module ``source`` (a module of ``package``) imports, by its dotted name."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: resolved against the module's own package
                parts = package.split(".")
                base = parts[: len(parts) - node.level + 1]
                module = ".".join([*base, *([node.module] if node.module else [])])
            else:
                module = node.module or ""
            names.add(module)
            # ``from sandboxkit import providers`` imports the submodule.
            names.update(f"{module}.{alias.name}" for alias in node.names)
    return names


def upward_imports(layer: str) -> list[str]:
    found = []
    for path in sorted((PACKAGE / layer).rglob("*.py")):
        package = ".".join(path.relative_to(PACKAGE.parent).parts[:-1])
        for name in sorted(imported_modules(path.read_text(), package)):
            if any(name == up or name.startswith(up + ".") for up in ABOVE[layer]):
                found.append(f"{path.relative_to(PACKAGE.parent)} imports {name}")
    return found


@pytest.mark.parametrize("layer", sorted(ABOVE))
def test_no_layer_imports_one_above_it(layer: str) -> None:
    assert upward_imports(layer) == []


def test_the_check_sees_an_upward_import() -> None:
    # The scanner itself: each spelling of an import of the provider layer is found.
    for line in (
        "from sandboxkit.providers import load",
        "import sandboxkit.providers.e2b",
        "from sandboxkit import providers",
        "def f():\n    from ..providers import base",
        "if TYPE_CHECKING:\n    from sandboxkit.providers.e2b import E2BSandbox",
    ):
        names = imported_modules(line + "\n", "sandboxkit.client")
        assert any(n.startswith("sandboxkit.providers") for n in names), line
    assert not any(
        n.startswith("sandboxkit.providers")
        for n in imported_modules("from sandboxkit.client import provider\n", "sandboxkit.client")
    )


def private_reach_ins(source: str) -> list[str]:
    """``x._name`` where ``x`` is not ``self`` or ``cls``: one object reaching into
    another's private members."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if (
            isinstance(node, ast.Attribute)
            and node.attr.startswith("_")
            and not node.attr.startswith("__")
            and not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"))
        ):
            found.append(f"line {node.lineno}: {ast.unparse(node)}")
    return found


def test_the_providers_reach_into_no_private_member() -> None:
    # The E2B package's modules share one owner object (providers/e2b/session.py) through
    # its public members; none reaches into another's (or the client's) private ones.
    found = [
        f"{path.relative_to(PACKAGE.parent)} {where}"
        for path in sorted((PACKAGE / "providers").rglob("*.py"))
        for where in private_reach_ins(path.read_text())
    ]
    assert found == []
    assert private_reach_ins("self._sandbox._e2b.files\n") == ["line 1: self._sandbox._e2b"]


MAX_LINES = 600
"""No module of the package is longer (issue 21): past it, a module holds more than one
concept, and a newcomer cannot read it in one sitting."""


def test_no_module_is_longer_than_600_lines() -> None:
    long = {
        str(path.relative_to(PACKAGE.parent)): n
        for path in sorted(PACKAGE.rglob("*.py"))
        if (n := len(path.read_text().splitlines())) > MAX_LINES
    }
    assert not long, f"split by concept: {long}"
