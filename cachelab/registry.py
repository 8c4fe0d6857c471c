"""Entry points are cachelab's only registry: built-ins and third-party plug-ins alike.

``cachelab`` never imports ``policies``, ``predictors`` or ``traces`` by name; it loads the
``cachelab.*`` entry-point groups (policies, predictors, workloads, experiment kinds). Each
plug-in is checked against its group's contract at load time (a policy must subclass or
quack like ``cachelab.policy.Policy``: reset, step, resident; a predictor like
``cachelab.learning.Predictor``; an experiment kind like
``cachelab.experiment.kinds.ExperimentKind``: sections, run; a policy's or predictor's
``name`` is its entry point's). A plug-in that fails to load
or to match is recorded with its reason and skipped, so one broken package never breaks
unrelated commands; ``blame`` names the plug-in behind an exception raised at run time
(``attributed`` turns it into a message that crosses a worker's process boundary).
A plug-in's import may fail in any way (an exception, ``SystemExit``) or print (sent to
stderr, so ``--json`` stays clean) without affecting the others; a name that two
distributions claim is an error naming both, so a built-in never silently loses its name.
``CACHELAB_DISABLE_PLUGINS=name,dist:name`` switches plug-ins off by name, or by name from one
distribution.
"""

from __future__ import annotations

import inspect
import os
import sys
from contextlib import contextmanager, redirect_stdout
from dataclasses import dataclass, replace
from functools import lru_cache
from importlib.metadata import PackageNotFoundError, distributions, entry_points
from importlib.metadata import version as installed_version

from cachelab.errors import CachelabError

POLICIES = "cachelab.policies"
PREDICTORS = "cachelab.predictors"
WORKLOADS = "cachelab.workloads"
EXPERIMENT_KINDS = "cachelab.experiment_kinds"
GROUPS = (POLICIES, PREDICTORS, WORKLOADS, EXPERIMENT_KINDS)


@dataclass(frozen=True, slots=True)
class Plugin:
    """One entry point: where it came from and what loading it gave."""

    group: str
    name: str
    value: str
    distribution: str
    version: str
    obj: object | None = None
    error: str | None = None

    @property
    def origin(self) -> str:
        """Where it is declared, for errors: its group, its entry point, its distribution."""
        return f"{self.group} entry point {self.value}, from {self.distribution} {self.version}"

    def load_failure(self) -> str:
        """Why using it fails, naming it and its origin."""
        return f"plug-in {self.name!r} ({self.origin}) failed to load: {self.error}"

    def run_failure(self, exc: BaseException) -> str:
        """What ``exc``, raised inside its code, means for a user: it, its origin, the reason."""
        return f"plug-in {self.name!r} ({self.origin}) failed at run time: {type(exc).__name__}: {exc}"


class PluginFailed(CachelabError):
    """An exception a plug-in's code raised, as a message naming the plug-in and its entry point:
    it crosses a process boundary (a pool or Ray worker) that the traceback ``blame`` reads does not."""


