"""The toy teacher recipe: train a small ``LlamaForCausalLM`` (or the family ``teacher.model`` describes) on CPU.

Design choices:
- Architecture from ``cfg.teacher.model`` through :func:`distillgates.hf.hf_config`, so the
  teacher is a stock HF model that :class:`~distillgates.teacher.local.LocalTeacher` (and any
  HF tooling) loads from ``save_pretrained``.
- Loss on the assistant-generated tokens only (``generated`` spans of
  :mod:`distillgates.data.targets`: preamble, call, ``<|end|>``, answer, ``<|eos|>``). The prompt
  (an identical system prompt per locale plus a random user request) is most of every sequence;
  predicting it teaches nothing about the task and costs a 1M-parameter model capacity and
  steps. Injected tool results are inputs, never targets, exactly as at inference.
- The facts weigh more: argument-value and integration tokens (``argument_values`` /
  ``integration`` spans) get ``value_weight`` in the token-mean CE. The rest of a turn is
  template text that is learned in a few hundred steps; what takes long is reading the request
  and the tool result, and that is where the gradient should go.
- Curriculum: the first ``curriculum_steps`` steps train on the conversations *without* the
  system prompt. The system prompt is the same ~70 tokens in every item of a locale: it halves
  the tokens a step pays for and dilutes attention while the model still has to discover that
  the answer is read from the request and the tool result (measured: argument values are
  copied after ~400 steps without it, ~800 with it). Once that is learned, the constant prefix
  is taken in within a few hundred steps of the full conversations.
- Copy pretraining: the first ``copy_steps`` steps train on synthetic rows (a random token span,
  then the same span again; loss on the repeat, :func:`copy_rows`). Measured when it was added: a
  teacher trained from scratch on the task alone kept the weather condition (a word only the tool
  result holds) at chance (1 in 5) after 1400 steps; with 200 copy steps first, the same 600 task
  steps copied the condition 33/33 and argument values 0.95 (from 0.82). The rows themselves are
  not learned, though: after the 300 copy steps the teacher predicts 0.9% of the repeated tokens
  (2.3% after 1500), so no induction circuit forms and the phase is a warm start, not the copy
  mechanism a pretrained LLM brings. A value the answer copies from a tool result is learned
  reliably when it is one token (docs/benchmarks.md 11.5); a value copied as the token after a
  matching one (the event ids' old ``evt-208`` form) was not learned by every seed.
- Trained on ``cfg.device`` (CUDA, MPS or the CPU: :func:`~distillgates.devices.resolve_device`), in float32;
  saved from the CPU.
- AdamW, linear warmup then cosine decay to ``min_lr_ratio * lr``; batches are padded to the
  longest sequence in the batch (right padding, padded positions masked out of the loss). The LM
  head runs only at target positions (a third of the tokens; measured 0.28 -> 0.26 s a step).
  Length-grouped batches (HF's ``group_by_length``) were 1.5x faster still, but the teacher got
  worse at equal steps (argument match 0.92 -> 0.84) and no better at equal time.
- Optionally (``ema_decay``) the saved weights are an exponential moving average over the last phase's steps
  (``torch.optim.swa_utils.AveragedModel``): the last step's weights still move with the learning rate's floor,
  and where they land differs by seed (docs/benchmarks.md 11.1).
- No evaluation here: the pipeline's eval step scores the trained teacher once, on the held-out
  items, with the same engine, runner and scorer as the student.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

from distillgates.config import Config
from distillgates.data.targets import encode_item
from distillgates.devices import resolve_device
from distillgates.hf import hf_config, hf_model_class
from distillgates.io import atomic_write_json
from distillgates.progress import ProgressBar
from distillgates.train.schedule import warmup_cosine

log = logging.getLogger(__name__)


Row = tuple[list[int], list[float]]  # input ids, per-token loss weight (0 = not a target)


def encode_for_training(
    tokenizer: Any, items: list[dict[str, Any]], max_len: int, value_weight: float = 1.0
) -> list[Row]:
    """(input ids, loss weights) per item; items longer than ``max_len`` are dropped.

    Weights: 0 outside the generated tokens, ``value_weight`` on argument-value and integration
    tokens, 1 on the other generated tokens.
    """
    out = []
    for item in items:
        encoded = encode_item(tokenizer, item)
        if len(encoded.input_ids) <= max_len:
            m = encoded.masks
            weights = [
                (value_weight if value or fact else 1.0) if generated else 0.0
                for generated, value, fact in zip(m["generated"], m["argument_values"], m["integration"])
            ]
            out.append((encoded.input_ids, weights))
    if not out:
        raise ValueError(f"no training conversation fits teacher.model.max_seq_len={max_len}")
    return out


def copy_rows(vocab_size: int, first_id: int, n: int, length: int, seed: int) -> list[Row]:
    """Synthetic copy rows: a random span of ordinary tokens, then the same span again.

    The loss is on the repeat only, which can be predicted by nothing but looking the tokens up
    in the span (an induction/copy circuit over the whole vocabulary). The toy teacher's 300
    steps do not learn it (module docstring): the phase is a warm start.
    """
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        span = [rng.randrange(first_id, vocab_size) for _ in range(rng.randint(4, length // 2))]
        rows.append((span + span, [0.0] * len(span) + [1.0] * len(span)))
    return rows


def without_system_prompt(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The items with their system message removed (the curriculum's first phase)."""
    return [{**item, "messages": [m for m in item["messages"] if m["role"] != "system"]} for item in items]


