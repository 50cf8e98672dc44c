"""Toy teacher recipe: training on generated tokens, save_pretrained, and a trained teacher solving items."""

from __future__ import annotations

import json

import pytest
import torch

from distillgates.config import Config, TeacherConfig, ToyTeacherTrainConfig
from distillgates.eval.evaluate import evaluate
from distillgates.hf import from_hf
from distillgates.runtime.torch_engine import TorchEngine
from distillgates.teacher.local import LocalTeacher
from distillgates.teacher.toy import (
    copy_rows,
    encode_for_training,
    target_ce,
    train_toy_teacher,
    without_system_prompt,
)

from ..conftest import tiny_model_config


def _cfg(tokenizer, **train) -> Config:
    # twice the tiny width: the recipe must learn the toy items in 80 steps
    model = tiny_model_config(vocab_size=len(tokenizer), d_model=64, ffn_hidden=128, max_seq_len=512)
    fields = dict(steps=80, batch_size=2, lr=1e-2, warmup_steps=5)
    fields.update(train)
    return Config(teacher=TeacherConfig(model=model, train=ToyTeacherTrainConfig(**fields)))


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

    cfg = _cfg(tiny_tokenizer, steps=150, copy_steps=150, batch_size=16, lr=1e-2, warmup_steps=10)
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


@pytest.mark.parametrize("recipe", [{}, {"curriculum_steps": 20, "value_weight": 3.0}], ids=["plain", "curriculum"])
def test_trained_tiny_teacher_solves_a_memorized_item(toy_items, tiny_tokenizer, tmp_path, recipe):
    """Overfit one tool-call item: the saved teacher then solves it end to end (call, result, answer),
    with the system prompt, also after a curriculum phase that trained without it. Scored as the eval
    step scores every teacher: the same engine, runner and scorer as the student."""
    items = [next(it for it in toy_items if it["kind"] == "single" and it["style"] == "terse")]
    torch.manual_seed(0)
    stats = train_toy_teacher(_cfg(tiny_tokenizer, steps=60, batch_size=1, **recipe), tiny_tokenizer, items,
                              tmp_path, seed=0)  # fmt: skip
    assert stats["curriculum_steps"] == recipe.get("curriculum_steps", 0)
    assert stats["final_loss"] < 0.1 * stats["first_loss"]
    assert json.loads((tmp_path / "teacher_train.json").read_text())["steps"] == 60
    teacher = LocalTeacher(tmp_path)  # plain save_pretrained dir: model + tokenizer
    assert teacher.tokenizer.get_vocab() == tiny_tokenizer.get_vocab()
    scored = evaluate(TorchEngine(from_hf(teacher.model).eval()), items, tiny_tokenizer, max_new_tokens=48)
    assert scored["tool_selection"] == 1.0 and scored["json_validity"] == 1.0
    assert scored["arg_match_strict"] == 1.0 and scored["fixture_hit_rate"] == 1.0
    assert scored["f1_lax_macro"] == 1.0  # the answer states the tool result's values


def test_the_toy_teacher_trains_on_the_configured_device(toy_items, tiny_tokenizer, tmp_path):
    """``device`` reaches the toy teacher as it reaches the student: a GPU the machine lacks is an error, never a
    silent CPU run; where one exists the teacher trains there and is saved loadable on the CPU."""
    import dataclasses

    from transformers import LlamaForCausalLM

    cfg = dataclasses.replace(_cfg(tiny_tokenizer, steps=2, warmup_steps=1), device="cuda")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match=r"sees 0 CUDA device\(s\)"):
            train_toy_teacher(cfg, tiny_tokenizer, toy_items[:4], tmp_path, seed=0)
        return
    train_toy_teacher(cfg, tiny_tokenizer, toy_items[:4], tmp_path, seed=0)
    assert LlamaForCausalLM.from_pretrained(tmp_path).device.type == "cpu"


@pytest.mark.parametrize("decay", [0.0, 0.5])
def test_ema_saves_the_average_of_the_last_phase_weights(toy_items, tiny_tokenizer, tmp_path, decay):
    """``ema_decay`` saves the exponential moving average of the weights after each step of the last phase (the
    curriculum's steps excluded), 0 the last step's: checked against the trajectory ``on_step`` sees."""
    from transformers import LlamaForCausalLM

    seen: list[dict[str, torch.Tensor]] = []
    cfg = _cfg(tiny_tokenizer, steps=8, curriculum_steps=3, warmup_steps=1, ema_decay=decay)
    stats = train_toy_teacher(cfg, tiny_tokenizer, toy_items[:8], tmp_path, seed=0,
                              on_step=lambda step, model: seen.append(
                                  {n: p.detach().clone() for n, p in model.named_parameters()}))  # fmt: skip
    assert len(seen) == 8 and stats["ema_decay"] == decay
    expected = dict(seen[-1])
    if decay:
        expected = dict(seen[3])  # the first step of the last phase
        for weights in seen[4:]:
            expected = {n: decay * expected[n] + (1 - decay) * w for n, w in weights.items()}
    saved = dict(LlamaForCausalLM.from_pretrained(tmp_path).named_parameters())
    for name, value in expected.items():
        torch.testing.assert_close(saved[name].detach(), value, rtol=0, atol=1e-6)
    assert not torch.equal(seen[-1]["model.norm.weight"], seen[3]["model.norm.weight"])  # the weights did move


def test_ema_decay_outside_zero_to_one_is_refused():
    with pytest.raises(ValueError, match=r"ema_decay must be in \[0, 1\), got 1.0"):
        ToyTeacherTrainConfig(ema_decay=1.0)
    with pytest.raises(ValueError, match="ema_decay averages the steps after copy_steps"):
        ToyTeacherTrainConfig(steps=10, curriculum_steps=10, ema_decay=0.9)