def contract_error(group: str, obj, name: str | None = None) -> str | None:
    """Why ``obj`` cannot serve in ``group`` (None if it can): the methods it lacks. A class that
    does not subclass the base must quack like all of it: every method the framework calls;
    what a class declares as data (``_declaration``: a policy's ``capabilities``, a
    predictor's ``task``) must be valid, subclass or not; and its ``name`` must be the ``name``
    it is registered as: a saved model records it to be loaded back by it, and replays report
    it (a subclass that kept its base's name was saved as, and loaded back into, the base)."""
    if group == EXPERIMENT_KINDS:  # an ExperimentKind (cachelab.experiment.kinds), by its shape
        if not isinstance(getattr(obj, "sections", None), tuple) or not callable(getattr(obj, "run", None)):
            return f"wrong interface: {obj!r} is not an ExperimentKind (sections, run)"
        return None
    if group == POLICIES:
        from cachelab.policy import Policy as base

        required = ("reset", "step", "resident", "run", "view_future", "holds_every_key", "get_params")
    elif group == PREDICTORS:
        from cachelab.learning.predictor import Predictor as base

        required = ("fit", "predict", "save_model", "load_model", "save", "get_params")
    else:
        return None
    if not isinstance(obj, type):
        return f"wrong interface: {obj!r} is not a class"
    attr, expected, valid = _declaration(group)  # read wherever the class is used; a subclass may override it
    value = getattr(obj, attr, None)
    if issubclass(obj, base):
        if inspect.isabstract(obj):
            return (f"wrong interface: {obj.__name__} does not implement "
                    f"{sorted(obj.__abstractmethods__)}")
        if not valid(value):
            return f"wrong interface: {obj.__name__}.{attr} is {value!r:.80}, not {expected}"
    else:
        missing = [m for m in required if not callable(getattr(obj, m, None))]
        if not valid(value):
            missing.append(f"{attr} ({expected})")
        if missing:
            return (f"wrong interface: {obj.__name__} is not a {base.__module__}.{base.__name__} "
                    f"and lacks {', '.join(missing)}")
    declared = getattr(obj, "name", None)
    if name is not None and declared != name:
        return (f"wrong interface: {obj.__name__}.name is {declared!r:.80}, but it is registered as {name!r}; "
                f"set name = {name!r} in the class")
    return None


def _declaration(group: str):
    """The attribute a class of ``group`` declares as data, what it must be, and the test of it:
    a policy's ``capabilities``, a predictor's ``task`` (which labels it learns, how its
    predictions become scores)."""
    if group == POLICIES:
        from cachelab.policy import Capabilities

        return "capabilities", "a cachelab.policy.Capabilities", lambda v: isinstance(v, Capabilities)
    from cachelab.learning.predictor import TASKS

    return "task", f"one of {list(TASKS)}", lambda v: isinstance(v, str) and v in TASKS


def _disabled() -> set[str]:
    return {n.strip() for n in os.environ.get("CACHELAB_DISABLE_PLUGINS", "").split(",") if n.strip()}


@contextmanager
def _stdout_to_stderr():
    """What a plug-in prints while it is imported goes to stderr, so ``--json`` output stays clean."""
    sys.stdout.flush()
    try:
        saved = os.dup(1)
        os.dup2(2, 1)
    except OSError:  # no file descriptors to move (an embedding host)
        saved = None
    try:
        with redirect_stdout(sys.stderr):
            yield
    finally:
        sys.stdout.flush()
        if saved is not None:
            os.dup2(saved, 1)
            os.close(saved)


def _load(ep) -> tuple[object | None, str | None]:
    """Import one entry point; any failure, ``SystemExit`` included, becomes its reason."""
    try:
        with _stdout_to_stderr():
            obj = ep.load()
    except (Exception, SystemExit) as exc:  # a plug-in's import must not break or end the caller
        return None, f"{type(exc).__name__}: {exc}"
    return obj, None


def _version_mismatch(dist) -> str:
    """What a broken plug-in's distribution requires of cachelab, where the installed cachelab
    does not satisfy it (``pip install --no-deps``, an editable checkout): its import error
    (a name cachelab lacks) alone does not say that versions differ."""
    from packaging.requirements import InvalidRequirement, Requirement

    try:
        mine = installed_version("cachelab")
    except PackageNotFoundError:  # run from a checkout that was never installed
        return ""
    for text in dist.requires or ():
        try:
            req = Requirement(text)
        except InvalidRequirement:
            continue
        if (req.name.lower() == "cachelab" and (req.marker is None or req.marker.evaluate({"extra": ""}))
                and not req.specifier.contains(mine, prereleases=True)):
            return f" ({dist.metadata['Name']} {dist.version} requires {text}, and cachelab {mine} is installed)"
    return ""


