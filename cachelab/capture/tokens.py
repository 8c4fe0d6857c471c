"""The tokenizer fallback: token ids from text when the upstream does not return them.

An upstream without vLLM's ``return_token_ids`` (SGLang, a hosted API) answers text only;
the recorder then tokenizes the prompt and the output with the model's HF tokenizer
(``tokenizers``; ``deepseek-v4`` by default, or any ``tokenizer.json``). A prompt is
encoded with the tokenizer's own special tokens (its post-processor, as a HF fast
tokenizer does for a server); an output without them. A chat prompt is its messages'
``role: content`` lines: the chat template is the server's, so such ids approximate it,
and the record says ``token_source = "tokenizer"``. An answer's text is tokenized up to
``max_chars`` (``MAX_TOKENIZE_CHARS``): the writer tokenizes about a MiB a second, so a 64 MiB answer
held the records behind it for minutes, and they were dropped once the backlog filled.
"""

from __future__ import annotations

from cachelab.engram.vocab import DEEPSEEK_V4, load_tokenizer, token_ids
from cachelab.errors import CachelabError

MAX_TOKENIZE_CHARS = 4 << 20  # characters of text one exchange may have tokenized (``--max-tokenize-mb``)


class FallbackTokenizer:
    """Loads the tokenizer on first use (a capture whose upstream returns ids never loads it)."""

    def __init__(self, source: str = DEEPSEEK_V4, max_chars: int = MAX_TOKENIZE_CHARS):
        self.source, self.max_chars = source, max_chars
        self._tok = None

    def _loaded(self):
        if self._tok is None:
            self._tok = load_tokenizer(self.source)
        return self._tok

    def encode(self, text: str, prompt: bool = False) -> list[int]:
        """Off the proxy's event loop (the journal's thread), and without the GIL (``token_ids``). A lone
        surrogate (an upstream's or a client's JSON ``"\\ud800"``) is tokenized as ``?``, as the record
        stores such text: the tokenizer refused it, which lost the record."""
        try:
            return token_ids(self._loaded(), [text], add_special_tokens=prompt)[0]
        except CachelabError:  # ``token_ids`` names the surrogate
            return token_ids(self._loaded(), [text.encode(errors="replace").decode()], add_special_tokens=prompt)[0]

    def decode(self, ids: list[int], special: bool = False) -> str:
        """The text of ``ids``, as a server decodes a prompt sent as ids to echo it: vLLM keeps the
        special tokens (``special``), a bare ``tokenizers`` decode leaves them out."""
        return self._loaded().decode_batch([ids], skip_special_tokens=not special)[0]  # the GIL let go, as encode
