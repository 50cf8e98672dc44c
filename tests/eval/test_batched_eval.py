"""The batched eval path (``EngineRunner.batch_size`` > 1) against the one-item-at-a-time path."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from distillgates.eval.runners import EngineRunner, run_items
from distillgates.model import Transformer, load_model, model_fingerprint
from distillgates.runtime.torch_engine import TorchEngine


def _runner(model: Transformer, tok: Any, batch_size: int, max_new_tokens: int, **kw: Any) -> EngineRunner:
    engine = TorchEngine(model, max_batch_size=batch_size)
    return EngineRunner(engine, tok, model_fingerprint(model), max_new_tokens, batch_size=batch_size, **kw)


def _call_then_stop_model(path: Any, tok: Any) -> Transformer:
    """Every turn is ``<|tool_call|><|end|>``: a malformed call (an error result), so each item runs
    ``max_calls`` turns with tool results in between. Channels 0 and 1 of the residual stream carry the
    token (attention and MLP write nothing there): after ``<|tool_call|>`` the tied head reads ``<|end|>``
    best, after any other token ``<|tool_call|>``."""
    model = load_model(path).eval()
    call, end = tok.convert_tokens_to_ids("<|tool_call|>"), tok.convert_tokens_to_ids("<|end|>")
    with torch.no_grad():
        for layer in model.layers:
            layer.attn.o_proj.weight[:2] = 0.0
            layer.mlp.down_proj.weight[:2] = 0.0
        model.embed.weight[:, :2] = 1.0
        model.embed.weight[call, :2] = torch.tensor([200.0, -100.0])
        model.embed.weight[end, :2] = torch.tensor([100.0, -400.0])
    return model


@pytest.mark.parametrize("batch_size", [3, 5])
def test_batched_outputs_equal_one_at_a_time(tiny_run: dict[str, Any], batch_size: int) -> None:
    items, tok = tiny_run["items"], tiny_run["tokenizer"]
    model = load_model(tiny_run["model"]).eval()
    single = run_items(_runner(model, tok, 1, 12), items)
    assert run_items(_runner(model, tok, batch_size, 12), items) == single


def test_batched_multi_turn_equals_one_at_a_time(tiny_run: dict[str, Any]) -> None:
    items, tok = tiny_run["items"], tiny_run["tokenizer"]
    model = _call_then_stop_model(tiny_run["model"], tok)
    single = run_items(_runner(model, tok, 1, 8), items, max_calls=3)
    assert all(len(o["calls"]) == 3 and len(o["turns"]) == 6 for o in single)  # three turns, three tool results
    assert run_items(_runner(model, tok, 4, 8), items, max_calls=3) == single


def test_batched_rows_near_the_context_end_end_as_at_batch_1(tiny_run: dict[str, Any]) -> None:
    """A context just longer than the prompts: each row's budget is what is left after its own tokens
    (as at batch 1), and a full context gives an empty turn."""
    items, tok = tiny_run["items"], tiny_run["tokenizer"]
    model = _call_then_stop_model(tiny_run["model"], tok)
    prompts = [len(_runner(model, tok, 1, 8).session().encode(_prompt(i, tok))) for i in items]
    model.setup_caches(1)
    short = Transformer(type(model.config)(**{**model.config.__dict__, "max_seq_len": max(prompts) + 5}))
    short.load_state_dict(model.state_dict())
    single = run_items(_runner(short.eval(), tok, 1, 8), items, max_calls=3)
    assert any(len(o["calls"]) < 3 for o in single)  # some conversations ran out of context
    assert run_items(_runner(short, tok, 4, 8), items, max_calls=3) == single


def _prompt(item: dict[str, Any], tok: Any) -> str:
    from distillgates.data.chat import chat_format
    from distillgates.eval.runners import eval_prompt_item

    return chat_format(tok).prompt(eval_prompt_item(item))


def test_batched_path_refuses_constrained_decoding_and_too_few_rows(tiny_run: dict[str, Any]) -> None:
    items, tok = tiny_run["items"][:2], tiny_run["tokenizer"]
    model = load_model(tiny_run["model"]).eval()
    with pytest.raises(ValueError, match="constrained tool calls"):
        run_items(_runner(model, tok, 2, 8, constrained=True), items)
    runner = EngineRunner(TorchEngine(model), tok, model_fingerprint(model), 8, batch_size=2)
    with pytest.raises(ValueError, match="at least that many cache rows"):
        run_items(runner, items)
    assert runner.decoding["batch_size"] == 2
    assert "batch_size" not in _runner(model, tok, 1, 8).decoding  # batch 1: the fingerprint as before


def test_evaluate_and_specs_take_the_batch_size(tiny_run: dict[str, Any]) -> None:
    from distillgates.config import EvalConfig
    from distillgates.eval.evaluate import evaluate, run_spec

    items, tok = tiny_run["items"][:6], tiny_run["tokenizer"]
    model = load_model(tiny_run["model"]).eval()
    one, one_out, _ = evaluate(TorchEngine(model), items, tok, max_new_tokens=10, return_outputs=True)
    four, four_out, _ = evaluate(TorchEngine(model, max_batch_size=4), items, tok, max_new_tokens=10, batch_size=4,
                                 return_outputs=True)  # fmt: skip
    assert four_out == one_out
    assert four["fingerprints"]["runner_fingerprint"] != one["fingerprints"]["runner_fingerprint"]
    four.pop("fingerprints"), one.pop("fingerprints")
    assert four == one
    with pytest.raises(ValueError, match="batch_size 4 needs a runtime engine"):
        evaluate(_runner(model, tok, 1, 10), items, tok, batch_size=4)
    root = tiny_run["root"]
    spec = {"dataset": str(root / "eval.jsonl"), "tokenizer": str(root / "tokenizer"), "model": str(tiny_run["model"]),
            "runner": "engine", "max_new_tokens": 10, "limit": 6}  # fmt: skip
    assert run_spec({**spec, "batch_size": 3}) == run_spec(spec) == one_out
    with pytest.raises(ValueError, match="constrained_tool_calls"):
        EvalConfig(batch_size=2, constrained_tool_calls=True)
    with pytest.raises(ValueError, match="batch_size must be >= 1"):
        EvalConfig(batch_size=0)
