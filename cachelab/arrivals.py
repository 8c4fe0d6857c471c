"""Kept so ``from cachelab.arrivals import ArrivalSource, arrival_frame`` (the path before the
restructure) still works; the contract lives in ``cachelab.trace.arrivals``."""

from cachelab.trace.arrivals import ArrivalSource, arrival_frame

__all__ = ["ArrivalSource", "arrival_frame"]
