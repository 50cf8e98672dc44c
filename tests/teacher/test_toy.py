"""Toy teacher recipe: training on generated tokens, save_pretrained, and the multi-turn evaluator."""

from __future__ import annotations

import itertools
import json

import pytest
import torch

from distillgates.config import Config
from distillgates.teacher.base import TurnResult
from distillgates.teacher.local import LocalTeacher
from distillgates.teacher.toy import (
    build_toy_teacher,
    copy_rows,
    encode_for_training,
    evaluate_teacher,
    lr_at,
    target_ce,
    without_system_prompt,
)

from ..conftest import tiny_model_config
from .conftest import ReplayTeacher, kd_teacher_config


def _cfg(tokenizer, **teacher) -> Config:
    # twice the tiny width: the recipe must learn the toy items in 80 steps
    model = tiny_model_config(vocab_size=len(tokenizer), d_model=64, ffn_hidden=128, max_seq_len=512)
    fields = dict(model=model, train_steps=80, batch_size=2, lr=1e-2, warmup_steps=5, max_new_tokens=48)
    fields.update(teacher)
    return Config(teacher=kd_teacher_config(**fields))


def test_loss_mask_covers_exactly_the_generated_tokens(toy_items, tiny_tokenizer):
    rows = encode_for_training(tiny_tokenizer, toy_items, max_len=10_000)
    for (ids, mask), item in zip(rows, toy_items):
        masked = tiny_tokenizer.decode([i for i, m in zip(ids, mask) if m])
        assert "<|tool_result|>" not in masked and "<|user|>" not in masked
        assert masked.endswith("<|end|><|eos|>")
        for call in item["expected_calls"]:
            assert call["name"] in masked


def test_value_weight_lands_on_argument_values_and_answer_facts(toy_items, tiny_tokenizer):
    item = next(i for i in toy_items if i["kind"] == "single")
    (ids, weights), = encode_for_training(tiny_tokenizer, [item], max_len=10_000, value_weight=4.0)
    heavy = tiny_tokenizer.decode([i for i, w in zip(ids, weights) if w == 4.0])
    for value in item["expected_calls"][0]["arguments"].values():
        assert str(value) in heavy
    for fact in item["integration_fields"]:
        assert fact in heavy
    assert set(weights) == {0.0, 1.0, 4.0}
    assert item["expected_calls"][0]["name"] not in heavy  # template tokens keep weight 1


