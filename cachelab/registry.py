"""Entry points are cachelab's only registry: built-ins and third-party plug-ins alike.

``cachelab`` never imports ``policies``, ``predictors`` or ``traces`` by name; it loads the
``cachelab.*`` entry-point groups (policies, predictors, workloads, experiment kinds). Each
plug-in is checked against its group's contract at load time (a policy must subclass or
quack like ``cachelab.policy.Policy``: reset, step, resident; a predictor like
``cachelab.learning.Predictor``; an experiment kind like
``cachelab.experiment.kinds.ExperimentKind``: sections, run). A plug-in that fails to load
or to match is recorded with its reason and skipped, so one broken package never breaks
unrelated commands; ``blame`` names the plug-in behind an exception raised at run time.
``CACHELAB_DISABLE_PLUGINS=name,name`` switches plug-ins off by name.
"""

from __future__ import annotations

import inspect
import os
from dataclasses import dataclass
from functools import lru_cache
from importlib.metadata import entry_points

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


def contract_error(group: str, obj) -> str | None:
    """Why ``obj`` cannot serve in ``group`` (None if it can): the methods it lacks."""
    if group == EXPERIMENT_KINDS:  # an ExperimentKind (cachelab.experiment.kinds), by its shape
        if not isinstance(getattr(obj, "sections", None), tuple) or not callable(getattr(obj, "run", None)):
            return f"wrong interface: {obj!r} is not an ExperimentKind (sections, run)"
        return None
    if group == POLICIES:
        from cachelab.policy import Policy as base

        required = ("reset", "step", "resident")
    elif group == PREDICTORS:
        from cachelab.learning.predictor import Predictor as base

        required = ("fit", "predict", "save_model", "load_model")
    else:
        return None
    if not isinstance(obj, type):
        return f"wrong interface: {obj!r} is not a class"
    if issubclass(obj, base):
        if inspect.isabstract(obj):
            return (f"wrong interface: {obj.__name__} does not implement "
                    f"{sorted(obj.__abstractmethods__)}")
        return None
    missing = [m for m in required if not callable(getattr(obj, m, None))]
    if missing:
        return (f"wrong interface: {obj.__name__} is not a {base.__module__}.{base.__name__} "
                f"and lacks {', '.join(missing)}")
    return None


def _disabled() -> set[str]:
    return {n.strip() for n in os.environ.get("CACHELAB_DISABLE_PLUGINS", "").split(",") if n.strip()}


@lru_cache(maxsize=None)
def discover(group: str) -> tuple[Plugin, ...]:
    """Every entry point of ``group``, loaded and checked; failures carry their reason."""
    found = []
    disabled = _disabled()
    for ep in sorted(entry_points(group=group), key=lambda e: e.name):
        dist = ep.dist.metadata["Name"] if ep.dist is not None else "?"
        version = ep.dist.version if ep.dist is not None else "?"
        if ep.name in disabled:
            found.append(Plugin(group, ep.name, ep.value, dist, version, None,
                                "disabled by CACHELAB_DISABLE_PLUGINS"))
            continue
        try:
            obj = ep.load()
            error = contract_error(group, obj)
        except Exception as exc:  # a plug-in's import error must not break the caller
            obj, error = None, f"{type(exc).__name__}: {exc}"
        found.append(Plugin(group, ep.name, ep.value, dist, version, None if error else obj, error))
    return tuple(found)


def blame(exc: BaseException) -> Plugin | None:
    """The plug-in whose code raised ``exc`` (the innermost of its traceback), if any."""
    modules = {p.value.split(":")[0]: p for group in GROUPS for p in discover(group)}
    culprit = None
    tb = exc.__traceback__
    while tb is not None:
        name = tb.tb_frame.f_globals.get("__name__", "")
        for module, plugin in modules.items():
            if name == module or name.startswith(module + "."):
                culprit = plugin
        tb = tb.tb_next
    return culprit


def get(group: str, name: str):
    """The loaded object registered as ``name`` in ``group``, or a clear error."""
    plugins = {p.name: p for p in discover(group)}
    plugin = plugins.get(name)
    if plugin is None:
        kind = group.split(".")[-1].removesuffix("s").replace("policie", "policy").replace("_", " ")
        raise CachelabError(f"unknown {kind} {name!r}; installed: {sorted(plugins) or 'none'}")
    if plugin.error is not None:
        raise CachelabError(f"plug-in {name!r} from {plugin.distribution} failed to load: {plugin.error}")
    return plugin.obj


def make_policy(name: str, **params):
    """A policy instance by registry name; unknown hyper-parameters are named in the error.

    ``name`` may carry an admission filter as ``policy+filter`` (``lru+tinylfu``), the
    derived-name convention for eviction x admission variants.
    """
    if "+" in name:
        name, admission = name.split("+", 1)
        params.setdefault("admission", admission)
    cls = get(POLICIES, name)
    sig = inspect.signature(cls)
    takes_any = any(p.kind is p.VAR_KEYWORD for p in sig.parameters.values())
    known = [p for p in sig.parameters if sig.parameters[p].kind is not inspect.Parameter.VAR_POSITIONAL]
    unknown = sorted(set(params) - set(known))
    if unknown and not takes_any:
        raise CachelabError(f"policy {name!r} has no parameter {', '.join(map(repr, unknown))}; "
                            f"it takes {known or 'none'}")
    return cls(**params)
