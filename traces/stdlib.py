"""The Python standard library as a corpus: real code and real prose on every machine.

Each module gives two documents: its source (domain ``code``) and its docstrings joined
(domain ``docstring``). Files are read in sorted order so the corpus is deterministic for a
given Python version; test packages are skipped (generated data, not representative).
"""

from __future__ import annotations

import ast
import hashlib
import platform
import sysconfig
from collections.abc import Iterator
from functools import lru_cache
from pathlib import Path

from cachelab.errors import CachelabError
from cachelab.trace.corpus import Document

SKIP_PARTS = {"test", "tests", "idle_test", "site-packages", "__pycache__", "lib2to3"}


@lru_cache(maxsize=16)
def _tree_digest(root: Path) -> str:
    """SHA-256 of the names and sizes of the sources a corpus rooted at ``root`` reads, once a process."""
    corpus = StdlibCorpus(root=str(root))
    listing = "\n".join(f"{p.relative_to(root).as_posix()} {p.stat().st_size}" for p in corpus.files())
    return hashlib.sha256(listing.encode()).hexdigest()[:16]


class StdlibCorpus:
    """Standard-library sources and docstrings, up to ``max_chars`` of text in all."""

    name = "stdlib"

    def __init__(self, max_chars: int | None = None, root: str | None = None):
        if max_chars is not None and not max_chars > 0:
            raise CachelabError(f"max_chars must be a number of characters > 0, got {max_chars!r}")
        self.max_chars = max_chars
        self.given_root = root
        self.root = Path(root or sysconfig.get_paths()["stdlib"])

    def fingerprint(self) -> str:
        """What the corpus reads beyond its arguments, for an experiment's hashes
        (``cachelab.experiment.spec.workload_sources``): this Python's standard library (its version:
        another Python reads other sources), or the sources under a ``root`` given (names and sizes)."""
        python = f"{platform.python_implementation()} {platform.python_version()}"
        if self.given_root is None:
            return f"stdlib of {python}"
        return f"{python} {self.root}: {_tree_digest(self.root)}"

    def files(self) -> list[Path]:
        paths = [p for p in self.root.rglob("*.py") if not SKIP_PARTS & set(p.relative_to(self.root).parts)]
        return sorted(paths)

    def documents(self) -> Iterator[Document]:
        budget = self.max_chars
        for path in self.files():
            try:
                source = path.read_text(encoding="utf-8")
                tree = ast.parse(source)
            except (UnicodeDecodeError, SyntaxError, ValueError, RecursionError, MemoryError):
                # a few stdlib files are deliberately not valid UTF-8 or Python; a generated module of
                # one long expression (x = 1 + 1 + ..., nesting) is past the parser's depth (its errors)
                continue
            rel = path.relative_to(self.root).as_posix()
            docstrings = [ast.get_docstring(node, clean=True) for node in ast.walk(tree)
                          if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))]
            prose = "\n\n".join(d for d in docstrings if d)
            for domain, text in (("code", source), ("docstring", prose)):
                if not text:
                    continue
                if budget is not None:
                    if budget <= 0:
                        return
                    text = text[:budget]
                    budget -= len(text)
                yield Document(doc_id=f"{rel}#{domain}", domain=domain, text=text)
