"""What a ``--trace`` names: a key trace, a request trace, a lookup stream, or corpus names.

Every verb's ``--trace`` is read here first, so it means the same everywhere: ``detect``
looks at the file's content (or, for a value that is no file, at the registered corpora)
and names what it found; a verb then converts it to the kind it works on, or says what it
found and what it needs. The four kinds:

- key trace: one integer key per request (``.npy``, text, libCacheSim oracleGeneral;
  ``cachelab.trace.keytrace`` sniffs which);
- request trace: the versioned request table (``.parquet``, ``cachelab trace build``), with
  arrival times, lengths and, when built with a corpus, token ids;
- lookup stream: Engram row lookups grouped into serving steps (``.npz``,
  ``cachelab trace lookups``);
- corpus names: registered text corpora, comma-separated (``gsm8k,humaneval``).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from cachelab import registry
from cachelab.errors import CachelabError
from cachelab.trace.keytrace import sniff_format

KEY, REQUESTS, LOOKUPS, CORPORA = "key trace", "request trace", "lookup stream", "corpus names"
_FORMAT_NAMES = {"npy": ".npy array", "txt": "text, one key per line", "oracle": "libCacheSim oracleGeneral"}
_PARQUET, _ZIP = b"PAR1", b"PK\x03\x04"


@dataclass(frozen=True, slots=True)
class Found:
    """What a ``--trace`` value is: its kind, how it is stored, and the value itself."""

    kind: str  # KEY, REQUESTS, LOOKUPS or CORPORA
    form: str  # e.g. "libCacheSim oracleGeneral", ".parquet", ".npz", "gsm8k, humaneval"
    value: str
    key_format: str | None = None  # a key trace's keytrace format (npy, txt, oracle)

    def __str__(self) -> str:
        return f"a {self.kind} ({self.form})" if self.kind != CORPORA else f"corpus names ({self.form})"

    @property
    def path(self) -> Path:
        return Path(self.value)

    @property
    def corpora(self) -> list[str]:
        return [n.strip() for n in self.value.split(",") if n.strip()]


def corpus_names() -> list[str]:
    """Registered workloads that yield text documents (``cachelab.workloads`` corpora)."""
    return sorted(p.name for p in registry.discover(registry.WORKLOADS)
                  if p.obj is not None and hasattr(p.obj, "documents"))


def detect(value: str | Path, fmt: str | None = None, where: str = "--trace") -> Found:
    """What ``value`` names, from its content (``fmt`` forces a key-trace format)."""
    text = str(value)
    path = Path(text)
    if path.is_dir():
        raise CachelabError(f"{where} {text}: is a folder; give a trace file or corpus names")
    if path.is_file():
        with open(path, "rb") as f:
            head = f.read(4)
        found = {_PARQUET: Found(REQUESTS, ".parquet", text), _ZIP: Found(LOOKUPS, ".npz", text)}.get(head)
        if found is not None and fmt is not None:  # read as keys, its bytes made errors about line 1 or a pickle
            raise CachelabError(f"{where} {text}: --format {fmt} declares a key trace, but this is {found}; "
                                "leave --format out")
        if fmt is not None:
            return Found(KEY, _FORMAT_NAMES.get(fmt, fmt), text, fmt)
        if found is not None:
            return found
        key_format = sniff_format(path)
        return Found(KEY, _FORMAT_NAMES[key_format], text, key_format)
    names = [n.strip() for n in text.split(",") if n.strip()]
    known = corpus_names()
    unknown = [n for n in names if n not in known]
    if names and not unknown:
        return Found(CORPORA, ", ".join(names), text)
    if "/" in text or "." in path.name:  # meant as a file
        raise CachelabError(f"{where} {text}: no such file")
    raise CachelabError(f"{where} {text}: no such file, and {', '.join(map(repr, unknown)) or 'nothing'} not a "
                        f"registered corpus (corpora: {', '.join(known)}; or give a trace file)")

def wrong_kind(found: Found, verb: str, needs: str, hint: str, where: str = "--trace") -> CachelabError:
    """The error for a trace of a kind ``verb`` cannot use: what was found, what it needs, how to get it."""
    return CachelabError(f"{where} {found.value}: found {found}; `cachelab {verb}` needs {needs}. {hint}")


# the flags that shape how each kind becomes a lookup stream (`trace lookups`, simulate, mrc, store bench)
APPLIES = {CORPORA: {"--requests", "--seed", "--preset", "--steps"}, REQUESTS: {"--requests", "--preset", "--steps"},
           KEY: {"--requests"}, LOOKUPS: set()}

# what --requests (simulate, mrc, train, evaluate, trace lookups, store bench) takes of each kind
REQUESTS_TAKE = {CORPORA: "corpus names take N >= 1 requests per corpus",
                 REQUESTS: "a request trace takes its first N requests, N >= 1 (0: all)",
                 KEY: "a key trace takes its first N keys, N >= 1 (0: every key)",
                 LOOKUPS: "a saved lookup stream is read whole, and N is never negative"}


def refuse_unused(found: Found, given: dict) -> None:
    """A flag that does nothing for this kind of trace (``given``: flag -> value, None when not
    given) is an error, not silently ignored (a key trace's --requests 5 replayed every key;
    --steps serving one key per step all the same)."""
    unused = [flag for flag, value in given.items() if value is not None and flag not in APPLIES[found.kind]]
    if unused:
        takes = (f"it takes only {', '.join(sorted(APPLIES[found.kind]))}" if APPLIES[found.kind]
                 else "a lookup stream is saved as it is")
        raise CachelabError(f"TRACE {found.value}: {found}: {', '.join(unused)} "
                            f"{'does' if len(unused) == 1 else 'do'} not apply to it ({takes})")


def requests_or_default(found: Found, requests: int | None) -> int:
    """``--requests`` as given, else its default for the kind: every key of a key trace (0), 200
    requests otherwise (per corpus, or a request trace's first)."""
    if requests is not None:
        return requests
    return 0 if found.kind == KEY else 200
