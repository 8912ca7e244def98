"""The widgets' front end is vendored: the pinned npm versions of
``scripts/vendor-frontend.sh`` are the ones in the package (``static/VERSIONS.md``), with
their licences, and a widget's ``_esm`` needs nothing from the network."""

from __future__ import annotations

import re
from pathlib import Path

from sandboxkit.notebook._frontend import STATIC, esm
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


def test_a_widgets_module_inlines_its_libraries_and_fetches_nothing() -> None:
    for module, widget, libs in (
        ("panel.js", TerminalWidget, ("xterm", "addon-fit", "addon-unicode11")),
        ("charts.js", ChartWidget, ("uplot",)),
    ):
        source = esm(module, *libs)
        assert widget._esm == source
        assert "export default { render }" in source
        for lib in libs:
            assert f'"{lib}":' in source, lib
        imports = re.findall(r"""\bimport\s*\(?\s*["'](\S+?)["']""", source)
        assert not [i for i in imports if "://" in i], imports
