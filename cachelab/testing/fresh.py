"""A conformance check's second opinion from a fresh Python process: the class imported there by
its module, the params as JSON, one JSON line back. Compiled code reruns there with other
settings (bounds checks), and a result that holds only within one process (a seed taken from
the pid or a string's hash) shows as a difference."""

from __future__ import annotations

import importlib
import json
import subprocess
import sys

from cachelab.child import python_command
from cachelab.testing.results import ConformanceError, Skip


def in_fresh_process(cls, params, child, env: dict, timeout_s: int):
    """What ``child`` (a module-level function) prints as its last JSON line, run in a fresh Python
    with ``env`` added, on ``cls`` imported there by its module and ``params`` as JSON (read by
    ``child_target``); ``Skip`` where that process cannot import ``cls``."""
    target, name = f"{cls.__module__}:{cls.__qualname__}", child.__name__
    if cls.__module__ == "__main__" or "<locals>" in cls.__qualname__:
        raise Skip(f"{target} cannot be imported by the fresh process that {name} runs in: "
                   "define the class at the top level of an importable module")
    try:
        given = json.dumps(params)
    except TypeError as exc:
        raise Skip(f"the fresh process that {name} runs in takes JSON params: {exc}") from None
    python, env = python_command(env)
    code = f"from {child.__module__} import {name}; {name}()"
    try:
        proc = subprocess.run([*python, "-c", code, target, given], env=env, capture_output=True,
                              text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        raise ConformanceError(f"the rerun in a fresh process ({name}) did not finish in {timeout_s} s") \
            from None
    if proc.returncode != 0:
        tail = proc.stderr.strip().splitlines()[-1:] or [f"status {proc.returncode}"]
        raise ConformanceError(f"the rerun in a fresh process ({name}) failed: {tail[0]}")
    found = json.loads(proc.stdout.strip().splitlines()[-1])
    if isinstance(found, dict) and "unimportable" in found:
        raise Skip(f"the fresh process that {name} runs in cannot import {target}: "
                   f"{found['unimportable']}")
    return found


def child_target():
    """A fresh process's class and params from argv (``module:qualname``, JSON); (None,
    None) after printing why, where its module is not found there (pytest's importlib mode)."""
    module, qualname = sys.argv[1].split(":")
    try:
        cls = importlib.import_module(module)
    except ModuleNotFoundError as exc:
        print(json.dumps({"unimportable": str(exc)}))
        return None, None
    for part in qualname.split("."):
        cls = getattr(cls, part)
    return cls, json.loads(sys.argv[2])
