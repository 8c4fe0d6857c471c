"""The policy layer: the contract every cache policy implements, and the toolkit to build one.

``from cachelab.policy import Policy, StepResult`` is the contract (``contract.py``). A new
policy is written on one of two bases that keep residency for it: ``SlotPolicy`` with
``Hooks`` (``template.py``), compiled into the one shared per-access loop, or
``PythonPolicy`` (``python_policy.py``), the same hooks as plain methods. Below them, the
compiled toolkit is public too: ``kernel`` (the step/run wrapper), ``admission`` (filters
and frequency sketches), ``queues`` (slot lists) and ``heap`` (keyed heaps). Built-in and
third-party policies use the same modules.
"""

from cachelab.policy.contract import (NO_NEXT, Capabilities, Policy, StepResult, check_capacity,
                                      check_keys)
from cachelab.policy.python_policy import PythonPolicy
from cachelab.policy.template import Hooks, SlotPolicy

__all__ = ["NO_NEXT", "Capabilities", "Hooks", "Policy", "PythonPolicy", "SlotPolicy", "StepResult",
           "check_capacity", "check_keys"]
