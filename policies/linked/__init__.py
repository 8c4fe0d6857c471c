"""Queue-ordered policies: recency, insertion order, second chance, sieving, frequency."""
