"""Prompt corpora with domain labels, read from the data root (nothing is downloaded).

Each class is a ``cachelab.workloads`` corpus: ``documents()`` yields the source's records in
file order, deterministically. Sources and licenses are listed in docs/traces.md.
"""

from __future__ import annotations

import csv
from collections.abc import Iterator
from pathlib import Path

from cachelab.trace.corpus import Document
from cachelab.errors import CachelabError
from cachelab.trace.ingest import Ingest
from cachelab.paths import data_root


def _root(root: str | None) -> Path:
    return Path(root) if root else data_root()


def _is_text(value) -> bool:
    return isinstance(value, str)


def _is_texts(value) -> bool:
    return isinstance(value, list) and bool(value) and all(isinstance(v, str) for v in value)


def _is_instances(value) -> bool:
    """Alpaca's ``instances``: a list of objects whose ``input`` and ``output`` are text where given."""
    return isinstance(value, list) and all(isinstance(i, dict) and all(isinstance(i.get(k, ""), str)
                                                                       for k in ("input", "output")) for i in value)


_KINDS = {_is_text: "text", _is_texts: "a non-empty list of texts", _is_instances:
          "a list of objects with text input and output", None: "an id"}


def _records(path: Path, fields: dict, optional: dict | None = None) -> Iterator[tuple[int, dict]]:
    """JSON objects of a JSONL file with the required ``fields``, each passing its check (None: any
    value but null), and the ``optional`` ones passing theirs where given and not null; errors name
    file, line and field (a prompt of 5 reached the tokenizer as a TypeError traceback, a string
    of turns was read letter by letter)."""
    ingest = Ingest(path, skippable=False)  # --skip-bad skips arrival rows, never a corpus's
    for line, record in ingest.json_lines():
        if not isinstance(record, dict):
            ingest.bad(line, f"expected an object with fields {list(fields)}")
            continue
        missing = [f for f in fields if f not in record]
        if missing:  # named: the list of every field required left the reader to find which
            ingest.bad(line, f"missing field(s) {missing} (an object with fields {list(fields)} expected)")
            continue
        checks = {**fields, **{k: c for k, c in (optional or {}).items() if record.get(k) is not None}}
        repeated = [k for k in checks if k in getattr(record, "repeated", ())]
        if repeated:  # json keeps the last value: which one the source meant is a guess
            ingest.bad(line, f"field(s) {repeated} given more than once")
            continue
        wrong = next((k for k, c in checks.items() if record[k] is None or (c is not None and not c(record[k]))), None)
        if wrong is not None:
            ingest.bad(line, f"field {wrong!r}: expected {_KINDS[checks[wrong]]}, got {str(record[wrong])[:60]!r}")
            continue
        yield line, record


class ArenaHard:
    """Arena-Hard-Auto prompts (lmarena/arena-hard-auto): real Chatbot Arena user prompts.

    ``version`` ``v2.0`` (750: coding, math, creative_writing), ``v0.1`` (500, domain
    ``hard_prompt``) or ``all``.
    """

    name = "arena-hard"
    FILES = {"v2.0": "prompts/arena_hard/arena-hard-v2.0_question.jsonl",
             "v0.1": "prompts/arena_hard/arena-hard-v0.1_question.jsonl"}

    def __init__(self, version: str = "v2.0", root: str | None = None):
        if version not in (*self.FILES, "all"):
            raise CachelabError(f"arena-hard version {version!r}: choose v2.0, v0.1 or all")
        self.version, self.root = version, root

    def documents(self) -> Iterator[Document]:
        versions = list(self.FILES) if self.version == "all" else [self.version]
        for version in versions:
            for _, r in _records(_root(self.root) / self.FILES[version], {"uid": None, "prompt": _is_text},
                                 {"category": _is_text, "subcategory": _is_text}):
                domain = r.get("subcategory") or ("hard_prompt" if version == "v0.1" else r.get("category", "chat"))
                yield Document(f"arena-hard-{version}/{r['uid']}", domain, r["prompt"])


class _FastChatBench:
    """FastChat's question.jsonl format: ``question_id``, ``category``, ``turns``, optional ``reference``."""

    name = ""
    FILE = ""

    def __init__(self, root: str | None = None):
        self.root = root

    def documents(self) -> Iterator[Document]:
        for _, r in _records(_root(self.root) / self.FILE, {"question_id": None, "category": _is_text,
                                                          "turns": _is_texts}, {"reference": _is_texts}):
            turns = tuple(r["turns"])
            yield Document(f"{self.name}/{r['question_id']}", r["category"], turns[0], turns=turns,
                           answers=tuple(r.get("reference") or ()))


class MTBench(_FastChatBench):
    """MT-bench (lm-sys/FastChat): 80 two-turn questions in 8 categories; references for some."""

    name = "mt-bench"
    FILE = "prompts/mt_bench/question.jsonl"


class VicunaBench(_FastChatBench):
    """Vicuna bench (lm-sys/FastChat): 80 single-turn questions in 9 categories."""

    name = "vicuna-bench"
    FILE = "prompts/vicuna_bench/question.jsonl"


class GSM8K:
    """GSM8K (openai/grade-school-math) math word problems with worked solutions as answers."""

    name = "gsm8k"

    def __init__(self, split: str = "test", root: str | None = None):
        if split not in ("test", "train"):
            raise CachelabError(f"gsm8k split {split!r}: choose test or train")
        self.split, self.root = split, root

    def documents(self) -> Iterator[Document]:
        path = _root(self.root) / f"prompts/gsm8k/{self.split}.jsonl"
        for line, r in _records(path, {"question": _is_text, "answer": _is_text}):
            yield Document(f"gsm8k-{self.split}/{line}", "math", r["question"], answers=(r["answer"],))


