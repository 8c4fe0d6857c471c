"""Policies with a probationary queue in front of the main one."""
