"""``distillgates serve``: a real server process on loopback answers chat completions with logprobs."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import httpx
import pytest


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.integration  # the serve CLI in a subprocess (~4 s)
def test_serve_answers_chat_completions_and_checks_the_key(tiny_teacher_dir):
    port = _free_port()
    env = {**os.environ, "SERVE_TEST_KEY": "sk-serve-test"}
    cmd = [sys.executable, "-m", "distillgates.cli", "serve", "--teacher-dir", str(tiny_teacher_dir),
           "--port", str(port), "--api-key-env", "SERVE_TEST_KEY"]  # fmt: skip
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        assert proc.stdout is not None
        lines = []
        while not any(line.startswith("serving") for line in lines) and proc.poll() is None and len(lines) < 100:
            lines.append(proc.stdout.readline())  # "serving ..." is printed once the socket is bound
        line = lines[-1]
        assert f"127.0.0.1:{port}" in line, lines
        url = f"http://127.0.0.1:{port}/v1/chat/completions"
        body = {"model": "toy-teacher", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4,
                "temperature": 0, "logprobs": True, "top_logprobs": 3}  # fmt: skip
        assert httpx.post(url, json=body, timeout=30).status_code == 401  # no key
        reply = httpx.post(url, json=body, headers={"Authorization": "Bearer sk-serve-test"}, timeout=30)
        assert reply.status_code == 200, reply.text
        choice = reply.json()["choices"][0]
        assert choice["logprobs"]["content"] and len(choice["logprobs"]["content"][0]["top_logprobs"]) == 3
        assert "sk-serve-test" not in line
    finally:
        proc.terminate()
        proc.wait(timeout=10)