class HumanEval:
    """HumanEval (openai/human-eval): 164 Python problems; the canonical solution is the answer."""

    name = "humaneval"

    def __init__(self, root: str | None = None):
        self.root = root

    def documents(self) -> Iterator[Document]:
        path = _root(self.root) / "prompts/humaneval/HumanEval.jsonl.gz"
        for _, r in _records(path, {"task_id": None, "prompt": _is_text, "canonical_solution": _is_text}):
            yield Document(r["task_id"], "code", r["prompt"], answers=(r["canonical_solution"],))


class AlpacaSeed:
    """The 175 Self-Instruct seed tasks of Stanford Alpaca; the first instance's output is the answer."""

    name = "alpaca-seed"

    def __init__(self, root: str | None = None):
        self.root = root

    def documents(self) -> Iterator[Document]:
        path = _root(self.root) / "prompts/alpaca_seed/seed_tasks.jsonl"
        for _, r in _records(path, {"id": None, "instruction": _is_text, "instances": _is_instances}):
            first = (r["instances"] or [{}])[0]
            prompt = r["instruction"] + (f"\n\n{first['input']}" if first.get("input") else "")
            yield Document(r["id"], "instruction", prompt,
                           answers=(first["output"],) if first.get("output") else ())


def _text(path: Path) -> str:
    """A text file's content (a UTF-8 byte-order mark dropped); a byte that is not UTF-8 is an
    error naming the file, its line and offset, not a UnicodeDecodeError traceback."""
    if not path.is_file():
        raise CachelabError(f"data file not found: {path}")
    data = path.read_bytes()
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        line = data.count(b"\n", 0, exc.start) + 1
        raise CachelabError(f"{path}:{line}: not UTF-8 (byte {exc.start}: "
                            f"{data[exc.start:exc.start + 1]!r})") from None


def passages(text: str, max_chars: int) -> list[str]:
    """Consecutive paragraphs grouped into passages of about ``max_chars`` (never splitting one)."""
    out, current = [], []
    size = 0
    for para in text.split("\n\n"):
        if current and size + len(para) > max_chars:
            out.append("\n\n".join(current))
            current, size = [], 0
        current.append(para)
        size += len(para) + 2
    if current:
        out.append("\n\n".join(current))
    return [p for p in out if p.strip()]


def _book_body(text: str) -> str:
    """The text between Project Gutenberg's START and END markers (the licence stays out)."""
    start, end = text.find("*** START OF"), text.find("*** END OF")
    start = start if start >= 0 else text.find("***START OF")
    end = end if end >= 0 else text.find("***END OF")
    if start >= 0:
        text = text[text.find("\n", start) + 1:end if end > start else None]
    return text


class Gutenberg:
    """Project Gutenberg novels, cut into passages in reading order (domain ``prose``).

    In reading order, the text after a passage is its real continuation, which synthesis
    uses as the output of a prompt drawn from the passage.
    """

    name = "gutenberg"

    def __init__(self, passage_chars: int = 4000, root: str | None = None):
        self.passage_chars, self.root = passage_chars, root

    def books(self) -> list[Path]:
        folder = _root(self.root) / "prompts/gutenberg"
        names = [row[0].strip() for row in csv.reader(_text(folder / "MANIFEST.csv").splitlines()) if row][1:]
        return [folder / n for n in names if (folder / n).is_file()]  # a blank row was an IndexError

    def documents(self) -> Iterator[Document]:
        for book in self.books():
            body = _book_body(_text(book))
            for i, passage in enumerate(passages(body, self.passage_chars)):
                yield Document(f"{book.name}#{i}", "prose", passage)


class TinyShakespeare:
    """Karpathy's tiny Shakespeare (1.1 MB of plays), cut into passages in order (domain ``prose``)."""

    name = "tinyshakespeare"

    def __init__(self, passage_chars: int = 4000, root: str | None = None):
        self.passage_chars, self.root = passage_chars, root

    def documents(self) -> Iterator[Document]:
        text = _text(_root(self.root) / "prompts/tinyshakespeare/input.txt")
        for i, passage in enumerate(passages(text, self.passage_chars)):
            yield Document(f"tinyshakespeare#{i}", "prose", passage)


def non_latin_share(text: str) -> float:
    """The share of a text's letters outside ASCII (CJK, Cyrillic, kana, ...): 0 for English."""
    letters = [c for c in text if c.isalpha()]
    return sum(ord(c) > 127 for c in letters) / len(letters) if letters else 0.0


class ArenaHardNonEnglish(ArenaHard):
    """The Arena-Hard prompts written mostly in non-Latin scripts (more than half of the letters).

    In v2.0 these are 131 prompts (Chinese and Japanese 73, Russian and other Cyrillic 51, a few
    others), all outside its first 150 (which are English coding prompts), so a model trained on
    those has never read them: the non-English held-out domain of docs/learned.md. The domain
    label stays Arena-Hard's.
    """

    name = "arena-hard-non-english"

    def __init__(self, version: str = "v2.0", min_share: float = 0.5, root: str | None = None):
        super().__init__(version, root)
        self.min_share = min_share

    def documents(self) -> Iterator[Document]:
        return (doc for doc in super().documents() if non_latin_share(doc.text) > self.min_share)
