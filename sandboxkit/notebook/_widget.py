"""The one small base of the notebook widgets: display, owned children, owned tasks, close.

A widget object here is plain Python that *owns* ipywidgets (its ``children``, shown as
``widget``) and tasks (through a :class:`~sandboxkit.notebook._runtime.Runtime`). Its state
lives in plain classes that tests drive without a browser; ``version`` counts changes the
widgets have to show. ``close()`` stops every task, runs the subclass's final teardown on
the sandbox loop and closes every child widget — idempotent, so a notebook may call it
twice, and a parent (the dashboard, the stall lab) closes its children by calling theirs.
"""

from __future__ import annotations

from collections.abc import Coroutine
from typing import Any

import ipywidgets as widgets  # type: ignore[import-untyped, unused-ignore]

from sandboxkit.notebook._runtime import AnySandbox, Runtime

__all__ = ["WidgetBase", "close_tree"]


class WidgetBase:
    """Display, owned widgets and tasks, and an idempotent close (see the module doc)."""

    widget: widgets.Widget

    def __init__(self, sbx: AnySandbox | None) -> None:
        self._rt = Runtime(sbx)
        self._children: list[Any] = []
        self._closed = False
        self.version = 0
        """Bumped on every change the widgets show."""

    def own(self, *children: Any) -> None:
        """Register ``children`` (ipywidgets, or objects with ``close()``) to close."""
        self._children.extend(children)

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def tasks(self) -> int:
        """Owned tasks still running (0 once closed)."""
        return self._rt.tasks

    def _final(self) -> Coroutine[Any, Any, Any] | None:
        """Teardown to run on the sandbox loop once the tasks are cancelled."""
        return None

    def _close_children(self) -> None:
        for child in reversed(self._children):
            child.close()

    def close(self) -> None:
        """Cancel every owned task, run the final teardown, close every child. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._rt.close(self._final())
        self._close_children()

    async def aclose(self) -> None:
        """:meth:`close`, awaiting every task and the final teardown."""
        if not self._closed:
            self._closed = True
            self._close_children()
            await self._rt.aclose(self._final())
        else:
            await self._rt.aclose()

    def _repr_mimebundle_(self, **kwargs: Any) -> Any:
        return self.widget._repr_mimebundle_(**kwargs)

    def _ipython_display_(self) -> None:
        from IPython.display import display

        display(self.widget)  # type: ignore[no-untyped-call, unused-ignore]


def close_tree(widget: Any) -> None:
    """Close ``widget`` and every widget under it (a box's children, recursively): after
    it, no comm of the tree is left open in the kernel."""
    for child in getattr(widget, "children", ()) or ():
        close_tree(child)
    widget.close()
