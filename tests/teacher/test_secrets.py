"""The API key never reaches a written file: cache, checkpoint, partial/final KD set, logs, errors."""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path

import pytest

from distillgates.teacher.http import HTTPTeacher, TeacherHTTPError
from distillgates.teacher.kd import build_kd_set
from distillgates.teacher.server import Fault, TeacherServer

from .conftest import kd_config

KEY = "sk-live-SECRET-7d41e0b2c9a8"


def test_api_key_never_written(tiny_teacher, toy_items, tmp_path, monkeypatch):
    monkeypatch.setenv("DG_TEST_API_KEY", KEY)
    handler = logging.FileHandler(tmp_path / "run.log")
    handler.setLevel(logging.DEBUG)
    root = logging.getLogger()
    old_level = root.level
    root.addHandler(handler)
    root.setLevel(logging.DEBUG)  # httpx/httpcore debug logs included
    try:
        with TeacherServer(tiny_teacher, api_key=KEY, log_path=tmp_path / "server.log") as server:
            cfg = kd_config("openai", api=dict(base_url=server.base_url, api_key_env="DG_TEST_API_KEY",
                                               backoff_base_s=0.01, backoff_max_s=0.02, max_retries=2),
                            budget_tokens=1)  # fmt: skip
            assert cfg.teacher is not None
            client = HTTPTeacher(cfg.teacher.api, tiny_teacher.tokenizer)
            server.faults.extend([Fault("500"), Fault("429", retry_after=0)])  # retries get logged
            out = tmp_path / "kd" / "kd.jsonl"
            stopped = build_kd_set(cfg, client, toy_items[:4], out, cache_dir=tmp_path / "cache", progress=False)
            assert stopped.status == "budget_exhausted" and stopped.retries == 2
            assert Path(f"{out}.ckpt").exists() and Path(f"{out}.partial").exists()  # inspected below, then resumed
            snapshot = {p.name + ".snap": p.read_bytes() for p in out.parent.iterdir()}
            cfg = dataclasses.replace(cfg, kd=dataclasses.replace(cfg.kd, budget_tokens=0))
            client = HTTPTeacher(cfg.teacher.api, tiny_teacher.tokenizer)
            done = build_kd_set(cfg, client, toy_items[:4], out, resume=True, cache_dir=tmp_path / "cache",
                                progress=False)  # fmt: skip
            assert done.complete
            server.faults.extend([Fault("500")] * 3)
            with pytest.raises(TeacherHTTPError) as info:
                client.complete(toy_items[0]["messages"], max_new_tokens=2, top_k=2)
            report = {"result": repr(done), "error": str(info.value), "client": repr(client), "cfg": repr(cfg)}
            (tmp_path / "report.json").write_text(json.dumps(report))
            client.close()
    finally:
        root.removeHandler(handler)
        root.setLevel(old_level)
        handler.close()
    for name, data in snapshot.items():
        (tmp_path / name).write_bytes(data)

    written = [p for p in tmp_path.rglob("*") if p.is_file()]
    assert {"run.log", "server.log", "kd.jsonl", "report.json", "kd.jsonl.ckpt.snap", "kd.jsonl.partial.snap"} <= {
        p.name for p in written
    }
    assert any(p.parent.parent.name == "cache" for p in written)  # cache entries exist
    assert "retry" in (tmp_path / "run.log").read_text()  # the logs are real, not empty
    leaks = [str(p) for p in written if KEY.encode() in p.read_bytes()]
    assert leaks == []
