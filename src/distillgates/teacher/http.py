"""OpenAI-compatible chat-completions teacher (vLLM, OpenAI, Moonshot/Kimi, the loopback server).

Design choices:
- ``httpx`` directly rather than the ``openai`` SDK: retries, ``Retry-After`` and the
  determinism rule ("any retry is an error") must be ours, and the SDK would retry on its own.
- Retries: 429/500/502/503/504, timeouts, dropped connections and malformed bodies are
  retryable; other 4xx are not. Wait = full-jitter exponential backoff
  ``uniform(0, min(cap, base * 2**attempt))``, raised to ``Retry-After`` when a 429/503 sends it.
- Rate limit: a token bucket on requests/s shared by all calls of one client.
- Determinism mode: temperature 0, top_p 1, a fixed seed, no retries; the first retryable
  failure raises :class:`DeterminismError`, and a response without a request id is refused.
- The API key is read from the env var named by ``teacher.api.api_key_env`` into a
  :class:`Secret` whose ``repr``/``str`` are masked; every error message goes through
  :meth:`HTTPTeacher.redact`. It is sent only in the ``Authorization`` header.
- The request is a real chat-completions request: the conversation as OpenAI chat messages
  (:func:`.messages.openai_messages`: assistant ``tool_calls`` with ids and JSON-string arguments,
  ``tool`` messages with the ``tool_call_id`` they answer), the item's ``tools`` in the
  ``{"type": "function", "function": {...}}`` wrapper, and ``logprobs``/``top_logprobs`` unless
  ``teacher.api.logprobs`` is false. No ``stop``: the server ends the turn at its own model's end of
  turn (the student's end-of-turn token means nothing to a teacher with another chat format).
- The response's message (``content``, ``tool_calls``: several are parallel calls) is kept as it
  came in ``TurnResult.content`` / ``tool_calls`` (ids included), and ``text`` is that message in
  the *student's* chat format: rendered by the student's template
  (:meth:`~distillgates.data.chat.ChatFormat.assistant_text`; ChatML: ``<tool_call>`` blocks, all
  calls in one turn; toy: ``content<|tool_call|>{call}``, one call per turn). So the KD text is in
  the student's format whatever the teacher's.
- Log-probs: a server that answers text without the log-probs it was asked for is an error (it
  would leave a KD set with no teacher distribution that claims to have one): such a server needs
  ``teacher.api.logprobs: false``. API tokens map to local ids through their ``bytes``
  (:mod:`.tokens`); top-k alternatives that do not map are dropped (log-probs kept as reported, not
  renormalized). If a chosen token is not one of ours (a teacher with another tokenizer), the
  content is re-tokenized with ours and the teacher's top-k is moved onto our tokens through bytes
  (:func:`~distillgates.teacher.tokens.map_by_bytes`; ``map_bytes=False`` keeps the old rule: that
  turn is text-only). If there are no log-probs (``logprobs`` off), the text is several turns, or
  the teacher's token bytes do not spell the text (the teacher writes calls in another format, or
  lays them out otherwise than the student's template), the turn is returned with
  ``token_ids=None`` and no top-k (text-only KD for that turn). A teacher in the student's format
  (the same template) spells it: answers and calls keep the teacher's distribution.
"""

from __future__ import annotations

import email.utils
import json
import logging
import os
import random
import threading
import time
from collections.abc import Callable
from typing import Any

import httpx

from distillgates.config import APIConfig
from distillgates.data.chat import chat_format
from distillgates.teacher.base import TurnResult
from distillgates.teacher.messages import openai_messages
from distillgates.teacher.tokens import TeacherToken, TokenBytes, api_token_bytes, map_turn

log = logging.getLogger(__name__)

RETRYABLE_STATUS = (429, 500, 502, 503, 504)


class TeacherHTTPError(RuntimeError):
    """The API failed for good (non-retryable status, or retries exhausted)."""


class DeterminismError(TeacherHTTPError):
    """Determinism mode saw something that would need a retry, or a response it cannot pin down."""


class _Retryable(Exception):
    def __init__(self, reason: str, retry_after: float | None = None) -> None:
        super().__init__(reason)
        self.reason = reason
        self.retry_after = retry_after


class Secret:
    """A string that never prints itself."""

    def __init__(self, value: str) -> None:
        self._value = value

    def get(self) -> str:
        return self._value

    def __repr__(self) -> str:
        return "Secret('***')"

    __str__ = __repr__


