"""Speed worker protocol (server loop and client) without a model: the real worker runs in the live tests."""

from __future__ import annotations

import io
import json
import sys

import pytest

from distillgates.speed_worker import PROTOCOL, PROTOCOL_VERSION, SpeedWorker, WorkerError, serve


def test_serve_answers_measure_requests_after_the_protocol_line():
    out = io.StringIO()
    asked = []

    def sampler(n, mode):
        asked.append((n, mode))
        if mode != "plain" and n > 4:
            raise ValueError("no drafter: start the worker with --drafter")
        samples = {"ttft_ms": [1.0] * n, "tps": [100.0] * n}
        return {"plain": samples, "speculative": samples} if mode == "paired" else samples

    requests = ("measure 3\nmeasure-paired 2\nmeasure-paired 5\nreport {\"speed\": {\"warmup\": 1}}\n"
                "measure-drafter 1\nmeasure-speculative 1\nquit\nmeasure 9\n")
    serve(sampler, "torch", io.StringIO(requests), out, reporter=lambda request: request)
    lines = [json.loads(line) for line in out.getvalue().splitlines()]
    assert lines[0] == {"protocol": PROTOCOL, "version": PROTOCOL_VERSION, "backend": "torch"}
    assert lines[1] == {"ttft_ms": [1.0] * 3, "tps": [100.0] * 3}
    assert lines[2] == {mode: {"ttft_ms": [1.0] * 2, "tps": [100.0] * 2} for mode in ("plain", "speculative")}
    assert "ValueError: no drafter" in lines[3]["error"]  # answered, and the worker serves on
    assert lines[4] == {"speed": {"warmup": 1}}
    assert lines[5] == {"ttft_ms": [1.0], "tps": [100.0]}
    assert "unknown request 'measure-speculative 1'" in lines[6]["error"]
    assert asked == [(3, "plain"), (2, "paired"), (5, "paired"), (1, "drafter")]
    assert len(lines) == 7  # nothing after quit


def test_a_worker_missing_at_that_code_is_a_clear_error(tmp_path):
    """The blessed commit predates the worker: the client names the command, the code and the worker's error."""
    (tmp_path / "src" / "distillgates").mkdir(parents=True)
    (tmp_path / "src" / "distillgates" / "__init__.py").write_text("")
    worker = SpeedWorker("reference", tmp_path / "src", ["--run-dir", "x", "--model", "y"])
    with pytest.raises(WorkerError, match=r"(?s)reference speed worker .* exited with code 1: .*No module named "
                                          r"distillgates.speed_worker"):
        worker.handshake()
    worker.close()


def test_a_worker_speaking_another_protocol_is_refused(tmp_path):
    package = tmp_path / "src" / "distillgates"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "speed_worker.py").write_text('print(\'{"protocol": "distillgates-speed-worker", "version": 0}\')\n')
    worker = SpeedWorker("reference", tmp_path / "src", [], env={"PATH": "", "PYTHONPATH": ""})
    with pytest.raises(WorkerError, match="expected protocol 'distillgates-speed-worker' version 1"):
        worker.handshake()
    worker.close()
    assert sys.executable in worker.command