def _batch(rows: list[Row], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    T = max(len(ids) for ids, _ in rows)
    ids = torch.tensor([i + [pad_id] * (T - len(i)) for i, _ in rows])  # (B, T)
    weights = torch.tensor([w + [0.0] * (T - len(w)) for _, w in rows])
    return ids, weights  # (B, T), (B, T)


def target_ce(model: Any, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Next-token CE of a ``LlamaForCausalLM`` weighted per target token, normalised by the number of
    target tokens; the LM head runs at target positions only."""
    hidden = model.model(input_ids=ids).last_hidden_state[:, :-1]  # (B, T-1, D)
    w = weights[:, 1:]
    mask = w > 0
    nll = F.cross_entropy(model.lm_head(hidden[mask]).float(), ids[:, 1:][mask], reduction="none")  # (N,)
    return (nll * w[mask]).sum() / mask.sum().clamp(min=1)


def train_toy_teacher(
    cfg: Config, tokenizer: Any, train_items: list[dict[str, Any]], out_dir: str | Path, seed: int = 0,
    on_step: Callable[[int, torch.nn.Module], None] | None = None,
) -> dict[str, Any]:
    """Train the toy teacher and ``save_pretrained`` it (with the tokenizer) to ``out_dir``.

    ``on_step(step, model)`` is called after each optimizer step (benchmarks/bench_teacher_averaging.py keeps
    its own averages of the same trajectory with it).

    Returns:
        training stats: steps, final loss (mean of the last 20 steps), seconds, parameters.
    """
    if cfg.teacher is None or cfg.teacher.model is None:
        raise ValueError("teacher.model is required to train the toy teacher")
    arch, tcfg = cfg.teacher.model, cfg.teacher.train
    if arch.vocab_size < len(tokenizer):
        raise ValueError(f"teacher.model.vocab_size ({arch.vocab_size}) < tokenizer size ({len(tokenizer)})")
    torch.manual_seed(seed)
    rng = random.Random(seed)
    rows = encode_for_training(tokenizer, train_items, arch.max_seq_len, tcfg.value_weight)
    phases: list[tuple[int, list[Row]]] = []  # (step the phase ends at, its rows)
    if tcfg.copy_steps:
        first_id = len(tokenizer.all_special_ids)
        phases.append((tcfg.copy_steps, copy_rows(len(tokenizer), first_id, 4096, 64, seed)))
    if tcfg.curriculum_steps:
        phases.append((tcfg.copy_steps + tcfg.curriculum_steps, encode_for_training(
            tokenizer, without_system_prompt(train_items), arch.max_seq_len, tcfg.value_weight
        )))
    phases.append((tcfg.steps, rows))
    last_phase = tcfg.copy_steps + tcfg.curriculum_steps  # the EMA averages the full conversations' steps only
    device = resolve_device(cfg.device)
    # the family teacher.model describes (LlamaForCausalLM for the toy; Gemma 3's features: Gemma3ForCausalLM)
    model = hf_model_class(arch)(hf_config(arch)).to(device).train()
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.ndim < 2]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": tcfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=tcfg.lr,
        betas=(0.9, 0.95),
    )
    ema = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(tcfg.ema_decay)) if tcfg.ema_decay else None
    losses: list[float] = []
    order: list[int] = []
    start = time.perf_counter()
    bar = ProgressBar("teacher", tcfg.steps, loss=float("nan"))
    for step in range(tcfg.steps):
        if step == phases[0][0]:  # phase over: the next one's rows from here on
            phases.pop(0)
            order = []
        rows = phases[0][1]
        if len(order) < tcfg.batch_size:
            order += rng.sample(range(len(rows)), len(rows))  # epochs of shuffled items
        batch, order = order[: tcfg.batch_size], order[tcfg.batch_size :]
        ids, weights = _batch([rows[i] for i in batch], tokenizer.pad_token_id)
        loss = target_ce(model, ids.to(device), weights.to(device))
        lr = warmup_cosine(step, peak=tcfg.lr, warmup_steps=tcfg.warmup_steps, total_steps=tcfg.steps,
                           min_lr_ratio=tcfg.min_lr_ratio)  # fmt: skip
        for group in optimizer.param_groups:
            group["lr"] = lr
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        if ema is not None and step >= last_phase:
            ema.update_parameters(model)  # the first update copies the weights
        if on_step is not None:
            on_step(step, model)
        losses.append(float(loss.detach()))
        bar.update(1, loss=losses[-1])
        if step % 50 == 0 or step == tcfg.steps - 1:
            log.info("teacher step %d/%d loss %.4f lr %.2e", step, tcfg.steps, losses[-1], lr)
    bar.close()
    seconds = time.perf_counter() - start
    out = Path(out_dir)
    if ema is not None:
        model = ema.module
    model.cpu().eval().save_pretrained(out)
    tokenizer.save_pretrained(out)
    stats = {
        "steps": tcfg.steps,
        "final_loss": sum(losses[-20:]) / len(losses[-20:]),
        "first_loss": losses[0],
        "train_seconds": seconds,
        "n_params": sum(p.numel() for p in model.parameters()),
        "n_train_items": len(rows),
        "loss_on": "generated assistant tokens",
        "value_weight": tcfg.value_weight,
        "curriculum_steps": tcfg.curriculum_steps,
        "copy_steps": tcfg.copy_steps,
        "ema_decay": tcfg.ema_decay,
    }
    atomic_write_json(out / "teacher_train.json", stats)
    return stats
