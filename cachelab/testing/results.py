"""Structured outcomes of conformance checks, and the loop that runs them."""

from __future__ import annotations

from dataclasses import dataclass


class ConformanceError(AssertionError):
    """A contract is broken; the message says which, where and with what values."""


class Skip(Exception):
    """The check does not apply to this target (the message says why)."""


@dataclass(frozen=True, slots=True)
class CheckResult:
    """One check's outcome: ``status`` is ``passed``, ``failed`` or ``skipped``."""

    check: str
    status: str
    reason: str = ""

    @property
    def ok(self) -> bool:
        return self.status != "failed"

    def __str__(self) -> str:
        return f"{self.check}: {self.status}" + (f" ({self.reason})" if self.reason else "")


def run_checks(checks, cls, params: dict) -> list[CheckResult]:
    """Run every check on ``cls(**params)``; a check never stops the others."""
    results = []
    for check in checks:
        try:
            check(cls, **params)
        except Skip as skip:
            results.append(CheckResult(check.__name__, "skipped", str(skip)))
        except AssertionError as exc:
            results.append(CheckResult(check.__name__, "failed", str(exc)))
        except Exception as exc:  # the target raised where the contract says it must not
            results.append(CheckResult(check.__name__, "failed", f"raised {type(exc).__name__}: {exc}"))
        else:
            results.append(CheckResult(check.__name__, "passed"))
    return results
