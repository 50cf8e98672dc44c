"""Token <-> raw bytes, so API log-probs (token strings + ``bytes``) map back to local ids.

OpenAI-compatible servers report each token as a decoded string plus its UTF-8 ``bytes``. A
byte-level BPE token is a byte string (possibly a partial UTF-8 sequence, whose decoded string
is just U+FFFD), so the bytes, not the string, identify the token. :class:`TokenBytes` builds
the bytes of every id once (:func:`~distillgates.tokenizer.gpt2_byte_decoder`; added/special
tokens as their UTF-8 text) and the reverse map used by the HTTP client.

A teacher with *another* tokenizer: :func:`map_by_bytes` moves its top-k onto our tokens through
bytes (byte-prefix marginalisation, simplified). The student re-tokenizes the turn's text; at
each student token, starting at byte ``a``, the teacher token whose byte span holds ``a`` gives
the distribution:

- ``e`` = the bytes of that teacher token before ``a`` (empty where both tokenizations start a
  token at ``a``). Teacher candidates (its top-k plus the token it chose) whose bytes do not
  start with ``e``, or end within ``e``, are dropped; inside a teacher token (``e`` not empty)
  the rest are renormalised to sum to 1: the teacher's distribution conditioned on the bytes
  already written, from its top-k alone (its mass outside the top-k is unknown there).
- The chosen token's mass goes to the student's own token at this position (the text the
  teacher went on to write starts with it). Every other candidate's remaining bytes go to the
  student token whose bytes are the longest prefix of them; mass landing on the same student
  token is summed.
- A candidate no student token prefixes (a special token of the teacher's vocabulary, say) is
  *unmatched*: its mass is reported (``ByteMapped.unmatched``) and left out of the student ids,
  so the KD loss's rest bucket (:func:`distillgates.losses.topk_buckets`: one minus the listed
  mass) holds it together with the teacher's mass outside its top-k.

So every student position that falls in a turn the teacher gave log-probs for carries a teacher
distribution; ``mapped + unmatched`` equals the teacher's top-k mass (aligned positions) or 1
(positions inside a teacher token).
"""

from __future__ import annotations

import math
from bisect import bisect_right
from dataclasses import dataclass
from typing import Any

from distillgates.teacher.base import TurnResult
from distillgates.tokenizer import gpt2_byte_decoder


def api_token_bytes(token: str, token_bytes: list[int] | None) -> bytes:
    """An API token's raw bytes: its ``bytes`` field, else the UTF-8 of its string."""
    return bytes(token_bytes) if token_bytes is not None else token.encode()


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
        self.max_len = max(map(len, self.by_id), default=0)

    def token_string(self, token_id: int) -> str:
        return self.by_id[token_id].decode("utf-8", errors="replace")

    def lookup(self, token: str, token_bytes: list[int] | None) -> int | None:
        """Local id of an API token (bytes preferred over the lossy string); None if unknown."""
        return self.to_id.get(api_token_bytes(token, token_bytes))

    def longest_prefix(self, data: bytes) -> int | None:
        """The id whose bytes are the longest prefix of ``data``; None if none is."""
        for n in range(min(len(data), self.max_len), 0, -1):
            token_id = self.to_id.get(data[:n])
            if token_id is not None:
                return token_id
        return None


@dataclass
class TeacherToken:
    """One generated token of a teacher with another vocabulary, as bytes."""

    data: bytes  # the chosen token
    logprob: float  # its log-prob
    top: list[tuple[bytes, float]]  # the top-k alternatives: (bytes, log-prob)


@dataclass
class ByteMapped:
    """A turn on the student's tokens: ids of the text and, per id, the teacher's mapped top-k."""

    ids: list[int]
    topk_ids: list[list[int]]  # distinct student ids, most probable first
    topk_logprobs: list[list[float]]
    unmatched: list[float]  # per position: teacher mass that no student token takes (in the rest bucket)


def map_by_bytes(text: str, teacher: list[TeacherToken], ids: list[int], student: TokenBytes) -> ByteMapped | None:
    """The teacher's distributions moved onto the student's tokenization ``ids`` of ``text`` (module
    docstring); None when the teacher's or the student's token bytes do not spell ``text``."""
    data = text.encode()
    if b"".join(t.data for t in teacher) != data or b"".join(student.by_id[i] for i in ids) != data:
        return None
    starts, at = [], 0
    for t in teacher:
        starts.append(at)
        at += len(t.data)
    out = ByteMapped(ids=list(ids), topk_ids=[], topk_logprobs=[], unmatched=[])
    a = 0
    for own in ids:
        i = bisect_right(starts, a) - 1  # the last teacher token starting at or before a: it holds byte a
        top_ids, top_lps, unmatched = map_position(own, teacher[i], data[starts[i] : a], student)
        out.topk_ids.append(top_ids)
        out.topk_logprobs.append(top_lps)
        out.unmatched.append(unmatched)
        a += len(student.by_id[own])
    return out


def map_position(own: int, tok: TeacherToken, e: bytes, student: TokenBytes) -> tuple[list[int], list[float], float]:
    """One student position (module docstring): the student's token ``own`` starts ``len(e)`` bytes into the
    teacher's token ``tok`` (``e``: its bytes before). Returns the student ids (most probable first), their
    log-probs and the unmatched mass."""
    mass: dict[int, float] = {own: math.exp(tok.logprob)}
    unmatched = 0.0
    for cand, lp in tok.top:
        if cand == tok.data or not cand.startswith(e) or len(cand) <= len(e):
            continue  # the chosen token (counted above), or not a continuation of the bytes written
        sid = student.longest_prefix(cand[len(e) :])
        if sid is None:
            unmatched += math.exp(lp)
        else:
            mass[sid] = mass.get(sid, 0.0) + math.exp(lp)
    z = sum(mass.values()) + unmatched if e else 1.0
    ranked = sorted(mass.items(), key=lambda kv: (-kv[1], kv[0]))
    return [sid for sid, _ in ranked], [math.log(p / z) for _, p in ranked], unmatched / z


def map_turn(result: TurnResult, teacher: list[TeacherToken], tokenizer: Any, student: TokenBytes) -> None:
    """Put ``result`` (one turn, its ``text`` in the student's chat format) on the student's tokens of its
    text, each with the teacher's top-k moved onto it (:func:`map_by_bytes`). Where the teacher's bytes do
    not spell the text (it wrote calls otherwise than the student's template) ``result`` is left as it is:
    ``token_ids`` None, text-only KD for the turn. The one owner of this step for the API teacher
    (:mod:`.http`) and a local teacher with another tokenizer (:class:`~.local.StudentTokensTeacher`)."""
    ids = tokenizer.encode(result.text, add_special_tokens=False)
    mapped = map_by_bytes(result.text, teacher, ids, student)
    if mapped is not None:
        result.token_ids, result.topk_ids, result.topk_logprobs = mapped.ids, mapped.topk_ids, mapped.topk_logprobs
