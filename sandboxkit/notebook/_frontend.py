"""The widgets' front-end modules: each widget's own ``.js`` file plus the vendored libraries.

An anywidget's ``_esm`` is evaluated by the front end (JupyterLab 4, Notebook 7, VS Code)
from a string, so it cannot import a file beside it. The vendored ES modules (copied from
npm by ``scripts/vendor-frontend.sh`` into ``static/``, see ``static/VERSIONS.md``) are
therefore inlined as string constants ahead of the widget's module; the widget calls
``vendor(name)``, which imports one through a ``blob:`` URL once per page (cached on
``globalThis``), so a page with ten panels evaluates xterm.js once. Nothing is fetched from
the network: ``pip install`` works offline and on Binder.
"""

from __future__ import annotations

import functools
import json
import zlib
from pathlib import Path

__all__ = ["STATIC", "css", "esm"]

HERE = Path(__file__).parent
STATIC = HERE / "static"

_VENDOR_FILES = {
    "xterm": "xterm.mjs",
    "addon-fit": "addon-fit.mjs",
    "addon-unicode11": "addon-unicode11.mjs",
    "uplot": "uplot.mjs",
}

_LOADER = """
const __cache = (globalThis.__sandboxkitVendor ??= new Map());
function vendor(name) {
  const key = name + "@" + __VENDOR_VERSION;
  if (!__cache.has(key)) {
    const url = URL.createObjectURL(new Blob([__VENDOR[name]], { type: "text/javascript" }));
    __cache.set(key, import(/* webpackIgnore: true */ url));
  }
  return __cache.get(key);
}
"""


@functools.cache
def esm(module: str, *libraries: str) -> str:
    """The ``_esm`` of a widget: ``libraries`` (vendored names) inlined, then ``module``
    (a ``.js`` file beside the widget's Python module)."""
    sources = {name: (STATIC / _VENDOR_FILES[name]).read_text("utf-8") for name in libraries}
    version = (STATIC / "VERSIONS.md").read_text("utf-8")
    prelude = (
        f"const __VENDOR = {json.dumps(sources)};\n"
        f"const __VENDOR_VERSION = {json.dumps(str(zlib.crc32(version.encode())))};\n"
        f"{_LOADER}\n"
    )
    return prelude + (HERE / module).read_text("utf-8")


@functools.cache
def css(*files: str) -> str:
    """The ``_css`` of a widget: vendored stylesheets (in ``static/``) and its own ``.css``
    files (beside it), concatenated."""
    parts = []
    for name in files:
        path = STATIC / name if (STATIC / name).exists() else HERE / name
        parts.append(path.read_text("utf-8"))
    return "\n".join(parts)
