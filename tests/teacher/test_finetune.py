"""Teacher fine-tuning (TRL SFTTrainer, peft LoRA) and the teacher check before KD, on a tiny real HF teacher."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from distillgates.config import Config, FinetuneConfig, ShapesConfig, TeacherConfig
from distillgates.teacher.finetune import finetune_teacher, sft_rows, sft_trainer
from distillgates.tokenizer import load_tokenizer

from .conftest import save_tiny_teacher

pytest.importorskip("trl", reason="teacher fine-tuning needs the finetune extra (TRL, peft)")


def finetune_config(base: Path, **finetune: Any) -> Config:
    ft = FinetuneConfig(**{"steps": 3, "batch_size": 2, "warmup_steps": 1, "lr": 1e-2, **finetune})
    return Config(teacher=TeacherConfig(path=str(base), finetune=ft), shapes=ShapesConfig(lengths=[512], mix=[1.0]),
                  device="cpu")  # fmt: skip


def test_the_loss_is_on_the_assistant_turns_only(tiny_tokenizer: Any, toy_items: list[dict[str, Any]]) -> None:
    """What TRL trains on is exactly the assistant turns: the system prompt, the request and every tool result
    are -100 in the labels the trainer built from our masks (were the masks ignored, every token would count)."""
    tool_item = next(item for item in toy_items if item["kind"] == "single")
    rows = sft_rows(tiny_tokenizer, [tool_item], 512)
    ids, mask = rows[0]["input_ids"], rows[0]["assistant_masks"]
    learned = tiny_tokenizer.decode([i for i, m in zip(ids, mask) if m])
    ignored = tiny_tokenizer.decode([i for i, m in zip(ids, mask) if not m])
    call = tool_item["expected_calls"][0]
    assert call["name"] in learned and call["name"] not in ignored.split("<|assistant|>")[-1]
    result = json.dumps(tool_item["fixtures"][0]["result"])
    assert result[:12] not in learned  # the tool result is read, never written
    user = next(m["content"] for m in tool_item["messages"] if m["role"] == "user")
    assert user[:20] in ignored and user[:20] not in learned
    assert 0 < sum(mask) < len(mask) and sft_rows(tiny_tokenizer, [tool_item], len(ids) - 1) == []  # too long: out


def test_trl_builds_its_labels_from_the_assistant_masks(tiny_tokenizer: Any, toy_items: list[dict[str, Any]],
                                                        tmp_path: Path) -> None:  # fmt: skip
    base = save_tiny_teacher(tmp_path / "base", tiny_tokenizer)
    trainer = sft_trainer(finetune_config(base), base, tiny_tokenizer, toy_items, tmp_path / "scratch")
    rows = sft_rows(tiny_tokenizer, toy_items, 512)
    for row, example in zip(rows, trainer.train_dataset):
        expected = [i if m else -100 for i, m in zip(row["input_ids"], row["assistant_masks"])]
        assert example["labels"] == expected


@pytest.mark.parametrize("method", ["lora", "full"])
def test_finetuning_saves_an_ordinary_checkpoint_with_new_weights(
    method: str, tiny_tokenizer: Any, toy_items: list[dict[str, Any]], tmp_path: Path
) -> None:
    """LoRA is merged (no adapter files, the base's parameter names), full trains every weight; either loads with
    ``from_pretrained`` and carries the tokenizer and template it was tuned with."""
    from transformers import AutoModelForCausalLM

    base = save_tiny_teacher(tmp_path / "base", tiny_tokenizer)
    out = tmp_path / "teacher"
    stats = finetune_teacher(finetune_config(base, method=method), base, tiny_tokenizer, toy_items, out)
    assert sorted(p.name for p in out.iterdir() if "adapter" in p.name) == []
    before = AutoModelForCausalLM.from_pretrained(base).state_dict()
    after = AutoModelForCausalLM.from_pretrained(out).state_dict()
    assert after.keys() == before.keys()
    changed = [name for name in before if not torch.equal(before[name], after[name])]
    linear = [name for name in before if name.endswith("proj.weight")]
    assert set(linear) <= set(changed)  # LoRA on every linear layer ("all-linear"), merged
    if method == "lora":  # the adapters touch nothing else
        assert set(changed) == set(linear) and stats["trainable_params"] < sum(v.numel() for v in before.values()) / 4
    else:
        assert "model.embed_tokens.weight" in changed
    assert load_tokenizer(out).chat_template == tiny_tokenizer.chat_template
    assert stats["rows"] == len(toy_items) and stats["device"] == "cpu" and stats["first_loss"] > 0
    assert not list(tmp_path.glob(".teacher*"))  # no staging folder left


def test_a_failed_finetune_keeps_the_previous_teacher(tiny_tokenizer: Any, toy_items: list[dict[str, Any]],
                                                      tmp_path: Path) -> None:  # fmt: skip
    base = save_tiny_teacher(tmp_path / "base", tiny_tokenizer)
    out = tmp_path / "teacher"
    finetune_teacher(finetune_config(base), base, tiny_tokenizer, toy_items, out)
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    with pytest.raises(ValueError, match="none of the 7 training rows fits 16 tokens"):
        cfg = finetune_config(base)
        cfg.shapes = ShapesConfig(lengths=[16], mix=[1.0])
        finetune_teacher(cfg, base, tiny_tokenizer, toy_items, out)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert not list(tmp_path.glob(".teacher*"))


def test_finetune_needs_a_pretrained_local_teacher() -> None:
    with pytest.raises(ValueError, match="finetune needs a pretrained local teacher"):
        TeacherConfig(finetune=FinetuneConfig())
    with pytest.raises(ValueError, match="method must be lora or full"):
        FinetuneConfig(method="qlora")
