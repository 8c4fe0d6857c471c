"""Learned policies: predicted next use decides eviction (LRB-style sampling) and admission."""
