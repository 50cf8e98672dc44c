"""KD training throughput: our recipe vs a plain ``LlamaForCausalLM`` + KL loop of the same size.

Both train on the same toy batches (same rows, same enumerated shapes, same top-k teacher
signal), measured side by side and interleaved in chunks in one process, so machine noise
hits both alike. Throughput = supervised (assistant-turn) tokens of the item rows per second
of wall time; our recipe additionally pays for CE, process, length (with the coverage check)
and early-tool CE, QAT off. Goal: ratio >= 0.9.

    .venv/bin/python benchmarks/bench_train_throughput.py [--steps 30] [--chunk 5] [--config CONFIG]

Not part of the test suite.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from distillgates.config import load_config
from distillgates.data.chat import render_conversation, render_prompt
from distillgates.data.generator import generate_items
from distillgates.hf import hf_config
from distillgates.model import Transformer
from distillgates.project import EMBEDDED_CONFIG
from distillgates.tokenizer import train_tokenizer
from distillgates.train.recipe import Recipe


def kd_records(items: list[dict], tok, teacher: Transformer, k: int, max_len: int) -> dict[str, dict]:
    out = {}
    for item in items:
        prompt = tok.encode(render_prompt(item), add_special_tokens=False)
        completion = tok.encode(item["reference"], add_special_tokens=False)
        ids = torch.tensor([prompt + completion])[:, :max_len]
        with torch.no_grad():
            logp = teacher(ids).log_softmax(-1)[0, len(prompt) - 1 : -1]  # (n, V)
        vals, top = logp.topk(k, -1)
        out[item["id"]] = {"id": item["id"], "completion_text": item["reference"],
                           "completion_ids": completion[: len(top)], "topk_ids": top.tolist(),
                           "topk_logprobs": vals.tolist()}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", type=Path, default=EMBEDDED_CONFIG)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--chunk", type=int, default=5)
    parser.add_argument("--items", type=int, default=128)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    cfg = load_config(args.config)
    cfg.train.qat.enabled = False
    cfg.train.eval_every = cfg.train.ckpt_every = 0
    cfg.train.steps = args.steps + args.chunk
    items = generate_items(0, args.items)
    tok = train_tokenizer([render_conversation(i) for i in items], vocab_size=cfg.student.vocab_size)
    cfg.student.vocab_size = len(tok)
    lengths = list(cfg.shapes.lengths)
    teacher = Transformer(cfg.student).eval()
    records = kd_records(items, tok, teacher, k=cfg.kd.top_k, max_len=lengths[-1])

    with tempfile.TemporaryDirectory() as tmp:
        ours = Recipe(cfg.train, cfg.student, cfg.shapes, tok, items, [], tmp, kd_records=records, device="cpu",
                      progress=False, speed_prompts=0, max_steps=0)
        ours.setup()
        from transformers import LlamaForCausalLM

        hf = LlamaForCausalLM(hf_config(cfg.student)).train()
        opt = torch.optim.AdamW(hf.parameters(), lr=cfg.train.lr)
        temperature = cfg.train.kd.temperature

        def plain_step(step: int) -> int:
            """Plain loop: HF forward, top-k KL (teacher-weighted CE on the k ids), AdamW."""
            tokens = 0
            opt.zero_grad(set_to_none=True)
            for batch in ours._micro_batches(step):
                logits = hf(input_ids=batch.input_ids).logits.float()  # (B, L, V)
                logp = F.log_softmax(logits / temperature, -1).gather(-1, batch.kd_ids)  # (B, L, k)
                p_t = F.softmax(batch.kd_logprobs / temperature, -1)  # (B, L, k)
                per_pos = (p_t * (p_t.clamp_min(1e-12).log() - logp)).sum(-1)  # (B, L)
                loss = (per_pos * batch.kd_mask).sum() / batch.kd_mask.sum().clamp_min(1)
                loss.backward()
                tokens += batch.n_tokens
            torch.nn.utils.clip_grad_norm_(hf.parameters(), 1.0)
            opt.step()
            return tokens

        def item_tokens(step: int) -> int:
            return sum(b.n_tokens for b in ours._micro_batches(step))

        # warm-up one chunk each (allocator, first-call overheads)
        ours.max_steps = args.chunk
        ours.train()
        for s in range(args.chunk):
            plain_step(s)
        ours_rates, plain_rates = [], []
        step = args.chunk
        while step < args.chunk + args.steps:
            n_tok = sum(item_tokens(s) for s in range(step, step + args.chunk))
            t0 = time.perf_counter()
            ours.max_steps = step + args.chunk
            ours.train()
            ours_rates.append(n_tok / (time.perf_counter() - t0))
            t0 = time.perf_counter()
            n_tok = sum(plain_step(s) for s in range(step, step + args.chunk))
            plain_rates.append(n_tok / (time.perf_counter() - t0))
            step += args.chunk
    o, p = statistics.median(ours_rates), statistics.median(plain_rates)
    print(f"model: {cfg.student.n_params / 1e6:.2f}M params, shapes {lengths}, batch {cfg.train.batch_size}")
    print(f"ours  (KD+CE+process+length+early-tool): {o:10.1f} tokens/s  (chunks: {[round(r) for r in ours_rates]})")
    print(f"plain (LlamaForCausalLM + top-k KL):     {p:10.1f} tokens/s  (chunks: {[round(r) for r in plain_rates]})")
    print(f"ratio ours/plain: {o / p:.3f}  (goal >= 0.9)")


if __name__ == "__main__":
    main()
