"""The ``cachelab`` command line: one Typer app, one module per verb group."""

from __future__ import annotations

import click
import typer
from typer.core import TyperGroup

from cachelab.errors import CachelabError


class _Group(TyperGroup):
    """Turns a CachelabError anywhere below into ``error: <message>`` and exit status 2 (a path
    that cannot be read or written too, named), and an exception raised inside a plug-in into
    an error naming the plug-in and the reason."""

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
        except (click.exceptions.ClickException, click.exceptions.Exit, click.exceptions.Abort):
            raise
        except Exception as exc:
            from cachelab import registry

            plugin = registry.blame(exc)
            if plugin is None:
                raise
            typer.echo(f"error: {plugin.run_failure(exc)}", err=True)
            raise typer.Exit(code=2) from None


app = typer.Typer(
    cls=_Group,
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    help="cachelab: where Engram rows should live, and which to cache. "
    "Start with `cachelab quickstart`; every verb has --help.",
)


def _register() -> None:
    from cachelab.cli import help_layout

    help_layout.install()
    from cachelab.cli import (bench, cache, calibrate, capture, engram, experiment, learn, live, plugins, quickstart,
                              serving, store, trace)

    app.add_typer(engram.app, name="engram")
    app.add_typer(trace.app, name="trace")
    app.add_typer(capture.app, name="capture")
    app.add_typer(plugins.plugins_app, name="plugins")
    app.add_typer(plugins.policies_app, name="policies")
    app.command("quickstart")(quickstart.quickstart)
    app.command("simulate")(cache.simulate)
    app.command("mrc")(cache.mrc)
    app.command("serve-sim", context_settings={"allow_extra_args": True})(serving.serve_sim)
    app.command("serve")(live.serve)
    app.command("pareto")(serving.pareto)
    app.add_typer(serving.hw_app, name="hw")
    app.add_typer(serving.study_app, name="study")
    app.command("train")(learn.train)
    app.command("evaluate")(learn.evaluate)
    app.command("run")(experiment.run)
    app.command("report")(experiment.report)
    app.command("sync")(experiment.sync)
    app.add_typer(store.app, name="store")
    app.add_typer(bench.app, name="bench")
    app.command("calibrate")(calibrate.calibrate)
    help_layout.flow_paragraphs(app)


_register()


def main() -> None:
    app()
