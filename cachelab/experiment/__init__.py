"""Experiments: a TOML spec, a grid of points, a runner that tracks each point in MLflow.

``spec`` validates a spec before any work; ``sweep`` expands it into hashed points;
``kinds`` is the contract of an experiment kind, found through the
``cachelab.experiment_kinds`` entry points (``points`` holds the built-ins: resolved config
in, metrics and artifacts out); ``runner`` builds shared inputs once, skips finished points,
and dispatches the rest to a ``backends`` pool; ``report`` turns the tracked runs into one
HTML page. Imports run one way: spec -> sweep -> workload -> points -> backends -> report ->
runner.
"""
