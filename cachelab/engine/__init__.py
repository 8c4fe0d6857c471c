"""The engine layer: tiers of caches and the replays that drive lookups through them.

``tiers`` (a tier, a hierarchy), ``cascade`` (the one tier cascade both replays serve
through), ``replay`` (a whole stream), ``stepper`` (one serving step at a time, with spatial
sampling), ``stats`` (typed results), ``sampling`` (the one sampling hash) and ``mrc``
(miss-ratio curves).
"""
