"""Kept so ``from cachelab.corpus import Corpus, Document`` (the path before the restructure)
still works; the contract lives in ``cachelab.trace.corpus``."""

from cachelab.trace.corpus import Corpus, Document

__all__ = ["Corpus", "Document"]
