"""Learned policies: predicted next use decides eviction (LRB-style sampling), admission, S3-FIFO promotion, and LFU's priority."""
