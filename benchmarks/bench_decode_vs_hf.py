"""Decode tokens/s: TorchEngine vs Hugging Face ``generate()`` on identical weights, batch 1, greedy.

Both generate exactly ``--new-tokens`` tokens from the same prompt (HF: ``min_new_tokens`` =
``max_new_tokens``, no EOS). Decode tok/s excludes the prefill: (generate time - prefill time) /
(new_tokens - 1) for both. The engines are timed interleaved (one round = every engine once, in
turn) so that load from other jobs on a shared machine hits them alike; the ratio is the median of
the per-round ratios. Goal (issue 6): >= 3x.

    .venv/bin/python benchmarks/bench_decode_vs_hf.py [--compile] [--run-dir runs/toy] [--repeats 15]
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable

import torch
from _bench import common_args, toy_model

from distillgates.hf import to_hf
from distillgates.runtime.torch_engine import TorchEngine


def seconds(fn: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def main() -> None:
    parser = common_args(__doc__.splitlines()[0])
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--compile", action="store_true", help="also time TorchEngine(compile=True)")
    parser.set_defaults(repeats=15)
    args = parser.parse_args()
    model = toy_model(args)
    hf = to_hf(model)
    prompt = [(17 * i + 11) % model.config.vocab_size for i in range(args.prompt_len)]
    ids = torch.tensor([prompt])
    n = args.new_tokens

    def hf_generate() -> list[int]:
        with torch.no_grad():
            out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                              do_sample=False, eos_token_id=None, pad_token_id=0)  # fmt: skip
        return out[0, len(prompt) :].tolist()

    def hf_prefill() -> None:
        with torch.no_grad():
            hf(ids, use_cache=True)

    # name -> (generate, prefill); every generate returns the new token ids
    runs: dict[str, tuple[Callable[[], list[int]], Callable[[], object]]] = {"HF generate()": (hf_generate, hf_prefill)}
    engines = [("TorchEngine", TorchEngine(model))]
    if args.compile:
        engines.append(("TorchEngine+compile", TorchEngine(model, compile=True)))
    for name, engine in engines:
        runs[name] = (
            lambda e=engine: list(e.generate(prompt, max_new_tokens=n)),
            lambda e=engine: e.prefill(prompt),
        )
    tokens = {name: gen() for name, (gen, _) in runs.items()}  # warm-up (and compilation)
    for gen, pre in runs.values():
        gen(), pre()
    tps: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(args.repeats):
        for name, (gen, pre) in runs.items():
            tps[name].append((n - 1) / (seconds(gen) - seconds(pre)))
    base = tps["HF generate()"]
    print(f"model {model.config.n_params / 1e6:.2f}M params, prompt {len(prompt)}, new tokens {n}, threads "
          f"{args.threads}, {args.repeats} interleaved rounds, load average {os.getloadavg()[0]:.1f}")  # fmt: skip
    print(f"{'engine':<22}{'decode tok/s':>14}{'vs HF':>8}  {'ratio p10-p90':>14}  same tokens as HF")
    for name, samples in tps.items():
        ratios = sorted(s / b for s, b in zip(samples, base, strict=True))
        lo, hi = ratios[len(ratios) // 10], ratios[-1 - len(ratios) // 10]
        same = tokens[name] == tokens["HF generate()"]
        print(f"{name:<22}{statistics.median(samples):>14.1f}{statistics.median(ratios):>7.2f}x  "
              f"{lo:>6.2f}-{hi:.2f}x  {same}")  # fmt: skip


if __name__ == "__main__":
    main()
