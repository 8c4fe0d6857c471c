"""Defaults that more than one module uses, written down once.

A CLI flag, a spec key and a library argument that mean the same thing take their default
from here, so ``cachelab train``, ``[predictor]`` in a spec and ``TrainSpec`` cannot drift
apart. Defaults one module alone uses stay beside their code.
"""

from __future__ import annotations

PRESET = "deepseek-v4.1-flash"  # the Engram layout when none is named
HORIZON = 1 << 17  # label horizon in lookups: training labels, and learned policies' reuse window
TRAIN_FRACTION = 0.5  # share of a trace a predictor trains on; the rest validates / is judged
MAX_SAMPLES = 2_000_000  # training samples drawn from the training window
