"""Progress bars and spinners on standard error, drawn only where it is a terminal.

Long work shows that it is moving under ``--json`` too: standard output stays the one JSON
object (or a pipe's data), and where standard error is a file or a pipe a transient display
draws nothing at all, so scripts and logs see no bars.

Where Rich would find no terminal (standard error is none, and no variable that Rich reads says
otherwise), a transient display is a stand-in that keeps its tasks and draws nothing, and Rich
is not imported: its import took 0.05-0.07 s of CPU of a ``cachelab simulate --json`` whose
bars were never drawn (docs/engine.md).
"""

from __future__ import annotations

import os
import sys

# Variables with which Rich takes a stream for a terminal or not, whatever it is (rich.console)
_RICH_TERMINAL_VARIABLES = ("FORCE_TERMINAL", "FORCE_COLOR", "TTY_COMPATIBLE", "TTY_INTERACTIVE")


def _no_terminal() -> bool:
    """Whether Rich would surely find standard error no terminal, so draw nothing there."""
    if any(name in os.environ for name in _RICH_TERMINAL_VARIABLES):
        return False
    try:
        return not sys.stderr.isatty()
    except (AttributeError, ValueError):  # no stderr, or a closed one: Rich asks Rich
        return False


class _Undrawn:
    """What a display off a terminal does: tasks added, advanced and updated, nothing drawn."""

    def __init__(self):
        self.tasks = 0
        self._console = None

    @property
    def console(self):
        """Rich's console on standard error, for lines printed beside the display (a log keeps them)."""
        if self._console is None:
            from rich.console import Console

            self._console = Console(stderr=True)
        return self._console

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def add_task(self, description, *args, **kwargs) -> int:
        self.tasks += 1
        return self.tasks - 1

    def advance(self, *args, **kwargs) -> None:
        pass

    update = remove_task = advance


def progress_bar(*columns, enabled: bool = True, transient: bool = True):
    """A rich ``Progress`` on standard error (its default columns where none are given). A
    transient one off a terminal is off altogether: rich would still end it with a blank line."""
    if (not enabled or transient) and _no_terminal():
        return _Undrawn()
    from rich.console import Console
    from rich.progress import Progress

    console = Console(stderr=True)
    return Progress(*columns, console=console, transient=transient,
                    disable=not enabled or (transient and not console.is_terminal))


def spinner(message: str):
    """A transient spinner with ``message`` on standard error (a context manager)."""
    if _no_terminal():
        return _Undrawn()
    from rich.console import Console

    return Console(stderr=True).status(message)
