"""Offline optima: Belady's MIN, with bypass, and seen through a lookahead window."""
