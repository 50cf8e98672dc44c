"""Constrained JSON decoding overhead per tool call: mask cost, cold cache vs warm cache.

Two workloads on a byte-level BPE trained on toy conversations (vocab 768):
- "realistic": the tokens of the generator's canonical calls fed through the processor (what a
  trained model emits), one mask per token;
- "random model": random logits each step, greedy over the masked logits (long strings, many
  distinct states: the worst case for the cache).
Reported: ms of processor time per call (cold = fresh constraint, warm = shared across calls) and
the ratio cold/warm.

    .venv/bin/python benchmarks/bench_constrained.py [--calls 100]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from distillgates.data.chat import chat_format, render_conversation
from distillgates.data.generator import generate_items
from distillgates.data.registry import TOOLS
from distillgates.data.tools import canonical_call
from distillgates.runtime.constrained import Bounds, TokenVocab, ToolCallConstraint, ToolCallProcessor, TurnConstraint
from distillgates.tokenizer import encode, train_tokenizer


def run_calls(processor: ToolCallProcessor, calls: list[list[int]], vocab_size: int) -> list[float]:
    """Processor time (ms) per call when the call's tokens are emitted one by one."""
    out = []
    logits = torch.zeros(vocab_size)
    for ids in calls:
        start = time.perf_counter()
        for i in range(1, len(ids)):
            processor(ids[:i], logits)
        out.append((time.perf_counter() - start) * 1e3)
    return out


def random_calls(processor: ToolCallProcessor, n: int, vocab_size: int, end: int, tool_call: int) -> list[float]:
    gen = torch.Generator().manual_seed(0)
    out = []
    for _ in range(n):
        ids, start = [tool_call], time.perf_counter()
        while ids[-1] != end:
            ids.append(int(processor(ids, torch.randn(vocab_size, generator=gen) * 3).argmax()))
        out.append((time.perf_counter() - start) * 1e3)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=100)
    args = parser.parse_args()
    torch.set_num_threads(1)
    items = generate_items(0, 300)
    tok = train_tokenizer([render_conversation(it) for it in items], vocab_size=768)
    vocab = TokenVocab.from_tokenizer(tok)
    end, tool_call = tok.convert_tokens_to_ids("<|end|>"), tok.convert_tokens_to_ids("<|tool_call|>")
    calls = [c for it in generate_items(1, 400, split="eval") for c in it["expected_calls"]][: args.calls]
    token_calls = [[tool_call, *encode(tok, canonical_call(c)), end] for c in calls]

    def fresh() -> ToolCallProcessor:
        constraint = ToolCallConstraint(TOOLS, vocab, end, Bounds())
        return ToolCallProcessor(TurnConstraint(constraint, chat_format(tok).call_syntax, end))

    cold = [run_calls(fresh(), [ids], len(tok))[0] for ids in token_calls]
    warm_proc = fresh()
    run_calls(warm_proc, token_calls, len(tok))
    warm = run_calls(warm_proc, token_calls, len(tok))
    rand_cold = [random_calls(fresh(), 1, len(tok), end, tool_call)[0] for _ in range(20)]
    rand_warm_proc = fresh()
    rand_warm = random_calls(rand_warm_proc, args.calls, len(tok), end, tool_call)
    mean_tokens = statistics.mean(len(c) for c in token_calls)
    print(f"tokens per realistic call: {mean_tokens:.1f}")
    print(f"{'workload':<28}{'p50 ms/call':>12}{'p95 ms/call':>12}")
    for name, xs in [
        ("realistic, cold cache", cold),
        ("realistic, warm cache", warm),
        ("random model, cold cache", rand_cold),
        ("random model, shared cache", rand_warm),
    ]:
        xs = sorted(xs)
        print(f"{name:<28}{statistics.median(xs):>12.2f}{xs[int(0.95 * (len(xs) - 1))]:>12.2f}")
    print(f"ratio cold/warm (realistic p50): {statistics.median(cold) / statistics.median(warm):.1f}x")


if __name__ == "__main__":
    main()
