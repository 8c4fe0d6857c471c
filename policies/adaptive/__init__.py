"""Adaptive policies: the balance of recency and frequency tuned online by ghost hits."""
