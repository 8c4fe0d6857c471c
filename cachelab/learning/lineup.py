"""Which registered policies a comparison replays, and in which role, from what each declares.

The core never names a built-in policy. A registered policy's ``Capabilities`` say what it
is: ``needs_scores`` makes it learned (replayed with a model's scores), ``needs_future``
an oracle (the lowest oracle is the bound a learned policy is measured against), anything
else a heuristic (the lowest of them, per capacity, is "the best heuristic"). Two roles
are held by one policy each, so they are declared, not inferred:

- ``Capabilities(optimal=True)``: the offline optimum, whose keep decisions are the keep
  labels of ``cachelab train --capacity``;
- ``judged_by_default = True``: the learned policy ``cachelab evaluate`` judges when
  ``--policy`` is not given.

A learned policy may also declare ``tuned_params = {"param": (value, ...)}``: parameters
that ``cachelab train`` tunes on a keep model's training window (``training.tune``).
These learning declarations, like ``Policy.label`` (what a report calls the policy), count
only on the class that sets them: a subclass is another policy.
"""

from __future__ import annotations

from dataclasses import dataclass

from cachelab import registry
from cachelab.errors import CachelabError
from cachelab.policy import Capabilities


def declared(cls, attr: str, default=None):
    """``cls``'s own setting of a learning declaration (never one inherited from a base)."""
    return vars(cls).get(attr, default)


def label(cls, name: str) -> str:
    """What reports call the policy registered as ``name``: its own ``label``, else ``name``."""
    return declared(cls, "label") or name


def capabilities(cls) -> Capabilities:
    """What the policy declares (the contract's default for one that declares nothing)."""
    return getattr(cls, "capabilities", Capabilities())


@dataclass(frozen=True, slots=True)
class Lineup:
    """The registered policies by role, each as label -> registry name, in registry order."""

    learned: dict[str, str]
    heuristics: dict[str, str]
    oracles: dict[str, str]
    unavailable: list[str]  # registered names that failed to load (or are disabled): not compared

    def label_of(self, name: str) -> str:
        """The label of the policy registered as ``name``."""
        return next(lab for role in (self.learned, self.heuristics, self.oracles)
                    for lab, n in role.items() if n == name)

    def name_of(self, label: str) -> str:
        """The registry name (what ``--policy`` takes) of the policy labelled ``label``; ``label`` if none is."""
        return {**self.learned, **self.heuristics, **self.oracles}.get(label, label)

    def names(self, labels) -> dict[str, str]:
        """Each of ``labels`` -> its registry name: the ``policy_names`` of JSON figures keyed by label, so a
        script joins them to ``cachelab policies list --json`` and ``--policy``."""
        return {label: self.name_of(label) for label in labels}


def lineup() -> Lineup:
    """Every loadable registered policy in its role; a class registered twice counts once."""
    roles: tuple[dict[str, str], dict[str, str], dict[str, str]] = ({}, {}, {})
    unavailable, owner, classes = [], {}, set()
    for plugin in registry.resolved(registry.POLICIES).values():
        if plugin.error is not None:
            unavailable.append(plugin.name)
            continue
        if plugin.obj in classes:
            continue
        classes.add(plugin.obj)
        caps = capabilities(plugin.obj)
        lab = label(plugin.obj, plugin.name)
        if lab in owner:
            raise CachelabError(f"policies {owner[lab]!r} and {plugin.name!r} are both labelled {lab!r}; "
                                "a report needs one label per policy")
        owner[lab] = plugin.name
        (roles[0] if caps.needs_scores else roles[2] if caps.needs_future else roles[1])[lab] = plugin.name
    return Lineup(*roles, unavailable)


def names_of(labels) -> dict[str, str]:
    """``Lineup.names`` of ``labels``, the lineup (every registered policy imported) loaded only where there is a
    label: an experiment without a learned point names no policy, and must not fail on a plug-in it never ran."""
    labels = list(labels)
    return lineup().names(labels) if labels else {}


def _the_one(what: str, names: list[str], how: str) -> str:
    if len(names) != 1:
        found = f"several: {', '.join(names)}" if names else "none"
        raise CachelabError(f"{what} must be declared by exactly one registered policy ({how}); found {found}")
    return names[0]


def optimum() -> str:
    """The registry name of the offline optimum (``Capabilities(optimal=True)``)."""
    names = [p.name for p in registry.discover(registry.POLICIES)
             if p.error is None and capabilities(p.obj).optimal]
    return _the_one("the offline optimum", names, "Capabilities(optimal=True)")


def judged_default(found: Lineup) -> str:
    """The learned policy that declares ``judged_by_default``."""
    names = [n for n in found.learned.values() if declared(registry.get(registry.POLICIES, n), "judged_by_default")]
    return _the_one("the learned policy judged by default", names, "judged_by_default = True; or pass --policy")


def tuned_params(found: Lineup) -> dict[str, dict[str, tuple]]:
    """Registry name -> the grids of each learned policy that declares ``tuned_params``."""
    out = {}
    for name in found.learned.values():
        grids = declared(registry.get(registry.POLICIES, name), "tuned_params")
        if grids:
            out[name] = dict(grids)
    return out
