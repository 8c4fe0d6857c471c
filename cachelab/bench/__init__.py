"""Measuring live servers: the load generator, the server's own metrics, the prefix-cache check."""
