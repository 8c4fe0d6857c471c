"""Policies that evict by an estimated reuse distance."""
