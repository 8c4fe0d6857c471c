"""The conformance kit: does a policy or predictor keep cachelab's contracts?

In the spirit of scikit-learn's ``check_estimator``: small, named ``check_*`` functions,
each raising ``AssertionError`` with a readable message when the contract is broken, run
on small deterministic streams (or data sets). ``check_policy(PolicyClass, **params)`` and
``check_predictor(PredictorClass, **params)`` run them all and return one ``CheckResult``
per check (``iter_policy_checks`` yields each as it finishes; ``cachelab policies check NAME``
runs them on a registered policy, no test to write); ``parametrize_with_checks`` turns the
same checks into pytest cases::

    from cachelab.testing import check_policy, parametrize_with_checks

    results = check_policy(MyPolicy, window=8)
    assert all(r.ok for r in results), [str(r) for r in results if not r.ok]

    @parametrize_with_checks([MyPolicy, (MyPolicy, {"window": 8}), MyPredictor])
    def test_conforms(target, check):
        check()
"""

from __future__ import annotations

from cachelab.testing.results import CheckResult, ConformanceError, Skip, run_checks
from cachelab.testing.policy_checks import POLICY_CHECKS, check_policy, iter_policy_checks
from cachelab.testing.predictor_checks import PREDICTOR_CHECKS, check_predictor

__all__ = ["CheckResult", "ConformanceError", "POLICY_CHECKS", "PREDICTOR_CHECKS", "check_policy",
           "check_predictor", "iter_policy_checks", "parametrize_with_checks", "run_checks"]


def _checks_for(cls):
    from cachelab.learning.predictor import Predictor

    is_predictor = isinstance(cls, type) and (issubclass(cls, Predictor) or hasattr(cls, "fit"))
    return PREDICTOR_CHECKS if is_predictor else POLICY_CHECKS


def parametrize_with_checks(targets):
    """A ``pytest.mark.parametrize`` over (target, check) for every check of every target.

    ``targets`` are classes, or ``(class, params)`` pairs. The test receives ``target``
    (a readable id) and ``check``, a no-argument callable that raises on failure and calls
    ``pytest.skip`` when the check does not apply.
    """
    import functools

    import pytest

    cases, ids = [], []
    for target in targets:
        cls, params = target if isinstance(target, tuple) else (target, {})
        label = cls.__name__ + "".join(f"-{k}={v}" for k, v in params.items())
        for check in _checks_for(cls):
            cases.append((label, functools.partial(_as_pytest, check, cls, params)))
            ids.append(f"{label}-{check.__name__}")
    return pytest.mark.parametrize("target,check", cases, ids=ids)


def _as_pytest(check, cls, params):
    import pytest

    try:
        check(cls, **params)
    except Skip as skip:
        pytest.skip(str(skip))
