"""The ``cachelab`` command line: one Typer app, one module per verb group.

A run imports only the verb it was asked for (``main``): importing every verb's module (Polars,
Arrow, pydantic, the serving and learning stacks) took most of a second before ``simulate``
read its trace, as long as libCacheSim's whole replay of a 10 M-request Zipf trace. ``app``,
the whole command line (``--help``, tests), is built on first use.
"""

from __future__ import annotations

import errno
import gc
import importlib
import os

# NumPy advises the kernel to back every array of 4 MiB or more with transparent huge pages. Where
# THP defrag is "madvise" (many distributions' default), a fault in such an array compacts memory
# in the faulting thread: on this shared 2-core machine ``simulate`` of a 10 M-request trace spent
# 2.7-3.3 s of system time and 8.7-12.7 s of wall time, against 0.26 s and 3.2-3.4 s without the
# advice, the user time alike (docs/engine.md). A command line's process allocates its arrays
# once and exits, so it goes without the advice, unless the user asks for it (set before NumPy
# is imported, as NumPy reads it then; child processes inherit it).
os.environ.setdefault("NUMPY_MADVISE_HUGEPAGE", "0")

import typer
from typer.core import TyperCommand, TyperGroup

from cachelab.cli import plain_values
from cachelab.errors import CachelabError

NO_ROOM = {errno.ENOSPC, errno.EFBIG, errno.EDQUOT, errno.EROFS}  # an output the file system refuses
# click's errors as Typer raises them (Typer 0.2x carries its own copy of click; importing click
# itself for these took 0.01-0.02 s, and its classes are not the ones Typer 0.2x raises)
CLICK_ERROR = next(c for c in typer.BadParameter.__mro__ if c.__name__ == "ClickException")

# Every verb in the order ``--help`` lists them: name -> (module of cachelab.cli, attribute, kind).
# A "group" is a Typer app of sub-verbs; "extra" a command that passes unknown options on.
VERBS = {
    "engram": ("engram", "app", "group"),
    "trace": ("trace", "app", "group"),
    "capture": ("capture", "app", "group"),
    "plugins": ("plugins", "plugins_app", "group"),
    "policies": ("plugins", "policies_app", "group"),
    "quickstart": ("quickstart", "quickstart", "command"),
    "simulate": ("cache", "simulate", "command"),
    "mrc": ("cache", "mrc", "command"),
    "serve-sim": ("serving", "serve_sim", "extra"),
    "serve": ("live", "serve", "command"),
    "pareto": ("serving", "pareto", "command"),
    "hw": ("serving", "hw_app", "group"),
    "study": ("serving", "study_app", "group"),
    "train": ("learn", "train", "command"),
    "evaluate": ("learn", "evaluate", "command"),
    "run": ("experiment", "run", "command"),
    "report": ("experiment", "report", "command"),
    "sync": ("experiment", "sync", "command"),
    "store": ("store", "app", "group"),
    "bench": ("bench", "app", "group"),
    "calibrate": ("calibrate", "calibrate", "command"),
}


class _Group(TyperGroup):
    """Turns a CachelabError anywhere below into ``error: <message>`` and exit status 2 (a path
    that cannot be read or written too, named), and an exception raised inside a plug-in into
    an error naming the plug-in and the reason."""

    def parse_args(self, ctx, args):
        plain_values.install(self.get_params(ctx))
        return super().parse_args(ctx, args)

    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except CachelabError as exc:
            typer.echo(f"error: {exc}", err=True)
            raise typer.Exit(code=2) from None
        except (FileNotFoundError, PermissionError, IsADirectoryError, NotADirectoryError) as exc:
            # a path the user gave that cannot be read or written: named, not a traceback
            where = f"{exc.filename}: {exc.strerror}" if exc.filename else str(exc)
            typer.echo(f"error: {where}", err=True)
            raise typer.Exit(code=2) from None
        except (CLICK_ERROR, typer.Exit, typer.Abort):
            raise
        except Exception as exc:
            if isinstance(exc, OSError) and exc.errno in NO_ROOM:  # the disk's, not the code's: named, no traceback
                where = f"{exc.filename}: " if exc.filename else "a write failed: "
                typer.echo(f"error: {where}{os.strerror(exc.errno)}", err=True)
                raise typer.Exit(code=2) from None
            from cachelab import registry

            plugin = registry.blame(exc)
            if plugin is None:
                raise
            typer.echo(f"error: {plugin.run_failure(exc)}", err=True)
            raise typer.Exit(code=2) from None


class _Command(TyperCommand):
    """A verb whose plain options are converted without pydantic (``plain_values``)."""

    def parse_args(self, ctx, args):
        plain_values.install(self.get_params(ctx))
        return super().parse_args(ctx, args)


def _group() -> None:
    pass


def build(verbs=VERBS, help_tables: bool = True) -> typer.Typer:
    """The command line holding ``verbs`` (names of ``VERBS``), each verb's module imported;
    ``help_tables``: with ``help_layout``'s option tables (importing Typer's Rich help)."""
    from cachelab.cli import help_layout

    if help_tables:
        help_layout.install()
    built = typer.Typer(
        cls=_Group,
        no_args_is_help=True,
        add_completion=False,
        pretty_exceptions_enable=False,
        help="cachelab: where Engram rows should live, and which to cache. "
        "Start with `cachelab quickstart`; every verb has --help.",
    )
    built.callback()(_group)  # a group even when one verb is built (Typer runs a lone command as the app)
    for name in verbs:
        module, attr, kind = VERBS[name]
        target = getattr(importlib.import_module(f"cachelab.cli.{module}"), attr)
        if kind == "group":
            built.add_typer(target, name=name)
        else:
            built.command(name, cls=_Command,
                          context_settings={"allow_extra_args": True} if kind == "extra" else None)(target)
    help_layout.flow_paragraphs(built)
    return built


def __getattr__(name: str):
    if name == "app":  # the whole command line, built once
        globals()["app"] = build()
        return globals()["app"]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def main(args: list[str] | None = None) -> None:
    """Run the command line on ``args`` (default: the process's), importing only the verb named
    first (all of them for ``--help`` or a name that is no verb, so click can list or suggest),
    and Typer's Rich help (0.03 s) only where help may be printed.

    The imports run with Python's cyclic garbage collector paused, and what they leave is then
    frozen out of later collections: collecting during them found nothing to free and took
    0.1-0.2 s of a ``simulate`` run (three full passes over every object the imports made)."""
    import sys

    args = sys.argv[1:] if args is None else args
    gc.disable()
    try:
        verb = args[0] if args else None
        if verb in VERBS:  # a plain command prints help only for --help; a group without a sub-verb too
            command = build([verb], help_tables=VERBS[verb][2] == "group" or "--help" in args)
        else:
            command = build()
    except KeyboardInterrupt:  # Ctrl-C in the first seconds: a traceback of import frames
        print("interrupted while cachelab started: nothing was done", file=sys.stderr)
        raise SystemExit(130) from None
    finally:
        gc.freeze()
        gc.enable()
    command(args)
