"""Every installed policy and predictor passes the conformance kit (cachelab.testing).

Discovered through the entry points, so built-ins, the other families and any installed
plug-in (examples/plugin-example) are covered without a list to maintain. Predictors are
checked with their iteration counts shrunk, and one thread, to keep this quick.
"""

from __future__ import annotations

import inspect

import pytest

from cachelab import registry
from cachelab.testing import parametrize_with_checks

SMALL = {"n_estimators": 5, "max_iter": 5, "epochs": 1}


def _small(cls) -> dict:
    accepted = inspect.signature(cls).parameters
    return {k: v for k, v in SMALL.items() if k in accepted}


POLICIES = [p.obj for p in registry.discover(registry.POLICIES) if p.error is None]
PREDICTORS = [(p.obj, _small(p.obj)) for p in registry.discover(registry.PREDICTORS) if p.error is None]


def test_every_plugin_loads():
    broken = [(p.group, p.name, p.error) for g in registry.GROUPS for p in registry.discover(g) if p.error]
    assert not broken


@parametrize_with_checks(POLICIES + PREDICTORS)
def test_conforms(target, check):
    from threadpoolctl import threadpool_limits

    with threadpool_limits(1):
        check()


def test_parametrize_covers_every_check():
    from cachelab.testing import POLICY_CHECKS, PREDICTOR_CHECKS

    mark = parametrize_with_checks(POLICIES[:1] + PREDICTORS[:1])
    names = [i.rsplit("-", 1)[1] for i in mark.kwargs["ids"]]
    assert names == [c.__name__ for c in POLICY_CHECKS + PREDICTOR_CHECKS]
    assert isinstance(mark, pytest.MarkDecorator)
