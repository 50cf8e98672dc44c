"""Fine-tune a pretrained local teacher on the training rows before KD (``teacher.finetune``), with TRL's SFTTrainer.

An instruct model never tuned on the user's tools does not call them; users first fine-tune the open teacher on
their rows (SFT, often with LoRA), then distil it. This is that step, on the libraries the field uses:

- Rows: each training conversation rendered by the teacher's tokenizer and chat template (the one KD and eval
  use, :func:`~distillgates.teacher.local.teacher_tokenizer`) and encoded by
  :func:`~distillgates.data.targets.encode_item`. Its ``generated`` mask (the assistant turns: preamble, calls,
  end of turn, answer) is TRL's ``assistant_masks`` column: the loss is on the assistant turns only, never on the
  system prompt, a request or a tool result. Rows longer than the largest enumerated shape are left out, as the
  data step leaves them out.
- ``method: lora`` trains peft LoRA adapters and merges them into the weights when saving; ``full`` trains every
  weight. Either way the output is an ordinary Hugging Face checkpoint (no adapter files) with the tokenizer and
  template it was tuned with.
- On ``cfg.device`` (:func:`~distillgates.devices.resolve_device`), bf16 where the device computes it natively;
  float32 weights are saved.
- Written into a staging folder and swapped in whole: a crash leaves no half-written teacher.
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path
from typing import Any

import torch

from distillgates.config import Config
from distillgates.data.targets import encode_item
from distillgates.devices import autocast_dtype, resolve_device
from distillgates.io import staging_dir, swap_in_dir
from distillgates.teacher.local import teacher_tokenizer


def sft_rows(tokenizer: Any, items: list[dict[str, Any]], max_len: int) -> list[dict[str, list[int]]]:
    """``input_ids`` and ``assistant_masks`` (1 on the tokens the teacher must learn to write) per item of at most
    ``max_len`` tokens."""
    rows = []
    for item in items:
        encoded = encode_item(tokenizer, item)
        if len(encoded.input_ids) <= max_len:
            mask = [int(g) for g in encoded.masks["generated"]]
            rows.append({"input_ids": encoded.input_ids, "assistant_masks": mask})
    return rows


def sft_trainer(cfg: Config, base: Path, tokenizer: Any, items: list[dict[str, Any]], output_dir: Path) -> Any:
    """TRL's ``SFTTrainer`` for the checkpoint at ``base`` on ``items`` (``cfg.teacher.finetune``), its scratch
    files under ``output_dir``; the teacher's tokenizer is the trainer's ``processing_class``."""
    try:
        from datasets import Dataset
        from peft import LoraConfig
        from trl import SFTConfig, SFTTrainer
    except ImportError as err:
        raise ImportError(f"teacher.finetune needs TRL and peft: pip install 'distillgates[finetune]' ({err})") \
            from err  # fmt: skip
    from transformers import AutoModelForCausalLM

    assert cfg.teacher is not None and cfg.teacher.finetune is not None
    ft, device = cfg.teacher.finetune, resolve_device(cfg.device)
    tok = teacher_tokenizer(base, tokenizer, cfg.teacher.chat_template)
    if tok.pad_token is None:  # batches are padded (the padding is masked out of attention and loss)
        tok.pad_token = tok.eos_token
    rows = sft_rows(tok, items, max(cfg.shapes.lengths))
    if not rows:
        raise ValueError(f"teacher.finetune: none of the {len(items)} training rows fits {max(cfg.shapes.lengths)} "
                         "tokens (shapes.lengths) in the teacher's template")  # fmt: skip
    peft_config = None
    if ft.method == "lora":
        peft_config = LoraConfig(r=ft.lora.r, lora_alpha=ft.lora.alpha, lora_dropout=ft.lora.dropout,
                                 target_modules=ft.lora.target_modules, task_type="CAUSAL_LM")  # fmt: skip
    args = SFTConfig(
        output_dir=str(output_dir), max_steps=ft.steps, per_device_train_batch_size=ft.batch_size,
        gradient_accumulation_steps=ft.grad_accum, learning_rate=ft.lr, lr_scheduler_type="cosine",
        warmup_steps=ft.warmup_steps, weight_decay=ft.weight_decay, activation_checkpointing=ft.gradient_checkpointing,
        bf16=autocast_dtype(device) is torch.bfloat16, use_cpu=device == "cpu", seed=cfg.seed, data_seed=cfg.seed,
        max_length=None, logging_steps=max(1, ft.steps // 20), save_strategy="no", report_to="none",
        dataloader_num_workers=0,
    )  # fmt: skip
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    return SFTTrainer(model=model, args=args, train_dataset=Dataset.from_list(rows), processing_class=tok,
                      peft_config=peft_config)  # fmt: skip


def finetune_teacher(cfg: Config, base: Path, tokenizer: Any, items: list[dict[str, Any]], out_dir: Path
                     ) -> dict[str, Any]:  # fmt: skip
    """Fine-tune the checkpoint at ``base`` on ``items`` (``cfg.teacher.finetune``) into ``out_dir``, whole or not
    at all; return its figures (rows, trainable parameters, first and last logged loss, seconds, device)."""
    staging = staging_dir(out_dir)
    try:
        trainer = sft_trainer(cfg, base, tokenizer, items, staging / "trainer")
        trained: Any = trainer.model  # the model, or a peft model around it
        trainable = sum(p.numel() for p in trained.parameters() if p.requires_grad)
        started = time.perf_counter()
        trainer.train()
        seconds = time.perf_counter() - started
        tuned = trained.merge_and_unload() if hasattr(trained, "merge_and_unload") else trained
        shutil.rmtree(staging / "trainer", ignore_errors=True)
        tuned.float().cpu().eval().save_pretrained(staging)
        trainer.processing_class.save_pretrained(staging)
        swap_in_dir(staging, out_dir)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    rows = len(trainer.train_dataset)
    assert cfg.teacher is not None and cfg.teacher.finetune is not None
    return {"method": cfg.teacher.finetune.method, "steps": cfg.teacher.finetune.steps, "rows": rows,
            "rows_left_out": len(items) - rows, "trainable_params": trainable,
            "first_loss": losses[0] if losses else None, "last_loss": losses[-1] if losses else None,
            "seconds": round(seconds, 2), "device": str(trainer.args.device), "loss_on": "assistant turns"}  # fmt: skip
