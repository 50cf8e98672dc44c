"""A loopback OpenAI chat-completions server backed by a local teacher, with injectable faults.

Speaks the subset the HTTP teacher uses: ``POST /v1/chat/completions`` with ``messages``,
``tools``, ``max_tokens``, ``temperature``, ``logprobs``/``top_logprobs`` and ``stop``; answers in the
OpenAI shape (``id``, ``choices[0].message.content``, ``choices[0].logprobs.content[*]`` with
``token``/``logprob``/``bytes``/``top_logprobs``, ``finish_reason``, ``usage``) and echoes the
request id in an ``x-request-id`` header. ``GET /v1/models`` lists the one model.

The OpenAI message protocol is checked as strictly as real servers do (HTTP 400 naming the message):
an assistant ``tool_calls`` entry needs an ``id``, ``type: function`` and a JSON-string
``arguments``; every ``tool`` message answers, by ``tool_call_id``, a call of the assistant message
before it, and every call is answered before the conversation goes on.

The served model's own chat format (:class:`~distillgates.data.chat.ChatFormat` of its tokenizer)
renders the request (messages and ``tools``, through its chat template) and parses the generation,
as a real server's template and tool parser do: a generated turn whose calls all parse (toy
``<|tool_call|>{json}``, Hermes ``<tool_call>`` blocks, Llama 3 JSON) comes back as
``message.tool_calls`` with the text before them as ``content`` (ids ``call_<request>_<j>``,
several for parallel calls, ``finish_reason: tool_calls``), any other turn as ``content``.
Generation stops at the model's end-of-turn token, or at the request's ``stop`` strings, each of
which must be one token of the model's vocabulary (HTTP 400 otherwise).
The bodies of accepted requests are kept in ``server.requests`` for tests.

Faults are queued per request (``server.faults.append(Fault("429", retry_after=1))``): each
request pops the next one, so a test scripts exactly which requests fail and how. Used by the
tests and by ``distillgates teacher serve`` for demos. Stdlib ``ThreadingHTTPServer``: no extra
dependency, and one generation at a time behind a lock (the model is not thread-safe).
"""

from __future__ import annotations

import collections
import itertools
import json
import sys
import threading
import time
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from distillgates.teacher.local import LocalTeacher
from distillgates.teacher.messages import chat_messages
from distillgates.teacher.tokens import TokenBytes

FAULT_KINDS = ("429", "500", "503", "malformed", "slow", "drop")


@dataclass
class Fault:
    """One injected failure. ``slow`` sleeps ``delay_s`` before answering normally."""

    kind: str
    retry_after: float | None = None  # seconds, sent as Retry-After on 429/503
    delay_s: float = 2.0

    def __post_init__(self) -> None:
        if self.kind not in FAULT_KINDS:
            raise ValueError(f"fault kind must be one of {FAULT_KINDS}, got {self.kind!r}")


class _HTTPServer(ThreadingHTTPServer):
    daemon_threads = True

    def handle_error(self, request: Any, client_address: Any) -> None:
        if isinstance(sys.exc_info()[1], ConnectionError):  # the client gave up (timeout, drop): no one to answer
            return
        super().handle_error(request, client_address)


