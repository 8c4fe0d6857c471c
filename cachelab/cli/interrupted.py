"""Ctrl-C in a verb: one line saying what its output holds (or that it wrote nothing), exit 130.

Typer turns a KeyboardInterrupt into exit status 130 saying nothing, so whether ``--out`` held a
cut file, the one before or the new one was left to guess (outputs are written under a temporary
name and renamed whole: the rename is the one moment the answer changes).
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Callable, Iterator
from pathlib import Path

import typer


def file_identity(path: Path) -> tuple[int, int] | None:
    """What tells one file at ``path`` from the next written there (a rename brings a new inode); None: no file."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_ino, st.st_mtime_ns


@contextlib.contextmanager
def interrupted(what: str, out: Path | None = None, thing: str = "file", partial: str = "file was",
                identity: Callable[[Path], object | None] = file_identity) -> Iterator[None]:
    """Turn Ctrl-C in the block into ``<what> interrupted: <what out holds>`` on standard error and
    exit status 130. ``out``: what the block writes (None: nothing), a ``thing`` told from the one
    before by ``identity`` (None: none there); ``partial``: what the writer removes when cut short."""
    before = identity(out) if out is not None else None
    try:
        yield
    except KeyboardInterrupt:
        after = identity(out) if out is not None else None
        if out is None:
            kept = "nothing was written"
        elif after is not None and after != before:  # held back while it was swapped in
            kept = f"{out} holds the new {thing}, whole (the interrupt came as it finished)"
        elif before is not None:
            kept = f"{out} keeps its previous {thing}, whole; the partial {partial} removed"
        else:
            kept = f"{out} holds no {thing}; the partial {partial} removed"
        typer.echo(f"{what} interrupted: {kept}", err=True)
        raise typer.Exit(130) from None


def interruptible(what: str) -> Callable[[Callable], Callable]:
    """A verb that writes no file (its result is printed once it has one) run whole in
    ``interrupted(what)``: Ctrl-C anywhere in it says ``<what> interrupted: nothing was written``."""

    def wrap(verb: Callable) -> Callable:
        @functools.wraps(verb)  # Typer reads the options from the verb's own signature
        def run(*args, **kwargs):
            with interrupted(what):
                return verb(*args, **kwargs)

        return run

    return wrap
