"""How the suite runs itself: pyproject's addopts and ``tests/conftest.py``."""

from __future__ import annotations

import pytest


def test_under_xdist_a_modules_tests_are_one_group(request: pytest.FixtureRequest) -> None:
    """A module's tests run on one worker, beside its module-scoped daemons, and the
    browser tests all on one, beside one JupyterLab: xdist's groups, which it tells by a
    suffix on each test's id. Lost (pytest 9.2, or conftest's marks added after xdist
    looked), every worker starts a JupyterLab and each module's daemons of its own."""
    # On a worker, xdist says whether it groups as the option ``loadgroup``.
    if not getattr(request.config.option, "loadgroup", False):
        pytest.skip("not run by pytest-xdist's loadgroup (as with -n 0)")
    assert request.node.nodeid.endswith("@tests/test_suite.py"), request.node.nodeid