def test_target_ce_counts_weighted_targets_only():
    """The LM head at target positions only gives the weighted token-mean CE of the full logits."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=7, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=1))  # fmt: skip
    ids = torch.tensor([[1, 2, 3, 4]])
    plain = torch.nn.functional.cross_entropy(model(input_ids=ids).logits[0, :-1], ids[0, 1:], reduction="none")
    assert torch.allclose(target_ce(model, ids, torch.tensor([[0.0, 1.0, 1.0, 0.0]])), plain[:2].mean(), atol=1e-6)
    assert torch.allclose(target_ce(model, ids, torch.tensor([[0.0, 3.0, 1.0, 0.0]])), (3 * plain[0] + plain[1]) / 2,
                          atol=1e-6)  # fmt: skip


def test_curriculum_phase_drops_only_the_system_prompt(toy_items):
    stripped = without_system_prompt(toy_items)
    for before, after in zip(toy_items, stripped):
        assert [m for m in before["messages"] if m["role"] != "system"] == after["messages"]
        assert after["reference"] == before["reference"] and before["messages"][0]["role"] == "system"


def test_copy_rows_repeat_a_span_with_loss_on_the_repeat_only():
    rows = copy_rows(vocab_size=50, first_id=9, n=20, length=16, seed=0)
    assert rows == copy_rows(vocab_size=50, first_id=9, n=20, length=16, seed=0)
    for ids, weights in rows:
        half = len(ids) // 2
        assert ids[:half] == ids[half:] and 4 <= half <= 8 and all(9 <= i < 50 for i in ids)
        assert weights == [0.0] * half + [1.0] * half


@pytest.mark.integration  # trains the toy teacher (~3 s)
def test_copy_phase_teaches_copying_from_the_context(toy_items, tiny_tokenizer, tmp_path):
    """After copy rows only, a tiny model predicts tokens of the context on spans it never saw: the
    "this token is in the context, emit it" circuit the task alone never builds for rare tokens."""
    from transformers import LlamaForCausalLM

    from distillgates.teacher.toy import train_toy_teacher

    cfg = _cfg(tiny_tokenizer, train_steps=150, copy_steps=150, batch_size=16, lr=1e-2, warmup_steps=10)
    train_toy_teacher(cfg, tiny_tokenizer, toy_items, tmp_path, seed=0)
    model = LlamaForCausalLM.from_pretrained(tmp_path).eval()
    first = len(tiny_tokenizer.all_special_ids)
    in_context = total = 0
    chance = 0.0  # expected share of argmaxes in the span for a model that ignores the context
    for ids, weights in copy_rows(len(tiny_tokenizer), first, n=32, length=32, seed=123):
        with torch.no_grad():
            pred = model(torch.tensor([ids])).logits[0].argmax(-1).tolist()  # (T,)
        span = set(ids)
        for j in range(1, len(ids)):
            if weights[j]:
                in_context, total = in_context + (pred[j - 1] in span), total + 1
                chance += len(span) / (len(tiny_tokenizer) - first)
    assert in_context / total > 5 * chance / total, (in_context / total, chance / total)


def test_lr_schedule_warms_up_then_decays(tiny_tokenizer):
    tcfg = _cfg(tiny_tokenizer, train_steps=100, warmup_steps=10, lr=1.0, min_lr_ratio=0.1).teacher
    lrs = [lr_at(s, tcfg) for s in range(100)]
    assert lrs[0] == 0.1 and lrs[9] == 1.0 and max(lrs) == 1.0
    assert all(a >= b for a, b in itertools.pairwise(lrs[9:])) and abs(lrs[-1] - 0.1) < 0.01


@pytest.mark.parametrize("recipe", [{}, {"curriculum_steps": 20, "value_weight": 3.0}], ids=["plain", "curriculum"])
def test_trained_tiny_teacher_solves_a_memorized_item(toy_items, tiny_tokenizer, tmp_path, recipe):
    """Overfit one tool-call item: the saved teacher then solves it end to end (call, result, answer),
    with the system prompt, also after a curriculum phase that trained without it."""
    items = [next(it for it in toy_items if it["kind"] == "single" and it["style"] == "terse")]
    torch.manual_seed(0)
    report = build_toy_teacher(
        _cfg(tiny_tokenizer, train_steps=60, batch_size=1, **recipe), tiny_tokenizer, items, items, tmp_path
    )
    assert report["train"]["curriculum_steps"] == recipe.get("curriculum_steps", 0)
    assert report["train"]["final_loss"] < 0.1 * report["train"]["first_loss"]
    assert report["tool_selection"] == 1.0 and report["json_validity"] == 1.0, report["failures"]
    assert report["arg_match_strict"] == 1.0 and report["answered"] == 1.0
    saved = json.loads((tmp_path / "teacher_eval.json").read_text())
    assert saved["tool_selection"] == report["tool_selection"] and saved["n"] == 1
    teacher = LocalTeacher(tmp_path)  # plain save_pretrained dir: model + tokenizer
    assert teacher.tokenizer.get_vocab() == tiny_tokenizer.get_vocab()


def test_evaluator_scores_reference_and_wrong_answers(toy_items, tiny_tokenizer):
    cfg = _cfg(tiny_tokenizer)
    perfect = evaluate_teacher(ReplayTeacher(toy_items, tiny_tokenizer), cfg, toy_items)
    assert perfect["tool_selection"] == 1.0 and perfect["json_validity"] == 1.0 and perfect["arg_match_strict"] == 1.0

    class WrongTool(ReplayTeacher):
        def complete(self, messages, **kwargs) -> TurnResult:
            turn = super().complete(messages, **kwargs)
            if "get_weather" in turn.text:
                turn.text = turn.text.replace('"get_weather"', '"get_wether"')
                turn.token_ids = self.tokenizer.encode(turn.text, add_special_tokens=False)
                turn.topk_ids = turn.topk_logprobs = [[] for _ in turn.token_ids]
            return turn

    weather = [it for it in toy_items if any(c["name"] == "get_weather" for c in it["expected_calls"])]
    assert weather, "fixture items should include a weather call"
    scored = evaluate_teacher(WrongTool(toy_items, tiny_tokenizer), cfg, toy_items)
    assert scored["tool_selection"] == 1.0 - len(weather) / len(toy_items)
    assert scored["json_validity"] < 1.0  # unknown tool fails the schema validator
