"""Policies whose admission asks a frequency sketch (the TinyLFU family)."""
