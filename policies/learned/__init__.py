"""Learned policies: predicted next use decides eviction (LRB-style sampling), admission, and S3-FIFO promotion."""
