"""``cachelab plugins list``, ``cachelab policies list`` and ``cachelab policies check``: what the
entry points provide, and whether a policy keeps the contract.

Built-ins and third-party packages are listed alike, each with the distribution and version
it came from; a broken plug-in is listed with its reason instead of breaking the command.
``policies check`` runs the conformance kit (``cachelab.testing``) on one installed policy.
"""

from __future__ import annotations

import inspect

import typer
from rich.markup import escape
from rich.table import Column, Table

from cachelab import registry, strict_json
from cachelab.cli.stdout import stdout_console
from cachelab.params import check_params, parse_pairs

plugins_app = typer.Typer(no_args_is_help=True, help="Installed plug-ins of every cachelab entry-point group.")
policies_app = typer.Typer(no_args_is_help=True, help="Installed cache policies (built-in and plug-in).")


def _row(p: registry.Plugin) -> dict:
    return {"group": p.group, "name": p.name, "value": p.value, "distribution": p.distribution,
            "version": p.version, "status": "broken" if p.error else "ok", "error": p.error}


def _summary(obj) -> str:
    doc = inspect.getdoc(obj) or ""
    return doc.splitlines()[0] if doc else ""


def _defaults(cls) -> dict:
    params = inspect.signature(cls).parameters.values()
    return {p.name: (None if p.default is p.empty else p.default) for p in params
            if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)}


@plugins_app.command("list")
def plugins_list(as_json: bool = typer.Option(False, "--json", help="Print a JSON list.")) -> None:
    """Every entry point of cachelab.policies, cachelab.predictors, cachelab.workloads and
    cachelab.experiment_kinds, with its source distribution and version; broken ones with the reason."""
    rows = [_row(p) for group in registry.GROUPS for p in registry.discover(group)]
    if as_json:
        typer.echo(strict_json.dumps(rows))
        return
    table = Table("group", _name_column(rows), "from", "version", "status")
    for r in rows:
        status = "[green]ok[/]" if r["status"] == "ok" else f"[red]broken[/]: {escape(str(r['error']))}"
        table.add_row(r["group"].split(".")[-1], r["name"], r["distribution"], r["version"], status)
    stdout_console().print(table)


def _name_column(rows: list[dict]):
    """A name is typed back (--policy NAME): its column never wraps nor cuts; the others give way."""
    return Column("name", no_wrap=True, min_width=max((len(r["name"]) for r in rows), default=4))


@policies_app.command("list")
def policies_list(as_json: bool = typer.Option(False, "--json", help="Print a JSON list.")) -> None:
    """Every registered policy: origin, whether its run is compiled, what it needs
    (future accesses, predictor scores, each row's lookups per step, row ids before compaction), its
    hyper-parameters with defaults, and the label `evaluate --json` and reports key its figures by."""
    from cachelab.learning.lineup import label

    rows = []
    for p in registry.discover(registry.POLICIES):
        row = {k: v for k, v in _row(p).items() if k != "group"}
        if p.obj is not None:
            try:
                caps = p.obj.capabilities
                row.update(label=label(p.obj, p.name), summary=_summary(p.obj), compiled=caps.compiled,
                           needs_future=caps.needs_future, needs_scores=caps.needs_scores, needs_counts=caps.needs_counts,
                           needs_raw_keys=caps.needs_raw_keys, params=_defaults(p.obj))
            except Exception as exc:  # one plug-in's odd class never breaks the list
                row.update(status="broken", error=f"cannot be described: {type(exc).__name__}: {exc}")
        rows.append(row)
    if as_json:
        typer.echo(strict_json.dumps(rows, default=str))
        return
    table = Table(_name_column(rows), "needs", "what it is; parameters (defaults); origin", show_lines=True)
    for r in rows:
        if r["status"] != "ok":
            table.add_row(r["name"], "", f"[red]broken[/]: {escape(str(r['error']))}")
            continue
        needs = ", ".join(k.removeprefix("needs_") for k in ("needs_future", "needs_scores", "needs_counts",
                                                              "needs_raw_keys") if r[k])
        params = ", ".join(f"{k}={v!r}" for k, v in r["params"].items()) or "none"
        origin = f"{r['distribution']} {r['version']}, {'compiled' if r['compiled'] else 'Python'}"
        table.add_row(r["name"], needs, escape(f"{r['summary']}\nparameters: {params}\n{origin}"))
    stdout_console().print(table)


@policies_app.command("check")
def policies_check(
    name: str = typer.Argument(..., help="A registered policy's name, as `cachelab policies list` shows it, "
                               "or one with its admission filter, as `lru+tinylfu`."),
    param: list[str] = typer.Option([], "--param", help="A hyper-parameter to check the policy with, as "
                                    "key=value (repeatable), e.g. --param admission=tinylfu."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object: the policy, its entry point "
                                 "and each check's status and reason."),
) -> None:
    """Run the conformance kit (docs/plugins.md) on an installed policy: each check passed,
    failed with the reason, or skipped with why. Exit status 1 if any check failed.

    The checks replay small streams at capacities 1, 5 and 24 and hold the policy to the
    contract every command relies on (capacity, hits, slots, determinism, reset, step vs run,
    no index past an array in compiled code, which reruns it in a fresh process for a few
    seconds). Example: `cachelab policies check my-policy --param window=8`."""
    from cachelab.testing import iter_policy_checks

    registered, params = registry.policy_name_params(name, parse_pairs(param))
    cls = registry.get(registry.POLICIES, registered)
    plugin = registry.resolved(registry.POLICIES)[registered]
    check_params(cls, params, "--param")
    from cachelab.policy.admission import check_admission_param

    check_admission_param(params)
    console = stdout_console()
    if not as_json:
        console.print(f"checking {name} ({escape(plugin.origin)})" + (f" with {params}" if params else ""))
    results = []
    for result in iter_policy_checks(cls, **params):
        results.append(result)
        if not as_json:
            mark = {"passed": "[green]passed[/] ", "failed": "[red]FAILED[/] ", "skipped": "[yellow]skipped[/]"}
            console.print(f"{mark[result.status]} {result.check}" + (f": {escape(result.reason)}" if result.reason else ""))
    failed = [r.check for r in results if r.status == "failed"]
    if as_json:
        typer.echo(strict_json.dumps({"policy": name, "entry_point": plugin.value, "distribution": plugin.distribution,
                                      "version": plugin.version, "params": params, "passed": not failed,
                                      "checks": [{"check": r.check, "status": r.status, "reason": r.reason}
                                                 for r in results]}, default=str))
    else:
        console.print(f"{name}: {len(results)} checks, {len(failed)} failed"
                      + (f" ({', '.join(failed)})" if failed else ""))
    if failed:
        raise typer.Exit(code=1)
