"""Token <-> raw bytes, so API log-probs (token strings + ``bytes``) map back to local ids.

OpenAI-compatible servers report each token as a decoded string plus its UTF-8 ``bytes``. A
byte-level BPE token is a byte string (possibly a partial UTF-8 sequence, whose decoded string
is just U+FFFD), so the bytes, not the string, identify the token. :class:`TokenBytes` builds
the bytes of every id once (:func:`~distillgates.tokenizer.gpt2_byte_decoder`; added/special
tokens as their UTF-8 text) and the reverse map used by the HTTP client.
"""

from __future__ import annotations

from typing import Any

from distillgates.tokenizer import gpt2_byte_decoder


class TokenBytes:
    """Bytes of each token id of a (byte-level BPE) tokenizer, and the reverse map."""

    def __init__(self, tokenizer: Any) -> None:
        decoder = gpt2_byte_decoder()
        added = {int(i) for i in getattr(tokenizer, "added_tokens_decoder", {})}
        self.by_id: list[bytes] = []
        for i in range(len(tokenizer)):
            piece = tokenizer.convert_ids_to_tokens(i)
            if i not in added and piece is not None and all(ch in decoder for ch in piece):
                self.by_id.append(bytes(decoder[ch] for ch in piece))
            else:  # special/added token, or a non-byte-level vocabulary: its text
                self.by_id.append(tokenizer.decode([i], clean_up_tokenization_spaces=False).encode())
        self.to_id: dict[bytes, int] = {}
        for i, b in enumerate(self.by_id):
            self.to_id.setdefault(b, i)  # first id wins for (rare) duplicate byte strings

    def token_string(self, token_id: int) -> str:
        return self.by_id[token_id].decode("utf-8", errors="replace")

    def lookup(self, token: str, token_bytes: list[int] | None) -> int | None:
        """Local id of an API token (bytes preferred over the lossy string); None if unknown."""
        key = bytes(token_bytes) if token_bytes is not None else token.encode()
        return self.to_id.get(key)
