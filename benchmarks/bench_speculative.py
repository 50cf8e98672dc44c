"""Speculative decoding vs plain greedy (worker alone): tokens/s, identical outputs, acceptance.

Without ``--run-dir`` the student and drafter are random (toy shapes): a random drafter agrees
with a random worker by chance only, so that row measures the mechanism's overhead; the
"twin drafter" row (drafter = a copy of the worker) is the acceptance-1.0 ceiling of the
mechanism, not a real speedup claim. With ``--run-dir`` the trained student and drafter are used.

    .venv/bin/python benchmarks/bench_speculative.py [--run-dir runs/toy]
"""

from __future__ import annotations

import copy

from _bench import common_args, toy_model

from distillgates.runtime import TorchEngine
from distillgates.speed import measure_speculative


def main() -> None:
    parser = common_args(__doc__.splitlines()[0])
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--k", type=int, default=4)
    args = parser.parse_args()
    worker_model = toy_model(args, "student")
    drafter_model = toy_model(args, "drafter")
    vocab = worker_model.config.vocab_size
    prompts = [[(17 * i + 5 * p) % vocab for i in range(24)] for p in range(4)]
    worker = TorchEngine(worker_model)
    rows = [("drafter" if args.run_dir else "random drafter", TorchEngine(drafter_model))]
    rows.append(("twin drafter (ceiling)", TorchEngine(copy.deepcopy(worker_model))))
    sizes = f"worker {worker_model.config.n_params / 1e6:.2f}M, drafter {drafter_model.config.n_params / 1e6:.2f}M"
    print(f"{sizes}, {len(prompts)} prompts x {args.repeats}, {args.new_tokens} new tokens, threads {args.threads}")
    print(f"{'drafter':<24}{'speedup':>8}{'accept':>8}{'tok/step':>9}  identical")
    for name, drafter in rows:
        r = measure_speculative(worker, drafter, prompts, max_new_tokens=args.new_tokens, k=args.k,
                                repeats=args.repeats)  # fmt: skip
        print(f"{name:<24}{r['speedup']:>7.2f}x{r['acceptance_rate']:>8.2f}{r['tokens_per_worker_step']:>9.2f}  "
              f"{r['identical']}")  # fmt: skip


if __name__ == "__main__":
    main()