class TeacherServer:
    """Owns the HTTP server thread; use as a context manager or call start()/stop()."""

    def __init__(
        self,
        teacher: LocalTeacher,
        host: str = "127.0.0.1",
        port: int = 0,
        api_key: str | None = None,
        model_name: str = "toy-teacher",
        log_path: str | Path | None = None,
    ) -> None:
        self.teacher = teacher
        self.token_bytes = TokenBytes(teacher.tokenizer)
        self.api_key = api_key
        self.model_name = model_name
        self.log_path = Path(log_path) if log_path else None
        self.faults: collections.deque[Fault] = collections.deque()
        self.requests_seen = 0
        self.requests: list[dict[str, Any]] = []  # accepted request bodies, in order
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        self._httpd = _HTTPServer((host, port), _make_handler(self))
        self._thread: threading.Thread | None = None

    @property
    def base_url(self) -> str:
        host, port = self._httpd.server_address[:2]
        assert isinstance(host, str)  # getsockname() of an AF_INET socket
        return f"http://{host}:{port}/v1"

    def start(self) -> TeacherServer:
        self._thread = threading.Thread(target=self._httpd.serve_forever, daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def __enter__(self) -> TeacherServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def serve_forever(self) -> None:
        self._httpd.serve_forever()

    def log(self, line: str) -> None:
        """Access log (request line and status only: headers, and so keys, are never logged)."""
        if self.log_path is not None:
            with self._lock, open(self.log_path, "a") as f:
                f.write(line + "\n")

    def next_fault(self) -> Fault | None:
        with self._lock:
            self.requests_seen += 1
            return self.faults.popleft() if self.faults else None

    def completion(self, body: dict[str, Any]) -> dict[str, Any]:
        """The chat-completions response for a validated request body (kept in :attr:`requests`).

        Raises:
            ValueError: a ``stop`` that is not one token, or messages the model's template cannot render.
        """
        messages = body["messages"]
        max_tokens = int(body.get("max_tokens") or body.get("max_completion_tokens") or 64)
        temperature = float(body.get("temperature") or 0.0)
        k = int(body.get("top_logprobs") or 0) if body.get("logprobs") else 0
        fmt = self.teacher.chat_format
        stop_ids = self.stop_ids(body.get("stop"))
        prompt = fmt.render(chat_messages(messages, fmt), body.get("tools"), add_generation_prompt=True)
        prompt_ids = self.teacher.encode(prompt)
        self.requests.append(body)
        with self._lock:  # one generation at a time
            gen = self.teacher.generate(
                prompt_ids,
                max_tokens,
                stop_ids,
                temperature=temperature,
                top_k=max(k, 1),
                seed=int(body.get("seed") or 0),
            )
        number = next(self._ids)
        request_id = f"chatcmpl-{number:06d}"
        message: dict[str, Any] = {"role": "assistant", "content": gen.text}
        parsed = fmt.parse_output(gen.text)
        calls = parsed.calls if gen.finish_reason == "stop" else []
        if calls and all(calls):  # every call parses: tool_calls (several: parallel calls), like a tool parser
            message = {"role": "assistant", "content": parsed.preamble or None, "tool_calls": [
                {"id": f"call_{number}_{j}", "type": "function",
                 "function": {"name": c["name"], "arguments": json.dumps(c["arguments"], ensure_ascii=False)}}
                for j, c in enumerate(calls) if c is not None
            ]}  # fmt: skip
        choice: dict[str, Any] = {
            "index": 0,
            "message": message,
            "finish_reason": "tool_calls" if "tool_calls" in message else gen.finish_reason,
            "logprobs": None,
        }
        if k:
            choice["logprobs"] = {
                "content": [
                    {**self._token(tok, lp), "top_logprobs": [self._token(i, v) for i, v in zip(ids[:k], lps[:k])]}
                    for tok, lp, ids, lps in zip(gen.token_ids, gen.token_logprobs, gen.topk_ids, gen.topk_logprobs)
                ]
            }
        n_out = len(gen.token_ids) + (gen.finish_reason == "stop")
        return {
            "id": request_id,
            "object": "chat.completion",
            "created": int(time.time()),
            "model": self.model_name,
            "choices": [choice],
            "usage": {
                "prompt_tokens": len(prompt_ids),
                "completion_tokens": n_out,
                "total_tokens": len(prompt_ids) + n_out,
            },
        }

    def stop_ids(self, stop: Any) -> list[int]:
        """Ids the generation stops at: the request's ``stop`` strings (each one token of the model's
        vocabulary), else the model's end-of-turn token (what the local teacher stops at).

        Raises:
            ValueError: a stop string that is not one token of the vocabulary.
        """
        if not stop:
            return [self.teacher.end_id]
        vocab = self.teacher.tokenizer.get_vocab()
        stops = [stop] if isinstance(stop, str) else stop
        unknown = [s for s in stops if not isinstance(s, str) or s not in vocab]
        if unknown:
            raise ValueError(f"stop: {unknown} are not single tokens of {self.model_name}'s vocabulary "
                             "(this server stops at tokens; leave stop out to end at its end of turn)")  # fmt: skip
        return [vocab[s] for s in stops]

    def _token(self, token_id: int, logprob: float) -> dict[str, Any]:
        raw = self.token_bytes.by_id[token_id]
        return {"token": raw.decode("utf-8", errors="replace"), "logprob": logprob, "bytes": list(raw)}


def _validate(body: Any) -> str | None:
    """Why a request body is not a valid chat-completions request (None when it is): module docstring."""
    if not isinstance(body, dict):
        return "body must be a JSON object"
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        return "messages must be a non-empty list"
    for i, tool in enumerate(body.get("tools") or []):
        function = tool.get("function") if isinstance(tool, dict) and tool.get("type") == "function" else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            return f"tools[{i}] must be {{'type': 'function', 'function': {{'name': ..., 'parameters': ...}}}}"
    pending: list[str] = []  # calls of the last assistant message not answered yet
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ("system", "user", "assistant", "tool"):
            return f"messages[{i}].role is invalid"
        calls = m.get("tool_calls") if m["role"] == "assistant" else None
        if m["role"] == "tool":
            if m.get("tool_call_id") not in pending:
                return (f"messages[{i}]: a message with role 'tool' must answer a tool call of the preceding "
                        f"assistant message; tool_call_id {m.get('tool_call_id')!r} does not")  # fmt: skip
            pending.remove(m["tool_call_id"])
        elif pending:
            return (
                f"messages[{i}]: the assistant message with tool_calls must be followed by tool messages "
                f"answering each tool_call_id; not answered: {pending}"
            )
        if calls:
            if not isinstance(calls, list):
                return f"messages[{i}].tool_calls must be a list"
            for j, call in enumerate(calls):
                function = call.get("function") if isinstance(call, dict) else None
                if not isinstance(call, dict) or not isinstance(call.get("id"), str) or not call["id"]:
                    return f"messages[{i}].tool_calls[{j}].id must be a non-empty string"
                if call.get("type") != "function" or not isinstance(function, dict):
                    return f"messages[{i}].tool_calls[{j}] must be {{'type': 'function', 'function': {{...}}}}"
                if not isinstance(function.get("name"), str) or not isinstance(function.get("arguments"), str):
                    return f"messages[{i}].tool_calls[{j}].function needs a string name and JSON-string arguments"
            pending = [call["id"] for call in calls]
            if m.get("content") is not None and not isinstance(m["content"], str):
                return f"messages[{i}].content must be a string or null"
        elif not isinstance(m.get("content"), str):
            return f"messages[{i}].content must be a string"
    if pending:
        return f"the last assistant message has tool_calls without tool messages: {pending}"
    return None


def _make_handler(server: TeacherServer) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, format: str, *args: Any) -> None:
            server.log(f"{self.address_string()} {format % args}")

        def _send(self, status: int, payload: bytes, headers: dict[str, str] | None = None) -> None:
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(payload)))
            for key, value in (headers or {}).items():
                self.send_header(key, value)
            self.end_headers()
            self.wfile.write(payload)

        def _error(self, status: int, message: str, headers: dict[str, str] | None = None) -> None:
            body = {"error": {"message": message, "type": "server_error" if status >= 500 else "invalid_request"}}
            self._send(status, json.dumps(body).encode(), headers)

        def _authorized(self) -> bool:
            if server.api_key is None:
                return True
            if self.headers.get("Authorization", "") == f"Bearer {server.api_key}":
                return True
            self._error(401, "invalid api key")  # never echo the presented key
            return False

        def do_GET(self) -> None:
            if not self._authorized():
                return
            if self.path.rstrip("/") in ("/v1/models", "/models"):
                self._send(200, json.dumps({"object": "list", "data": [{"id": server.model_name}]}).encode())
            else:
                self._error(404, f"no route {self.path}")

        def do_POST(self) -> None:
            length = int(self.headers.get("Content-Length") or 0)
            raw = self.rfile.read(length)
            if not self._authorized():
                return
            if self.path.rstrip("/") not in ("/v1/chat/completions", "/chat/completions"):
                self._error(404, f"no route {self.path}")
                return
            fault = server.next_fault()
            if fault is not None and fault.kind in ("429", "503"):
                headers = {"Retry-After": f"{fault.retry_after:g}"} if fault.retry_after is not None else {}
                self._error(int(fault.kind), "injected fault", headers)
                return
            if fault is not None and fault.kind == "500":
                self._error(500, "injected fault")
                return
            if fault is not None and fault.kind == "drop":  # connection closed without a response
                self.close_connection = True
                return
            if fault is not None and fault.kind == "slow":
                time.sleep(fault.delay_s)
            try:
                body = json.loads(raw)
            except json.JSONDecodeError as err:
                self._error(400, f"invalid JSON: {err}")
                return
            problem = _validate(body)
            if problem:
                self._error(400, problem)
                return
            try:
                response = server.completion(body)
            except ValueError as err:  # a stop the model cannot stop at, messages its template cannot render
                self._error(400, str(err))
                return
            if fault is not None and fault.kind == "malformed":
                self._send(200, json.dumps(response).encode()[: len(json.dumps(response)) // 2])  # truncated JSON
                return
            self._send(200, json.dumps(response).encode(), {"x-request-id": response["id"]})

    return Handler