class RateLimiter:
    """Token bucket: ``rate`` requests/s, bursts up to ``burst``; ``rate <= 0`` disables it."""

    def __init__(
        self,
        rate: float,
        burst: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        self.rate, self.burst, self.clock, self.sleep = rate, burst, clock, sleep
        self.tokens = burst
        self.last = clock()
        self._lock = threading.Lock()

    def acquire(self) -> float:
        """Take one token, sleeping until one is available; returns the seconds waited."""
        if self.rate <= 0:
            return 0.0
        with self._lock:
            now = self.clock()
            self.tokens = min(self.burst, self.tokens + (now - self.last) * self.rate)
            self.last = now
            wait = 0.0 if self.tokens >= 1 else (1 - self.tokens) / self.rate
            self.tokens -= 1  # may go negative: the debt is paid by the sleep below
        if wait > 0:
            self.sleep(wait)
        return wait


def parse_retry_after(value: str | None, now: float | None = None) -> float | None:
    """``Retry-After`` as seconds: delta-seconds or an HTTP date; None if absent/unparsable."""
    if not value:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    return max(0.0, when.timestamp() - (time.time() if now is None else now))


class HTTPTeacher:
    """Chat-completions teacher; see the module docstring for the retry/determinism rules."""

    def __init__(
        self,
        cfg: APIConfig,
        tokenizer: Any,
        *,
        api_key: str | None = None,
        sleep: Callable[[float], None] = time.sleep,
        transport: httpx.BaseTransport | None = None,
        map_bytes: bool = True,
    ) -> None:
        if not cfg.base_url:
            raise ValueError("teacher.api.base_url is required for the HTTP teacher")
        key = api_key if api_key is not None else os.environ.get(cfg.api_key_env, "")
        self._key = Secret(key)
        self.cfg = cfg
        self.tokenizer = tokenizer  # the student's: the turns come back in its chat format and on its tokens
        self.chat_format = chat_format(tokenizer)
        self.token_bytes = TokenBytes(tokenizer)
        self.map_bytes = map_bytes  # another tokenizer's top-k through bytes (False: text-only KD)
        self.model_name = cfg.model_name or "default"
        self.model_id = f"openai:{cfg.base_url.rstrip('/')}:{self.model_name}"
        self.sleep = sleep
        self.limiter = RateLimiter(cfg.rate_limit_rps, sleep=sleep)
        self.retries_done = 0  # total retries over the client's life (reported by the KD builder)
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        self._client = httpx.Client(
            base_url=cfg.base_url.rstrip("/") + "/", headers=headers, timeout=cfg.timeout_s, transport=transport
        )

    def __repr__(self) -> str:
        return f"HTTPTeacher(model_id={self.model_id!r}, determinism={self.cfg.determinism}, api_key=***)"

    def close(self) -> None:
        self._client.close()

    def redact(self, text: str) -> str:
        key = self._key.get()
        return text.replace(key, "***") if key else text

    def payload(
        self,
        messages: list[dict[str, Any]],
        *,
        max_new_tokens: int,
        top_k: int,
        temperature: float = 0.0,
        tools: list[dict[str, Any]] | None = None,
    ) -> dict[str, Any]:
        """The request body (also the response-cache key material, with the model id)."""
        body: dict[str, Any] = {
            "model": self.model_name,
            "messages": openai_messages(messages, self.chat_format),
            "max_tokens": max_new_tokens,
            "temperature": temperature,
        }
        if tools:
            body["tools"] = [{"type": "function", "function": dict(tool)} for tool in tools]
        if self.cfg.logprobs:
            body |= {"logprobs": True, "top_logprobs": top_k}
        if self.cfg.determinism:
            body |= {"temperature": 0.0, "top_p": 1.0, "seed": 0}
        return body

    def complete(
        self,
        messages: list[dict[str, Any]],
        *,
        max_new_tokens: int,
        top_k: int,
        temperature: float = 0.0,
        tools: list[dict[str, Any]] | None = None,
    ) -> TurnResult:
        body = self.payload(messages, max_new_tokens=max_new_tokens, top_k=top_k, temperature=temperature, tools=tools)
        attempts = 1 if self.cfg.determinism else self.cfg.max_retries + 1
        for attempt in range(attempts):
            self.limiter.acquire()
            try:
                return self._once(body)
            except _Retryable as failure:
                reason = self.redact(failure.reason)
                if self.cfg.determinism:
                    raise DeterminismError(
                        f"determinism mode: request to {self.model_id} failed ({reason}); retries are not allowed"
                    ) from None
                if attempt == attempts - 1:
                    raise TeacherHTTPError(f"{self.model_id}: giving up after {attempts} attempts: {reason}") from None
                cap = min(self.cfg.backoff_max_s, self.cfg.backoff_base_s * 2**attempt)
                wait = random.uniform(0, cap)
                if failure.retry_after is not None:
                    wait = max(wait, failure.retry_after)
                self.retries_done += 1
                log.warning(
                    "teacher request failed (%s); retry %d/%d in %.2fs", reason, attempt + 1, attempts - 1, wait
                )
                self.sleep(wait)
        raise AssertionError("unreachable")

    def _once(self, body: dict[str, Any]) -> TurnResult:
        try:
            response = self._client.post("chat/completions", json=body)
        except httpx.TimeoutException as err:
            raise _Retryable(f"timeout after {self.cfg.timeout_s}s ({type(err).__name__})") from None
        except httpx.TransportError as err:
            raise _Retryable(f"transport error: {type(err).__name__}: {err}") from None
        status = response.status_code
        if status in RETRYABLE_STATUS:
            retry_after = parse_retry_after(response.headers.get("retry-after")) if status in (429, 503) else None
            raise _Retryable(f"HTTP {status}", retry_after)
        if status >= 400:
            raise TeacherHTTPError(self.redact(f"{self.model_id}: HTTP {status}: {response.text[:500]}"))
        try:
            data = response.json()
            result = self._parse(data)
        except (json.JSONDecodeError, UnicodeDecodeError, KeyError, IndexError, TypeError, ValueError) as err:
            raise _Retryable(f"malformed response body ({type(err).__name__}: {err})") from None
        request_id = response.headers.get("x-request-id") or data.get("id") or ""
        if self.cfg.determinism and not request_id:
            raise DeterminismError(f"determinism mode: {self.model_id} returned no request id")
        result.request_id = request_id
        return result

    def _parse(self, data: dict[str, Any]) -> TurnResult:
        choice = data["choices"][0]
        message = choice["message"]
        content = message.get("content") or ""
        if not isinstance(content, str):
            raise TypeError("choices[0].message.content is not a string")
        calls = []
        for raw in message.get("tool_calls") or []:
            fn = raw["function"]
            arguments = fn.get("arguments") or ""
            calls.append({"id": str(raw["id"]), "name": str(fn["name"]),
                          "arguments": arguments if isinstance(arguments, str) else json.dumps(arguments)})  # fmt: skip
        usage = data.get("usage") or {}
        result = TurnResult(
            text=self.chat_format.assistant_text(content, calls),  # the student's format
            token_ids=None,
            topk_ids=[],
            topk_logprobs=[],
            finish_reason="length" if choice.get("finish_reason") == "length" else "stop",
            request_id="",
            prompt_tokens=int(usage.get("prompt_tokens", 0)),
            completion_tokens=int(usage.get("completion_tokens", 0)),
            tool_calls=calls,
            content=content,
        )
        logprobs = ((choice.get("logprobs") or {}).get("content")) or []
        if self.cfg.logprobs and content and not logprobs:  # e.g. transformers serve ignores the field
            raise TeacherHTTPError(
                f"{self.model_id} answered without the log-probs it was asked for (logprobs/top_logprobs); "
                "for a server without them set teacher.api.logprobs: false (sequence-level KD on its text)"
            )
        if logprobs and len(self.chat_format.split_turns(result.text)) == 1:  # tokens never span injected results
            self._map_logprobs(result, logprobs)
        return result

    def _map_logprobs(self, result: TurnResult, content: list[dict[str, Any]]) -> None:
        """Fill token ids and top-k from OpenAI ``logprobs.content`` when they spell the text."""
        ids: list[int] = []
        topk_ids: list[list[int]] = []
        topk_lp: list[list[float]] = []
        for entry in content:
            token_id = self.token_bytes.lookup(entry["token"], entry.get("bytes"))
            if token_id is None:  # another vocabulary
                if self.map_bytes:
                    self._map_other_vocabulary(result, content)
                return
            ids.append(token_id)
            pairs = [
                (self.token_bytes.lookup(t["token"], t.get("bytes")), float(t["logprob"]))
                for t in entry.get("top_logprobs") or []
            ]
            kept = [(i, lp) for i, lp in pairs if i is not None]
            topk_ids.append([i for i, _ in kept])
            topk_lp.append([lp for _, lp in kept])
        spelled = b"".join(self.token_bytes.by_id[i] for i in ids).decode("utf-8", errors="replace")
        if spelled != result.text:
            return  # tokens do not spell the content (e.g. stripped specials): text-only
        result.token_ids, result.topk_ids, result.topk_logprobs = ids, topk_ids, topk_lp

    def _map_other_vocabulary(self, result: TurnResult, content: list[dict[str, Any]]) -> None:
        """Our tokens of the content, with the teacher's top-k moved onto them through bytes."""
        teacher = [
            TeacherToken(api_token_bytes(e["token"], e.get("bytes")), float(e["logprob"]),
                         [(api_token_bytes(t["token"], t.get("bytes")), float(t["logprob"]))
                          for t in e.get("top_logprobs") or []])
            for e in content
        ]  # fmt: skip
        map_turn(result, teacher, self.tokenizer, self.token_bytes)
