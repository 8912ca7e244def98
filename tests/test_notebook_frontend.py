"""The widgets' front end is vendored: the pinned npm versions of
``scripts/vendor-frontend.sh`` are the ones in the package (``static/VERSIONS.md``), with
their licences, and a widget's ``_esm`` needs nothing from the network. The libraries
travel once per kernel, not once per widget: a notebook saved with ten panels and ten
charts stays small."""

from __future__ import annotations

import gzip
import json
import re
from pathlib import Path
from typing import Any

import comm
import pytest
from ipywidgets import embed

from sandboxkit.notebook._frontend import STATIC, FrontendLibraries, esm, libraries, sources
from sandboxkit.notebook.charts import ChartWidget
from sandboxkit.notebook.panel import TerminalWidget

REPO = Path(__file__).resolve().parents[1]
SCRIPT = (REPO / "scripts" / "vendor-frontend.sh").read_text()


def test_vendored_versions_are_the_pinned_ones_with_their_licences() -> None:
    pins = dict(re.findall(r'^(\w+)_VERSION="([\d.]+)"', SCRIPT, re.M))
    table = dict(
        re.findall(r"^\| (\S+) \| ([\d.]+) \| MIT \|", (STATIC / "VERSIONS.md").read_text(), re.M)
    )
    assert table == {
        "@xterm/xterm": pins["XTERM"],
        "@xterm/addon-fit": pins["XTERM_FIT"],
        "@xterm/addon-unicode11": pins["XTERM_UNICODE11"],
        "uplot": pins["UPLOT"],
    }
    for name in ("xterm", "addon-fit", "addon-unicode11", "uplot"):
        licence = (STATIC / f"LICENSE.{name}").read_text()
        assert "Permission is hereby granted, free of charge" in licence, name
    assert f"(v{pins['UPLOT']})" in (STATIC / "uplot.mjs").read_text()[:200]


def test_a_widgets_module_calls_for_its_libraries_and_nothing_is_fetched() -> None:
    libs_sources = sources()
    assert {k: gzip.decompress(v).decode() for k, v in libraries().modules.items()} == libs_sources
    for module, widget, libs in (
        ("panel.js", TerminalWidget, ("xterm", "addon-fit", "addon-unicode11")),
        ("charts.js", ChartWidget, ("uplot",)),
    ):
        source = esm(module)
        assert widget._esm == source
        assert "export default { render }" in source
        for lib in libs:
            assert f'vendor(model, "{lib}")' in source, lib
            assert libs_sources[lib][:300] not in source, lib  # referenced, not inlined
        for text in (source, *libs_sources.values()):
            imports = re.findall(r"""\bimport\s*\(?\s*["'](\S+?)["']""", text)
            assert not [i for i in imports if "://" in i], imports
    assert "xterm" in str(FrontendLibraries._css) and "uplot" in str(FrontendLibraries._css)


def test_the_libraries_model_opens_before_the_widget_that_references_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    libraries().close()  # as Widget.close_all() would: the next widget opens a new one
    opened: list[dict[str, Any]] = []
    real = comm.create_comm

    def create_comm(**kwargs: Any) -> Any:
        opened.append(kwargs["data"]["state"])
        return real(**kwargs)

    monkeypatch.setattr(comm, "create_comm", create_comm)
    view = TerminalWidget()
    names = [s["_anywidget_id"] for s in opened if "_anywidget_id" in s]
    assert names == [
        "sandboxkit.notebook._frontend.FrontendLibraries",
        "sandboxkit.notebook.panel.TerminalWidget",
    ]
    assert view.get_state()["_libraries"] == f"IPY_MODEL_{libraries().model_id}"
    assert ChartWidget()._libraries is libraries()  # one per kernel


# The bound docs/architecture.md states: the widget state a notebook saves (every model the
# widgets need, as JSON) for ten panels and ten charts. The libraries are there once
# (~170 KB, gzipped in base64); each widget adds its own module and a reference (~11 KB a
# panel, ~18 KB a chart): ~460 KB in all. With the libraries inlined per widget: ~4.8 MB.
SAVED_STATE_BOUND = 640_000
PER_WIDGET_BOUND = 24_000


def test_ten_panels_and_ten_charts_save_a_small_widget_state() -> None:
    def saved(*views: object) -> int:
        return len(json.dumps(embed.dependency_state(list(views), drop_defaults=False)))

    one = saved(TerminalWidget(), ChartWidget())
    views = [TerminalWidget() for _ in range(10)] + [ChartWidget() for _ in range(10)]
    total = saved(*views)
    assert total < SAVED_STATE_BOUND, total
    assert (total - one) / 18 < PER_WIDGET_BOUND, (total, one)
