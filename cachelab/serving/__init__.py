"""The serving layer: from lookups and tier hits to step times, latency, throughput and cost.

``model_spec`` and ``hardware`` (what runs, on what), ``latency`` (the step-time model),
``metrics`` (vLLM's definitions), ``simulator`` (the discrete-event replay), ``grid`` and
``pareto`` (sweeps and fronts) and ``studies`` (published results reproduced).
"""
