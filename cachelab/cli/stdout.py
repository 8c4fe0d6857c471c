"""Rich's console for a command's text on standard output, never cut to 80 columns when piped.

Rich takes a stream that is no terminal (a pipe, a file, ``| less``) for 80 columns, unless
COLUMNS says otherwise, so a script read cut names (``cachelab-plug…`` in ``plugins list``),
``pareto``'s configurations folded over three rows, and long lines broken in two. Piped with no
COLUMNS, the console is wider than anything printed: a table takes its own width, a line stays
one line. A terminal, or COLUMNS, still sets the width.
"""

from __future__ import annotations

import os

from rich.console import Console

UNCUT = 1 << 16  # columns: wider than any table or line a command prints


def stdout_console() -> Console:
    """The console a command prints its text and tables through."""
    console = Console()
    if not console.is_terminal and "COLUMNS" not in os.environ:
        return Console(width=UNCUT)
    return console
