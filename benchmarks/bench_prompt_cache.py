"""TTFT with the prompt cache: hit vs cold, 512-token system prompt + 32-token user turn.

TTFT here = prefill + first greedy token (tokenization excluded: identical on both paths).
Goal (issue 6): >= 80% lower on a hit (gate floor 30%).

    .venv/bin/python benchmarks/bench_prompt_cache.py [--run-dir runs/toy]
"""

from __future__ import annotations

import statistics

from _bench import common_args, toy_model

from distillgates.runtime.torch_engine import TorchEngine
from distillgates.speed import measure_prompt_cache


def main() -> None:
    parser = common_args(__doc__.splitlines()[0])
    parser.add_argument("--system-len", type=int, default=512)
    parser.add_argument("--user-len", type=int, default=32)
    args = parser.parse_args()
    model = toy_model(args, max_seq_len=1024)
    vocab = model.config.vocab_size
    end = 8  # <|end|> closes the system prompt (tokenizer special id)
    system = [(31 * i + 7) % (vocab - 9) + 9 for i in range(args.system_len - 1)] + [end]
    prompts = [system + [(13 * i + u) % (vocab - 9) + 9 for i in range(args.user_len)] for u in range(4)]
    engine = TorchEngine(model)
    same = all(
        list(engine.generate(p, max_new_tokens=8)) == list(TorchEngine(model).generate(p, max_new_tokens=8))
        for p in prompts
    )
    result = measure_prompt_cache(
        engine, prompts, lambda ids: ids.index(end) + 1 if end in ids else 0, repeats=args.repeats
    )
    cold, hit = statistics.median(result["ttft_cold_ms"]), statistics.median(result["ttft_hit_ms"])
    print(f"model {model.config.n_params / 1e6:.2f}M params, system {args.system_len} + user {args.user_len} tokens, "
          f"threads {args.threads}, {len(result['ttft_cold_ms'])} samples each")  # fmt: skip
    print(f"{'path':<12}{'TTFT p50 ms':>12}")
    print(f"{'cold':<12}{cold:>12.2f}")
    print(f"{'cache hit':<12}{hit:>12.2f}")
    print(f"reduction {1 - hit / cold:.1%}  speedup {cold / hit:.2f}x  hit rate {result['hit_rate']:.2f}  "
          f"cache {result['cache_bytes'] / 2**20:.2f} MiB  identical outputs {same}")  # fmt: skip


if __name__ == "__main__":
    main()
