"""Capture from live serving: a recorder, durable segments, an OpenAI proxy, vLLM's KV events.

``Recorder`` (recorder.py) is the API a server records through; ``segments.py`` and
``journal.py`` make its records durable; ``proxy.py`` puts it in front of any
OpenAI-compatible server; ``kv_events.py`` subscribes to vLLM's prefix-cache events;
``to_trace.py`` turns a capture into a request trace. Formats and privacy: docs/capture.md.
"""
