"""Speculative decoding vs plain greedy (worker alone): tokens/s, identical outputs, acceptance.

With ``--run-dir`` the trained student (worker) and drafter of a pipeline run answer the run's eval
prompts, rendered and stopped as ``distillgates speed`` does (``--n-prompts`` of them, stop at
``<|end|>``/EOS). Without it the models are random (toy shapes) on synthetic prompts: a random drafter
agrees with a random worker by chance only, so that row measures the mechanism's overhead. The "twin
drafter" row (drafter = a copy of the worker) accepts every draft, but its draft step costs a worker
step: it shows the mechanism at acceptance 1.0, not a speedup claim. First, the per-call cost of the
engine calls the speculative loop makes. The speedup here is timed in this one process (plain and
speculative alternating per prompt): a quick look at the mechanism. The pipeline measures the gated speedup in
fresh speed worker processes (``distillgates.gates.speed_ab.speculative_speedup``).

    .venv/bin/python benchmarks/bench_speculative.py [--run-dir runs/toy]
"""

from __future__ import annotations

import copy
import statistics
import time
from collections.abc import Callable
from pathlib import Path

from _bench import common_args, median_time, toy_model

from distillgates.runtime.speculative import SpeculativeDecoder
from distillgates.runtime.torch_engine import TorchEngine
from distillgates.speed import measure_speculative

VERIFY_ROWS = (2, 5, 9, 17)  # extend_all(k + 1) of a verification


def run_prompts(run_dir: Path, n_prompts: int) -> tuple[list[list[int]], tuple[int, int]]:
    """The eval prompts and stop ids of a pipeline run, as the speed step (``pipeline.step_speed``) builds them."""
    from distillgates.data.chat import render_prompt
    from distillgates.data.dataset import read_dataset
    from distillgates.tokenizer import END, EOS, load_tokenizer

    tokenizer = load_tokenizer(run_dir / "data" / "tokenizer")
    _, items = read_dataset(run_dir / "data" / "eval.jsonl")
    prompts = [tokenizer.encode(render_prompt(item), add_special_tokens=False) for item in items[:n_prompts]]
    return prompts, (tokenizer.convert_tokens_to_ids(END), tokenizer.convert_tokens_to_ids(EOS))


def engine_calls(engine: TorchEngine, prompt: list[int]) -> list[Callable[[], object]]:
    """decode_step, extend_all(n) for each of VERIFY_ROWS (both after ``prompt``), then prefill(prompt)."""
    engine.prefill(prompt)

    def write(n: int) -> None:
        engine.rollback(len(prompt))  # back to the prompt, as a rejected draft is
        engine.extend_all([1] * n) if n > 1 else engine.decode_step(1)

    return [lambda n=n: write(n) for n in (1, *VERIFY_ROWS)] + [lambda: engine.prefill(prompt)]


def interleaved_ms(calls: list[Callable[[], object]], rounds: int, per_round: int = 10) -> list[float]:
    """Median ms per call over ``rounds``, the calls taking turns (a shared machine drifts)."""
    samples: list[list[float]] = [[] for _ in calls]
    for _ in range(rounds):
        for call, out in zip(calls, samples):
            out.append(median_time(call, per_round, warmup=0)[0] * 1e3)
    return [statistics.median(s) for s in samples]


def in_process_speedup(worker: TorchEngine, drafter: TorchEngine, prompts: list[list[int]], repeats: int, k: int,
                       new_tokens: int, stop_ids: tuple[int, ...]) -> float:
    """(speculative tokens / s) / (plain tokens / s), plain and speculative alternating per prompt, after a
    warm-up of each."""
    decoder = SpeculativeDecoder(worker, drafter, k=k)
    list(worker.generate(prompts[0], max_new_tokens=4))
    list(decoder.generate(prompts[0], max_new_tokens=4))
    plain_s = spec_s = 0.0
    plain_n = spec_n = 0
    for _ in range(repeats):
        for prompt in prompts:
            t0 = time.perf_counter()
            plain_n += len(list(worker.generate(prompt, max_new_tokens=new_tokens, stop_ids=stop_ids)))
            t1 = time.perf_counter()
            spec_n += len(list(decoder.generate(prompt, max_new_tokens=new_tokens, stop_ids=stop_ids)))
            plain_s, spec_s = plain_s + t1 - t0, spec_s + time.perf_counter() - t1
    return (spec_n / spec_s) / (plain_n / plain_s)


def main() -> None:
    parser = common_args(__doc__.splitlines()[0])
    parser.add_argument("--new-tokens", type=int, default=48)
    parser.add_argument("--n-prompts", type=int, default=8)
    parser.add_argument("--k", type=int, default=4, help="initial draft length (then cost-aware adaptive)")
    args = parser.parse_args()
    worker_model = toy_model(args, "student")
    drafter_model = toy_model(args, "drafter")
    vocab = worker_model.config.vocab_size
    if args.run_dir:
        prompts, stop_ids = run_prompts(Path(args.run_dir), args.n_prompts)
    else:
        prompts, stop_ids = [[(17 * i + 5 * p) % vocab for i in range(24)] for p in range(4)], ()
    worker = TorchEngine(worker_model)
    rows = [("drafter" if args.run_dir else "random drafter", TorchEngine(drafter_model))]
    rows.append(("twin drafter (accept 1)", TorchEngine(copy.deepcopy(worker_model))))
    sizes = f"worker {worker_model.config.n_params / 1e6:.2f}M, drafter {drafter_model.config.n_params / 1e6:.2f}M"
    print(f"{sizes}, {len(prompts)} prompts x {args.repeats}, {args.new_tokens} new tokens, threads {args.threads}")
    verify = "".join(f"{f'verify {n}':>10}" for n in VERIFY_ROWS)
    print(f"per call ms{'decode':>13}{verify}{f'prefill {len(prompts[0])}':>13}")
    calls = engine_calls(worker, prompts[0]) + engine_calls(rows[0][1], prompts[0])
    costs = interleaved_ms(calls, 10 * args.repeats)
    for name, row in (("worker", costs[: len(calls) // 2]), ("drafter", costs[len(calls) // 2 :])):
        print(f"{name:<11}{row[0]:>13.3f}" + "".join(f"{c:>10.3f}" for c in row[1:-1]) + f"{row[-1]:>13.3f}")
    print(f"{'drafter':<24}{'speedup':>8}{'accept':>8}{'tok/step':>9}{'final k':>8}  identical")
    for name, drafter in rows:
        r = measure_speculative(worker, drafter, prompts, max_new_tokens=args.new_tokens, stop_ids=stop_ids, k=args.k)
        speedup = in_process_speedup(worker, drafter, prompts, args.repeats, args.k, args.new_tokens, stop_ids)
        print(f"{name:<24}{speedup:>7.2f}x{r['acceptance_rate']:>8.2f}{r['tokens_per_worker_step']:>9.2f}"
              f"{r['final_k']:>8}  {r['identical']}")  # fmt: skip


if __name__ == "__main__":
    main()