def _claims(plugins: list[Plugin]) -> list[Plugin]:
    """A name two distributions claim is an error for both, naming each: no silent winner."""
    by_name: dict[str, list[Plugin]] = {}
    for p in plugins:
        by_name.setdefault(p.name, []).append(p)
    out = []
    for name, claimants in by_name.items():
        if len(claimants) == 1:
            out.extend(claimants)
            continue
        who = " and ".join(f"{p.distribution} {p.version} ({p.value})" for p in claimants)
        switches = " or ".join(f"CACHELAB_DISABLE_PLUGINS={p.distribution}:{name}" for p in claimants)
        reason = f"the name {name!r} is claimed by {who}; uninstall one, or switch one off with {switches}"
        out.extend(replace(p, obj=None, error=reason) for p in claimants)
    return out


@lru_cache(maxsize=None)
def discover(group: str, name: str | None = None) -> tuple[Plugin, ...]:
    """Every entry point of ``group``, loaded and checked; failures carry their reason. With
    ``name``, only the entry points of that name are imported (``get``): a name's claimants are
    all its entry points, so its checks are the same, and a verb that names one policy does not
    import every other policy's module and build its kernels' dispatchers (0.05 s of ``simulate``)."""
    found, off = [], []
    disabled = _disabled()
    named: dict[int, tuple[str, str]] = {}  # each distribution's name and version, parsed once
    chosen = entry_points(group=group) if name is None else entry_points(group=group, name=name)
    for ep in sorted(chosen, key=lambda e: (e.name, e.value)):
        if ep.dist is not None and id(ep.dist) not in named:  # its metadata file is parsed per access
            named[id(ep.dist)] = (ep.dist.metadata["Name"], ep.dist.version)
        dist, version = named[id(ep.dist)] if ep.dist is not None else ("?", "?")
        if ep.name in disabled or f"{dist}:{ep.name}" in disabled:
            off.append(Plugin(group, ep.name, ep.value, dist, version, None, "disabled by CACHELAB_DISABLE_PLUGINS"))
            continue
        obj, error = _load(ep)
        if error is None:
            error = contract_error(group, obj, ep.name)
        if error is not None and ep.dist is not None:
            error += _version_mismatch(ep.dist)
        found.append(Plugin(group, ep.name, ep.value, dist, version, None if error else obj, error))
    return tuple(sorted(_claims(found) + off, key=lambda p: p.name))


def _frame_plugin(frame, candidates: list[Plugin]) -> Plugin:
    """Of the plug-ins one module registers, the one a frame of its code runs for: the class
    bound as ``self`` or ``cls``, else the class the function is defined on, else the first."""
    bound = frame.f_locals.get("self", frame.f_locals.get("cls"))
    bound = bound if isinstance(bound, type) else type(bound)
    qualname = getattr(frame.f_code, "co_qualname", "")
    for test in (lambda p: p.obj is bound, lambda p: qualname.startswith(p.value.split(":")[-1] + ".")):
        for plugin in candidates:
            if test(plugin):
                return plugin
    return candidates[0]


def blame(exc: BaseException) -> Plugin | None:
    """The plug-in whose code raised ``exc`` (the innermost of its traceback), if any; where one
    module registers several, the one whose class the failing code ran for."""
    modules: dict[str, list[Plugin]] = {}
    for group in GROUPS:
        for p in discover(group):
            modules.setdefault(p.value.split(":")[0], []).append(p)
    culprit = None
    tb = exc.__traceback__
    while tb is not None:
        name = tb.tb_frame.f_globals.get("__name__", "")
        for module, plugins in modules.items():
            if name == module or name.startswith(module + "."):
                culprit = _frame_plugin(tb.tb_frame, plugins)
        tb = tb.tb_next
    return culprit


def attributed(exc: Exception) -> Exception:
    """``exc`` as a ``PluginFailed`` naming the plug-in that raised it (``blame``), else ``exc``:
    for a worker to return, where the caller sees the message without the traceback."""
    plugin = blame(exc)
    return exc if plugin is None or isinstance(exc, PluginFailed) else PluginFailed(plugin.run_failure(exc))


