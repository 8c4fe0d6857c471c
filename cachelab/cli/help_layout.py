"""``--help`` that reads at any width: option tables that never cut a flag name or a default
(a ``--no-...`` flag goes under its flag, leaving the help text the width),
and a verb's docstring shown in paragraphs, not in its source's line breaks.

Rich sizes Typer's option table by shrinking its widest columns together, so at 80 columns a
long flag (``--dram-cache-capacity``) beside a ``--no-...`` column was cut to ``--dram-cache-capaci…``
and a long default to ``http://127.0.0.1:80…``. Here every column but the last (the help text)
keeps its full width, and the help text wraps, folding a word longer than its column instead of
cutting it. Typer builds its tables through ``typer.rich_utils.Table``, the one hook it offers.

Typer's Rich markup mode prints a docstring's lines as written, so a docstring wrapped at 100
columns came out ragged at 80, and the verb list showed a first paragraph's every line break.
"""

from __future__ import annotations

import inspect
import re

import typer


def _uncut_table() -> type:
    """Rich's ``Table`` with uncut option rows (Rich imported here: a run that prints no help,
    ``simulate --json``, imports none of it; cachelab.progress)."""
    from rich.columns import Columns
    from rich.table import Table
    from rich.text import Text

    class _UncutTable(Table):
        def add_row(self, *renderables, **kwargs):
            renderables = _flags_in_one_cell(renderables)
            super().add_row(*renderables, **kwargs)
            *names, text = self.columns
            for column in names:
                column.no_wrap = True
                column.overflow = "fold"
            text.overflow = "fold"
            help_cell = renderables[-1] if renderables else None
            for item in help_cell.renderables if isinstance(help_cell, Columns) else [help_cell]:
                if isinstance(item, Text):
                    item.overflow = "fold"

    return _UncutTable


def _flags_in_one_cell(row: tuple) -> tuple:
    """An option row with its short flag beside the flag and its ``--no-...`` flag under it, not
    in columns of their own: those columns (``--no-prefix-caching``) left the help text of
    ``serve`` 14 columns wide at 80. Typer's option row is [required,] long, short, negative
    long, negative short, type, help."""
    from rich.text import Text

    if len(row) < 6 or not all(isinstance(cell, Text) for cell in row[-6:-2]):
        return row
    at = len(row) - 6
    flag, short, negative, negative_short = row[at:at + 4]
    lines = [Text(", ").join(c for c in pair if c.plain) for pair in ((flag, short), (negative, negative_short))]
    return (*row[:at], Text("\n").join(line for line in lines if line.plain), *row[at + 4:])


def install() -> None:
    import typer.rich_utils  # here: a run that prints no help does without it (cachelab.cli.main)

    typer.rich_utils.Table = _uncut_table()


def _flowed(doc: str) -> str:
    """``doc`` with each paragraph's lines joined; a list item (``- x``, ``1. x``) keeps its own line."""
    paragraphs = []
    for paragraph in inspect.cleandoc(doc).split("\n\n"):
        lines: list[str] = []
        for line in paragraph.splitlines():
            if lines and not re.match(r"\s*([-*]|\d+[.)])\s", line):
                lines[-1] += " " + line.strip()
            else:
                lines.append(line)
        paragraphs.append("\n".join(lines))
    return "\n\n".join(paragraphs)


def flow_paragraphs(app: typer.Typer) -> None:
    """Give every command of ``app`` and of its groups its docstring's paragraphs as its help."""
    for command in app.registered_commands:
        doc = command.help or (command.callback.__doc__ if command.callback else None)
        if doc:
            command.help = _flowed(doc)
    for group in app.registered_groups:
        flow_paragraphs(group.typer_instance)
