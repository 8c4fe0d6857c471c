"""The engine layer: tiers of caches and the replays that drive lookups through them.

``tiers`` (a tier, a hierarchy), ``replay`` (a whole stream), ``stepper`` (one serving step
at a time, with spatial sampling) and ``mrc`` (miss-ratio curves).
"""
