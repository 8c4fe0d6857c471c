"""The policy layer: the contract every cache policy implements, and the toolkit to build one.

``from cachelab.policy import Policy, StepResult`` is the contract (``contract.py``). The
compiled toolkit, for policies written as Numba kernels, is public too: ``kernel`` (the
shared step/run wrapper), ``admission`` (filters and frequency sketches), ``queues`` (slot
lists) and ``heap`` (keyed heaps). Built-in and third-party policies use the same modules.
"""

from cachelab.policy.contract import (NO_NEXT, Capabilities, Policy, StepResult, check_capacity,
                                      check_keys)

__all__ = ["NO_NEXT", "Capabilities", "Policy", "StepResult", "check_capacity", "check_keys"]
