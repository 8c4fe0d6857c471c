"""cachelab: caching policy research for the Engram memory of large language models."""

__version__ = "0.1.0"
