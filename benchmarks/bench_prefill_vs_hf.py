"""Prefill TTFT: TorchEngine.prefill vs a Hugging Face forward (use_cache=True) on identical weights.

.venv/bin/python benchmarks/bench_prefill_vs_hf.py [--run-dir runs/toy]
"""

from __future__ import annotations

import torch
from _bench import common_args, median_time, toy_model

from distillgates.hf import to_hf
from distillgates.runtime.torch_engine import TorchEngine


def main() -> None:
    parser = common_args(__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[32, 128, 256])
    args = parser.parse_args()
    model = toy_model(args)
    hf = to_hf(model)
    engine = TorchEngine(model)
    print(f"model {model.config.n_params / 1e6:.2f}M params, threads {args.threads}, median of {args.repeats}")
    print(f"{'prompt':>7}{'HF ms':>10}{'engine ms':>11}{'speedup':>9}  same argmax")
    for length in args.lengths:
        prompt = [(17 * i + 11) % model.config.vocab_size for i in range(length)]
        ids = torch.tensor([prompt])

        def hf_prefill(ids=ids) -> torch.Tensor:
            with torch.no_grad():
                return hf(ids, use_cache=True).logits[0, -1]

        hf_s, _ = median_time(hf_prefill, args.repeats)
        ours_s, _ = median_time(lambda p=prompt: engine.prefill(p), args.repeats)
        same = int(hf_prefill().argmax()) == int(engine.prefill(prompt).argmax())
        print(f"{length:>7}{hf_s * 1e3:>10.2f}{ours_s * 1e3:>11.2f}{hf_s / ours_s:>8.2f}x  {same}")


if __name__ == "__main__":
    main()
