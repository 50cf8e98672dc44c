"""HTTP teacher against a real loopback server (backed by the tiny local teacher) with injected faults."""

from __future__ import annotations

import email.utils
import time

import httpx
import pytest
import torch

from distillgates.config import APIConfig
from distillgates.teacher.http import (
    DeterminismError,
    HTTPTeacher,
    RateLimiter,
    TeacherHTTPError,
    parse_retry_after,
)
from distillgates.teacher.server import Fault, TeacherServer

KEY = "sk-test-3f9a1c7e55d2"


@pytest.fixture(scope="module")
def server(tiny_teacher):
    with TeacherServer(tiny_teacher, api_key=KEY) as srv:
        yield srv


@pytest.fixture
def make_client(server, tiny_teacher, monkeypatch):
    monkeypatch.setenv("TEST_TEACHER_KEY", KEY)
    clients = []

    def make(**overrides):
        sleeps: list[float] = []
        fields = dict(base_url=server.base_url, api_key_env="TEST_TEACHER_KEY", timeout_s=5.0,
                      max_retries=3, backoff_base_s=0.01, backoff_max_s=0.05)  # fmt: skip
        fields.update(overrides)
        client = HTTPTeacher(APIConfig(**fields), tiny_teacher.tokenizer, sleep=sleeps.append)
        client.sleeps = sleeps
        clients.append(client)
        return client

    yield make
    for client in clients:
        client.close()
    server.faults.clear()


def _messages(item):
    return item["messages"]


def test_http_teacher_matches_the_local_teacher(make_client, tiny_teacher, toy_items):
    local = tiny_teacher.complete(_messages(toy_items[0]), max_new_tokens=6, top_k=4)
    remote = make_client().complete(_messages(toy_items[0]), max_new_tokens=6, top_k=4)
    assert remote.text == local.text
    assert remote.token_ids == local.token_ids  # API tokens mapped back to ids through their bytes
    assert remote.topk_ids == local.topk_ids
    torch.testing.assert_close(torch.tensor(remote.topk_logprobs), torch.tensor(local.topk_logprobs))
    assert remote.request_id.startswith("chatcmpl-")
    assert remote.prompt_tokens == local.prompt_tokens


@pytest.mark.parametrize(
    "fault",
    [Fault("429", retry_after=1), Fault("503", retry_after=2), Fault("500"), Fault("malformed"),
     Fault("slow", delay_s=1.5), Fault("drop")],
    ids=lambda f: f.kind,
)  # fmt: skip
def test_normal_mode_survives_faults(make_client, server, tiny_teacher, toy_items, fault):
    client = make_client(timeout_s=0.5)
    expected = tiny_teacher.complete(_messages(toy_items[0]), max_new_tokens=4, top_k=2)
    server.faults.append(fault)
    seen = server.requests_seen
    result = client.complete(_messages(toy_items[0]), max_new_tokens=4, top_k=2)
    assert result.text == expected.text and result.token_ids == expected.token_ids
    assert client.retries_done == 1 and server.requests_seen == seen + 2
    assert len(client.sleeps) == 1
    if fault.retry_after is not None:
        assert client.sleeps[0] >= fault.retry_after  # Retry-After honoured over the short backoff
    else:
        assert 0 <= client.sleeps[0] <= 0.01  # full jitter within the first backoff step


@pytest.mark.parametrize(
    "fault", [Fault("429", retry_after=1), Fault("500"), Fault("malformed"), Fault("slow", delay_s=1.5)],
    ids=lambda f: f.kind,
)  # fmt: skip
def test_determinism_mode_fails_on_the_first_retryable_failure(make_client, server, toy_items, fault):
    client = make_client(determinism=True, timeout_s=0.5)
    server.faults.append(fault)
    seen = server.requests_seen
    with pytest.raises(DeterminismError, match="retries are not allowed"):
        client.complete(_messages(toy_items[0]), max_new_tokens=4, top_k=2)
    assert server.requests_seen == seen + 1  # no second attempt
    assert client.retries_done == 0 and client.sleeps == []


