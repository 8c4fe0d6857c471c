"""The trace layer: the request table and everything that makes or reads one.

``schema`` (the versioned Arrow schema; its API is re-exported here, so ``cachelab.trace``
reads and writes traces as before the restructure), ``build`` (a workload spec and its
build), ``synthesis``, ``convert`` (oracleGeneral), ``stats``, ``keytrace`` (plain key
traces), ``ingest`` (line-by-line readers), and the plug-in contracts ``corpus`` and
``arrivals``.

The re-exports import ``schema`` (Arrow and Polars) on first use, not with the package: a
module of the layer that needs neither (``keytrace``, read by ``cachelab simulate`` on every
key trace) is imported without them.
"""

__all__ = ["COLUMNS", "SCHEMA", "SCHEMA_VERSION", "TraceWriter", "conform", "read_trace", "scan_trace",
           "validate", "write_chunks", "write_trace"]


def __getattr__(name: str):
    if name not in __all__:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    from cachelab.trace import schema

    return getattr(schema, name)
