"""Runners: the engine, HF and OpenAI-compatible (HTTP) runners agree on the same weights."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from distillgates.config import TeacherConfig
from distillgates.eval.runners import EngineRunner, HFRunner, TeacherRunner, eval_prompt_item, run_items
from distillgates.eval.sharding import normalize_output
from distillgates.model import load_model, model_fingerprint, to_hf
from distillgates.runtime import TorchEngine
from distillgates.teacher.http import HTTPTeacher
from distillgates.teacher.local import LocalTeacher
from distillgates.teacher.server import TeacherServer


@pytest.fixture(scope="module")
def hf_dir(tiny_run: dict[str, Any]) -> Path:
    path = tiny_run["root"] / "hf"
    if not path.exists():
        to_hf(load_model(tiny_run["model"])).save_pretrained(path)
        tiny_run["tokenizer"].save_pretrained(path)
    return path


def test_prompt_offers_the_registry_never_the_expected_call(tiny_run: dict[str, Any]) -> None:
    for item in tiny_run["items"]:
        prompt = eval_prompt_item(item)
        system = prompt["messages"][0]["content"]
        assert all(name in system for name in ("get_weather", "convert_currency", "calculate"))
        text = " ".join(m["content"] for m in prompt["messages"])
        for call in item["expected_calls"]:
            assert '"arguments"' not in text and call["name"] not in text.replace(system, "")


def test_engine_hf_and_http_runners_agree(tiny_run: dict[str, Any], hf_dir: Path) -> None:
    items, tok = tiny_run["items"][:3], tiny_run["tokenizer"]
    model = load_model(tiny_run["model"])
    engine_out = run_items(EngineRunner(TorchEngine(model), tok, model_fingerprint(model), max_new_tokens=6), items)
    hf_out = run_items(HFRunner.from_pretrained(hf_dir, tok, max_new_tokens=6), items)
    with TeacherServer(LocalTeacher(hf_dir)) as server:
        cfg = TeacherConfig(kind="openai", base_url=server.base_url, model_name="toy-teacher", determinism=True)
        runner = TeacherRunner(HTTPTeacher(cfg, tok), max_new_tokens=6)
        http_out = run_items(runner, items)
    assert runner.decoding["determinism"] is True
    for a, b, c in zip(engine_out, hf_out, http_out):
        assert normalize_output(a) == normalize_output(b) == normalize_output(c)