def _chosen(claimants: tuple[Plugin, ...]) -> Plugin | None:
    """Of one name's entry points, the one it stands for: the first that loads (where one
    distribution's is switched off, ``CACHELAB_DISABLE_PLUGINS=dist:name``, and another's loads),
    else the last."""
    return next((p for p in claimants if p.error is None), claimants[-1] if claimants else None)


def resolved(group: str) -> dict[str, Plugin]:
    """One entry point per name of ``group``, by name (``_chosen``)."""
    by_name: dict[str, tuple[Plugin, ...]] = {}
    for p in discover(group):
        by_name[p.name] = by_name.get(p.name, ()) + (p,)
    return {name: _chosen(claimants) for name, claimants in by_name.items()}


def _strays(group: str, name: str) -> list[str]:
    """Entry points named ``name`` in a group that is not one of cachelab's but names it
    (``cachelab.policy``, ``cachelab_policies``): a plug-in declared there is never read, and
    an unknown name alone does not say why."""
    return list(dict.fromkeys(  # a distribution on two sys.path entries is found twice
        f"an entry point {name!r} ({ep.value}, from {dist.metadata['Name']} {dist.version}) is declared in "
        f"the group {ep.group!r}, which cachelab does not read: declare it under "
        f"[project.entry-points.\"{group}\"]"
        for dist in distributions() for ep in dist.entry_points
        if ep.name == name and "cachelab" in ep.group.lower() and ep.group not in GROUPS))


def get(group: str, name: str):
    """The loaded object registered as ``name`` in ``group``, or a clear error; only ``name``'s
    entry points are imported (``discover``)."""
    plugin = _chosen(discover(group, name))
    if plugin is None:
        kind = group.split(".")[-1].removesuffix("s").replace("policie", "policy").replace("_", " ")
        installed = sorted({ep.name for ep in entry_points(group=group)})
        raise CachelabError(f"unknown {kind} {name!r}; installed: {installed or 'none'}"
                            + "".join(f"; {stray}" for stray in _strays(group, name)))
    if plugin.error is not None:
        raise CachelabError(plugin.load_failure())
    return plugin.obj


def policy_name_params(name: str, params: dict) -> tuple[str, dict]:
    """The registered policy and parameters ``name`` stands for: ``policy+filter``
    (``lru+tinylfu``), the derived-name convention for eviction x admission variants, is
    ``policy`` with ``admission=filter``."""
    if "+" not in name:
        return name, params
    name, admission = name.split("+", 1)
    if params.get("admission", admission) != admission:  # one of the two would be dropped in silence
        raise CachelabError(f"policy {name}+{admission} names the admission filter {admission!r}, and "
                            f"admission={params['admission']!r} another: give one of them")
    return name, {**params, "admission": admission}


def make_policy(name: str, **params):
    """A policy instance by registry name (``policy+filter`` too: ``policy_name_params``);
    unknown hyper-parameters are named in the error."""
    name, params = policy_name_params(name, params)
    cls = get(POLICIES, name)
    sig = inspect.signature(cls)
    takes_any = any(p.kind is p.VAR_KEYWORD for p in sig.parameters.values())
    known = [p for p in sig.parameters if sig.parameters[p].kind is not inspect.Parameter.VAR_POSITIONAL]
    unknown = sorted(set(params) - set(known))
    if unknown and not takes_any:
        raise CachelabError(f"policy {name!r} has no parameter {', '.join(map(repr, unknown))}; "
                            f"it takes {known or 'none'}")
    if params.get("admission") == "scores" and not getattr(cls, "feeds_scores_filter", False):
        # the filter compares per-row scores that only a policy declaring feeds_scores_filter writes into it:
        # unfed, every candidate ties the victim at 0 and is refused, so the cache froze once full
        raise CachelabError(f"policy {name!r} writes no predictor scores into the scores admission filter, which "
                            f"would compare zeros; use --policy learned-admission --param base={name} with --model DIR")
    return cls(**params)
