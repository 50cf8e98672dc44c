"""Decode tokens/s: TorchEngine vs Hugging Face ``generate()`` on identical weights, batch 1, greedy.

Both generate exactly ``--new-tokens`` tokens from the same prompt (HF: ``min_new_tokens`` =
``max_new_tokens``, no EOS). Decode tok/s excludes the prefill: (generate time - prefill time) /
(new_tokens - 1) for both. Goal (issue 6): >= 3x.

    .venv/bin/python benchmarks/bench_decode_vs_hf.py [--compile] [--run-dir runs/toy]
"""

from __future__ import annotations

import torch
from _bench import common_args, median_time, toy_model

from distillgates.model import to_hf
from distillgates.runtime import TorchEngine


def main() -> None:
    parser = common_args(__doc__.splitlines()[0])
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--compile", action="store_true", help="also time TorchEngine(compile=True)")
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

    rows = []
    engines = [("TorchEngine", TorchEngine(model))]
    if args.compile:
        engines.append(("TorchEngine+compile", TorchEngine(model, compile=True)))
    hf_tokens = hf_generate()
    hf_total, _ = median_time(hf_generate, args.repeats)
    hf_pre, _ = median_time(hf_prefill, args.repeats)
    hf_tps = (n - 1) / (hf_total - hf_pre)
    rows.append(("HF generate()", hf_tps, True))
    for name, engine in engines:
        ours = list(engine.generate(prompt, max_new_tokens=n))
        total, _ = median_time(lambda e=engine: list(e.generate(prompt, max_new_tokens=n)), args.repeats, warmup=2)
        pre, _ = median_time(lambda e=engine: e.prefill(prompt), args.repeats)
        rows.append((name, (n - 1) / (total - pre), ours == hf_tokens))
    print(f"model {model.config.n_params / 1e6:.2f}M params, prompt {len(prompt)}, new tokens {n}, "
          f"threads {args.threads}")  # fmt: skip
    print(f"{'engine':<22}{'decode tok/s':>14}{'vs HF':>8}  same tokens as HF")
    for name, tps, same in rows:
        print(f"{name:<22}{tps:>14.1f}{tps / hf_tps:>7.2f}x  {same}")


if __name__ == "__main__":
    main()