def test_determinism_mode_pins_sampling_and_captures_request_ids(make_client, toy_items):
    client = make_client(determinism=True)
    body = client.payload(_messages(toy_items[0]), max_new_tokens=4, top_k=2, temperature=0.9)
    assert body["temperature"] == 0.0 and body["top_p"] == 1.0
    a = client.complete(_messages(toy_items[0]), max_new_tokens=4, top_k=2, temperature=0.9)
    b = client.complete(_messages(toy_items[0]), max_new_tokens=4, top_k=2, temperature=0.9)
    assert a.text == b.text and a.request_id != b.request_id and a.request_id and b.request_id


def test_retries_exhausted_raise_without_the_key(make_client, server, toy_items):
    client = make_client(max_retries=2)
    server.faults.extend([Fault("500")] * 3)
    with pytest.raises(TeacherHTTPError, match="giving up after 3 attempts") as info:
        client.complete(_messages(toy_items[0]), max_new_tokens=4, top_k=2)
    assert KEY not in str(info.value) and KEY not in repr(client)


def test_wrong_key_is_not_retried(make_client, monkeypatch, toy_items):
    client = make_client()
    monkeypatch.setenv("OTHER_KEY", "sk-wrong-key-0000")
    wrong = make_client(api_key_env="OTHER_KEY")
    with pytest.raises(TeacherHTTPError, match="HTTP 401") as info:
        wrong.complete(_messages(toy_items[0]), max_new_tokens=4, top_k=2)
    assert "sk-wrong-key-0000" not in str(info.value) and wrong.sleeps == []
    assert client.complete(_messages(toy_items[0]), max_new_tokens=2, top_k=2).text is not None


def test_unmappable_tokens_fall_back_to_text_only(tiny_teacher):
    """A server with another vocabulary: token bytes that are not in ours -> no ids, no top-k."""
    body = {
        "id": "x1",
        "choices": [{"index": 0, "finish_reason": "stop", "message": {"role": "assistant", "content": "Hi"},
                     "logprobs": {"content": [{"token": "Hi", "logprob": -0.1, "bytes": [0xF0, 0x9F],
                                               "top_logprobs": []}]}}],
        "usage": {"prompt_tokens": 3, "completion_tokens": 1},
    }  # fmt: skip
    transport = httpx.MockTransport(lambda request: httpx.Response(200, json=body))  # an unreachable API's reply
    client = HTTPTeacher(APIConfig(base_url="http://api.invalid/v1"), tiny_teacher.tokenizer,
                         api_key="k", transport=transport)  # fmt: skip
    result = client.complete([{"role": "user", "content": "x"}], max_new_tokens=4, top_k=2)
    assert result.text == "Hi" and result.token_ids is None and result.topk_ids == []
    assert result.request_id == "x1"


def test_rate_limiter_spaces_requests():
    now = [0.0]
    slept: list[float] = []

    def sleep(s: float) -> None:
        slept.append(s)
        now[0] += s

    limiter = RateLimiter(rate=4.0, burst=1.0, clock=lambda: now[0], sleep=sleep)
    for _ in range(5):
        limiter.acquire()
    assert slept == pytest.approx([0.25, 0.25, 0.25, 0.25])
    assert now[0] == pytest.approx(1.0)  # 5 requests at 4/s: the first is free
    assert RateLimiter(rate=0.0).acquire() == 0.0


def test_parse_retry_after():
    assert parse_retry_after("3") == 3.0
    assert parse_retry_after(None) is None and parse_retry_after("soon") is None
    date = email.utils.formatdate(time.time() + 10, usegmt=True)
    assert 8.0 <= parse_retry_after(date) <= 10.5


def test_server_is_quiet_about_clients_that_gave_up(server, capsys):
    """A client that timed out (``slow``) or dropped leaves a broken pipe: not an error worth a traceback."""
    for error, printed in ((BrokenPipeError(), False), (ConnectionResetError(), False), (ValueError("bug"), True)):
        try:
            raise error
        except Exception:
            server._httpd.handle_error(None, ("127.0.0.1", 1))
        assert ("Exception occurred" in capsys.readouterr().err) is printed
