"""The API-key check of an OpenAI-compatible endpoint, made as vLLM makes it.

``Authorization: Bearer KEY``, the scheme in any case (RFC 9110's), the key's SHA-256 digest
compared with the expected one's in constant time: a plain comparison tells a timing attacker
how much of a guess was right, and an exact ``Bearer KEY`` refused a client that vLLM accepts.
``cachelab serve --api-key`` and the capture proxy's ``--api-key`` share it, so a client that
passes one passes the other.
"""

from __future__ import annotations

import hashlib
import secrets


class ApiKey:
    def __init__(self, key: str):
        self._digest = hashlib.sha256(key.encode()).digest()

    def accepts(self, authorization: bytes | str | None) -> bool:
        """Whether an ``Authorization`` header's value (its bytes, or text decoded as latin-1, as
        Starlette decodes headers) carries the key."""
        raw = authorization.encode("latin-1") if isinstance(authorization, str) else authorization or b""
        scheme, _, key = raw.partition(b" ")
        return secrets.compare_digest(hashlib.sha256(key).digest(), self._digest) and scheme.lower() == b"bearer"
