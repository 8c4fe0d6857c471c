"""Option tables in ``--help`` that never cut a flag name or a default.

Rich sizes Typer's option table by shrinking its widest columns together, so at 80 columns a
long flag (``--dram-cache-capacity``) beside a ``--no-...`` column was cut to ``--dram-cache-capaci…``
and a long default to ``http://127.0.0.1:80…``. Here every column but the last (the help text)
keeps its full width, and the help text wraps, folding a word longer than its column instead of
cutting it. Typer builds its tables through ``typer.rich_utils.Table``, the one hook it offers.
"""

from __future__ import annotations

import typer.rich_utils
from rich.columns import Columns
from rich.table import Table
from rich.text import Text


class _UncutTable(Table):
    def add_row(self, *renderables, **kwargs):
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


def install() -> None:
    typer.rich_utils.Table = _UncutTable
