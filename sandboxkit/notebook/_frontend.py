"""The widgets' front end: each widget's own ``.js`` beside it, and the vendored libraries
sent once per kernel, not once per widget.

The libraries (xterm.js and its addons, uPlot: ES modules copied from npm by
``scripts/vendor-frontend.sh`` into ``static/``, see ``static/VERSIONS.md``) weigh ~430 KB.
anywidget evaluates a widget's ``_esm`` from the text of a synced trait, so a module cannot
import a file beside it, and a ``pathlib.Path`` given as ``_esm`` is only read into that
trait: every instance would still carry the text, in the kernel's messages and in the
widget state a notebook saves. So the libraries live in one :class:`FrontendLibraries`
model per kernel (its ``modules``, and the libraries' stylesheets as its ``_css``), and a
widget (:class:`VendoredWidget`) holds only a reference to it (``_libraries``, the
``IPY_MODEL_<id>`` of ipywidgets' ``widget_serialization``). The widget's ``_esm`` is its
own module after a small loader: ``vendor(model, name)`` finds that model through
anywidget's ``model.widget_manager.get_model`` and imports the library through a ``blob:``
URL once per page (cached on ``globalThis`` by name and version), so ten panels cost one
copy of xterm.js on the wire, one in a saved notebook and one evaluation in the browser.
That copy is gzipped (~120 KB instead of ~430 KB; ipywidgets sends bytes as binary
buffers, a saved notebook holds them in base64) and unzipped by the browser's
``DecompressionStream``. Nothing is fetched from the network: ``pip install`` works offline
and on Binder.
"""

from __future__ import annotations

import functools
import gzip
import json
import threading
import zlib
from pathlib import Path
from typing import Any

import anywidget
import ipywidgets as widgets  # type: ignore[import-untyped, unused-ignore]
import traitlets

__all__ = ["STATIC", "FrontendLibraries", "VendoredWidget", "esm", "libraries", "sources"]

HERE = Path(__file__).parent
STATIC = HERE / "static"

_VENDOR_FILES = {
    "xterm": "xterm.mjs",
    "addon-fit": "addon-fit.mjs",
    "addon-unicode11": "addon-unicode11.mjs",
    "uplot": "uplot.mjs",
}
_VENDOR_CSS = ("xterm.css", "uplot.css")

# Keys the page-wide cache: a kernel restarted on a newer sandboxkit (other libraries)
# in the same page imports its own copies.
VERSION = str(zlib.crc32((STATIC / "VERSIONS.md").read_bytes()))

_LOADER = """
const __VENDOR_VERSION = %s;
const __vendorCache = (globalThis.__sandboxkitVendor ??= new Map());
// A vendored library (sandboxkit/notebook/_frontend.py): its source is in the one
// FrontendLibraries model this widget references; imported once per page.
function vendor(model, name) {
  const key = name + "@" + __VENDOR_VERSION;
  let module = __vendorCache.get(key);
  if (!module) {
    module = (async () => {
      const ref = model.get("_libraries");
      const libraries = await model.widget_manager.get_model(ref.slice("IPY_MODEL_".length));
      const gzipped = libraries.get("modules")[name];
      if (!gzipped) throw new Error(`sandboxkit: no library ${name}`);
      const source = new Blob([gzipped]).stream().pipeThrough(new DecompressionStream("gzip"));
      const text = await new Response(source).arrayBuffer();
      const url = URL.createObjectURL(new Blob([text], { type: "text/javascript" }));
      try {
        return await import(/* webpackIgnore: true */ url);
      } finally {
        URL.revokeObjectURL(url);
      }
    })();
    module.catch(() => __vendorCache.delete(key)); // a later render tries again
    __vendorCache.set(key, module);
  }
  return module;
}
"""


class FrontendLibraries(anywidget.AnyWidget):
    """The vendored libraries, one model per kernel (see the module doc); never displayed.
    anywidget puts a model's ``_css`` on the page when the front end creates the model,
    shown or not, so the libraries' stylesheets arrive once with it."""

    _esm = "// read by the widgets (vendor()); nothing to render\nexport default {};\n"
    _css = "\n".join((STATIC / name).read_text("utf-8") for name in _VENDOR_CSS)
    modules = traitlets.Dict().tag(sync=True)
    """Library name → its ES module, gzipped (a ``DataView`` in the browser)."""


_lock = threading.Lock()
_shared: FrontendLibraries | None = None


def sources() -> dict[str, str]:
    """The vendored libraries' ES modules, by name."""
    return {name: (STATIC / file).read_text("utf-8") for name, file in _VENDOR_FILES.items()}


@functools.cache
def _gzipped() -> dict[str, bytes]:
    return {name: gzip.compress(text.encode(), mtime=0) for name, text in sources().items()}


def libraries() -> FrontendLibraries:
    """The kernel's one :class:`FrontendLibraries` model, opened on first use and again if
    it was closed (``Widget.close_all()``)."""
    global _shared
    with _lock:
        if _shared is None or _shared.comm is None:
            _shared = FrontendLibraries(modules=_gzipped())
        return _shared


class VendoredWidget(anywidget.AnyWidget):
    """An anywidget whose ``_esm`` (built by :func:`esm`) uses vendored libraries."""

    _libraries = traitlets.Instance(FrontendLibraries).tag(
        sync=True, **widgets.widget_serialization
    )

    @traitlets.default("_libraries")
    def _default_libraries(self) -> Any:
        # Read while the widget opens its comm: the libraries' model is opened first, so
        # the front end knows it before this widget's module asks for it.
        return libraries()


@functools.cache
def esm(module: str) -> str:
    """The ``_esm`` of a :class:`VendoredWidget`: the loader, then ``module`` (a ``.js``
    file beside the widget's Python module), which calls ``vendor(model, name)``."""
    return (_LOADER % json.dumps(VERSION)) + (HERE / module).read_text("utf-8")
