"""Runners: the engine, HF and OpenAI-compatible (HTTP) runners agree on the same weights."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from distillgates.config import APIConfig
from distillgates.eval.runners import EngineRunner, HFRunner, TeacherRunner, eval_prompt_item, run_items
from distillgates.eval.sharding import normalize_output
from distillgates.hf import to_hf
from distillgates.model import load_model, model_fingerprint
from distillgates.runtime.torch_engine import TorchEngine
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
        cfg = APIConfig(base_url=server.base_url, model_name="toy-teacher", determinism=True)
        runner = TeacherRunner(HTTPTeacher(cfg, tok), max_new_tokens=6)
        http_out = run_items(runner, items)
    assert runner.decoding["determinism"] is True
    for a, b, c in zip(engine_out, hf_out, http_out):
        assert normalize_output(a) == normalize_output(b) == normalize_output(c)


def test_constrained_runner_emits_only_valid_calls(tiny_run: dict[str, Any]) -> None:
    """A model that always wants ``<|tool_call|>`` next, and then ``"``: unconstrained, no call it emits is valid;
    under constrained decoding every call parses and matches its tool's schema. The ``"`` ends each string where the
    constraint allows it, and one call per item in 160 tokens leaves room for the ones it cannot shorten (a date's
    pattern, keys spelled byte by byte): the call fits whatever the data and the tokenizer's merges (with 64 tokens
    and two calls, a change of the toy's data cut them off mid-call, 2026-12-04)."""
    from distillgates.eval.evaluate import evaluate
    from distillgates.eval.runners import runner_fingerprint_of

    items, tok = tiny_run["items"][:4], tiny_run["tokenizer"]
    model = load_model(tiny_run["model"]).eval()
    with torch.no_grad():  # residual channel 0 is 1 for every token; the (tied) head reads it as <|tool_call|>
        for layer in model.layers:
            layer.attn.o_proj.weight[0] = 0.0
            layer.mlp.down_proj.weight[0] = 0.0
        model.embed.weight[:, 0] = 1.0
        model.embed.weight[tok.convert_tokens_to_ids("<|tool_call|>"), 0] = 200.0
        model.embed.weight[tok.convert_tokens_to_ids('"'), 0] = 100.0
    runners = {c: EngineRunner(TorchEngine(model), tok, model_fingerprint(model), 160, constrained=c)
               for c in (False, True)}  # fmt: skip
    free = evaluate(runners[False], items, tok, max_calls=1)
    constrained = evaluate(runners[True], items, tok, max_calls=1)
    assert free["json_validity"] == 0.0
    assert constrained["json_validity"] == 1.0
    assert free["fingerprints"]["runner_fingerprint"] != constrained["fingerprints"]["runner_fingerprint"]
    assert runner_fingerprint_of(runners[True]) == constrained["fingerprints"]["runner_fingerprint"]
    with pytest.raises(ValueError, match="needs a runtime engine"):
        evaluate(HFRunner(model, tok, "m" * 64), items, tok, constrained=True)


def test_constrained_decoding_uses_the_items_own_tools_and_falls_back_explicitly(tiny_run: dict[str, Any]) -> None:
    """The steered model of the test above on the ticketing/file-search items: every constrained call is
    valid against the item's own tools (booleans, arrays, nested objects, enums); an item whose schema the
    constraint cannot enforce decodes unconstrained and says so in its output."""
    from distillgates.data.openai_format import row_to_item
    from distillgates.data.tools import validate_call
    from distillgates.eval.evaluate import evaluate

    from ..conftest import own_data_rows

    rows = [r for r in own_data_rows() if r["id"] in ("single-0", "control-0")]
    items = [row_to_item(r, f"rows.jsonl:{i + 1}", "x") for i, r in enumerate(rows)]
    unsupported = dict(rows[0], id="nullable-0", tools=[{"type": "function", "function": {
        "name": "create_ticket", "parameters": {"type": "object", "properties": {
            "title": {"type": ["string", "null"]}, "priority": {"type": "string"}, "urgent": {"type": "boolean"},
            "tags": {"type": "array", "items": {"type": "string"}}}}}}])  # fmt: skip
    items.append(row_to_item(unsupported, "rows.jsonl:3", "x"))
    tok = tiny_run["tokenizer"]
    model = load_model(tiny_run["model"]).eval()
    with torch.no_grad():  # as above: <|tool_call|> is always the model's next token
        for layer in model.layers:
            layer.attn.o_proj.weight[0] = 0.0
            layer.mlp.down_proj.weight[0] = 0.0
        model.embed.weight[:, 0] = 1.0
        model.embed.weight[tok.convert_tokens_to_ids("<|tool_call|>"), 0] = 200.0
        model.embed.weight[tok.convert_tokens_to_ids('"'), 0] = 100.0
    # one call per item and room for a 64-character string argument (the bound of a free string)
    runner = EngineRunner(TorchEngine(model), tok, model_fingerprint(model), 200, constrained=True)
    metrics, outputs, _ = evaluate(runner, items[:2], tok, max_calls=1, return_outputs=True)
    assert metrics["json_validity"] == 1.0
    calls = [c["call"] for o in outputs for c in o["calls"]]
    assert calls and {c["name"] for c in calls} <= {"create_ticket", "search_files"}
    assert all(not validate_call(c, items[0]["tools"]) for c in calls)
    assert not any("unconstrained_reason" in o for o in outputs)
    fallback = run_items(runner, items[2:], max_calls=1)[0]
    assert "title: type ['string', 'null'] is not supported" in fallback["unconstrained_reason"]
    assert fallback["calls"] and all(c["errors"] for c in fallback["calls"])  # free decoding: no valid call
