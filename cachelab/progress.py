"""Progress bars and spinners on standard error, drawn only where it is a terminal.

Long work shows that it is moving under ``--json`` too: standard output stays the one JSON
object (or a pipe's data), and where standard error is a file or a pipe a transient display
draws nothing at all, so scripts and logs see no bars.
"""

from __future__ import annotations

from rich.console import Console
from rich.progress import Progress


def progress_bar(*columns, enabled: bool = True, transient: bool = True) -> Progress:
    """A rich ``Progress`` on standard error (its default columns where none are given). A
    transient one off a terminal is off altogether: rich would still end it with a blank line."""
    console = Console(stderr=True)
    return Progress(*columns, console=console, transient=transient,
                    disable=not enabled or (transient and not console.is_terminal))


def spinner(message: str):
    """A transient spinner with ``message`` on standard error (a context manager)."""
    return Console(stderr=True).status(message)
