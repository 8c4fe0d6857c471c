"""The trace layer: the request table and everything that makes or reads one.

``schema`` (the versioned Arrow schema; its API is re-exported here, so ``cachelab.trace``
reads and writes traces as before the restructure), ``build`` (a workload spec and its
build), ``synthesis``, ``convert`` (oracleGeneral), ``stats``, ``keytrace`` (plain key
traces), ``ingest`` (line-by-line readers), and the plug-in contracts ``corpus`` and
``arrivals``.
"""

from cachelab.trace.schema import (COLUMNS, SCHEMA, SCHEMA_VERSION, TraceWriter, conform, read_trace,
                                   scan_trace, validate, write_chunks, write_trace)

__all__ = ["COLUMNS", "SCHEMA", "SCHEMA_VERSION", "TraceWriter", "conform", "read_trace", "scan_trace",
           "validate", "write_chunks", "write_trace"]
