"""Builds the per-sandbox launcher (``sandboxkit/daemon/launcher.c``, see
``sandboxkit/daemon/launcher.py``) at install, with the system's C compiler.

Without a compiler, or if the build fails, sandboxkit installs all the same: each sandbox
then keeps a shell started ahead instead (``sandboxkit/daemon/standby.py``), and
``sandboxkit status`` says so (its ``commands:`` line; ``launcher`` in ``/health``)."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
from typing import Any

from hatchling.builders.hooks.plugin.interface import BuildHookInterface

SOURCE = os.path.join("sandboxkit", "daemon", "launcher.c")
PROGRAM = os.path.join("sandboxkit", "daemon", "sandboxkit-launcher")


def build(root: str) -> str | None:
    """Compile the launcher in the checkout at ``root``; its path, or None (a warning on
    stderr says why)."""
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None or not sys.platform.startswith("linux"):
        print(
            "sandboxkit: no C compiler: no launcher (each sandbox keeps a shell started ahead)",
            file=sys.stderr,
        )
        return None
    out = os.path.join(root, PROGRAM)
    partial = out + ".partial"
    try:
        subprocess.run(
            [compiler, "-O2", "-Wall", "-s", "-o", partial, os.path.join(root, SOURCE)],
            check=True,
            timeout=120,
        )
        os.replace(partial, out)
    except (OSError, subprocess.SubprocessError) as exc:
        print(
            f"sandboxkit: the launcher did not build ({exc}): each sandbox keeps a shell "
            "started ahead",
            file=sys.stderr,
        )
        with contextlib.suppress(OSError):
            os.unlink(partial)  # what a compiler that failed half-way left
        return None
    return out


class CustomBuildHook(BuildHookInterface):  # type: ignore[misc]
    def initialize(self, version: str, build_data: dict[str, Any]) -> None:
        program = build(self.root)
        if program is None or version == "editable":
            return  # an editable install finds it in the checkout
        build_data["force_include"][program] = PROGRAM
        build_data["pure_python"] = False
        build_data["infer_tag"] = True
