"""Decode tokens/s: TorchEngine vs Hugging Face ``generate()`` on identical weights, batch 1, greedy.

Both generate exactly ``--new-tokens`` tokens from the same prompt (HF: ``min_new_tokens`` =
``max_new_tokens``, no EOS). Decode tok/s excludes the prefill: (generate time - prefill time) /
(new_tokens - 1) for both. The engines are timed interleaved (one round = every engine once, in
turn) so that load from other jobs on a shared machine hits them alike; the ratio is the median of
the per-round ratios. Goal (issue 6): >= 3x at the toy shape.

``--shape smollm-135m`` times a SmolLM-135M-shaped model (random weights, fp32), alongside the
engine (its plan in brackets) the same engine over each other matmul plan this machine can run
(``FusedDecoder``'s ``matmuls``: "TorchEngine, mkl", "TorchEngine, packed", ...), and adds the
memory-bandwidth limit: decoding one token reads every weight once, so no engine beats
``read bandwidth / weight bytes per token`` tok/s. Weight bytes = every parameter once (linear
weights, norms, and the LM head; a tied embedding is the LM head and counts once, an embedding
lookup reads one row). Read bandwidth = best of ``--repeats`` sums over a 1 GiB fp32 buffer (far
larger than the caches) at the same thread count, measured in every round (its median is the limit).
Goal (issue 20): >= 80% of the limit.

Batched decoding (issue 20), interleaved with batch 1 in the same way:

- ``--rows B``: decode tok/s of ``B`` rows stepping together (``TorchEngine.write_rows``, the batched
  eval's step: every row one token at its own position) vs one row (``decode_step``), all rows'
  tokens counted; any shape. Where the batched engine runs oneDNN's packed weights, also the same rows
  over MKL alone.
- ``--eval-batch B`` (with ``--run-dir``: its trained student, tokenizer and eval set): items/s of the
  eval (``run_items``, multi-turn with the tool broker) at ``eval.batch_size`` B vs 1, and whether
  every item's output is identical. With ``--shape smollm-135m`` the eval runs the SmolLM-135M body
  (random weights) over the run's vocabulary instead of its student; ``--eval-items N``: the first N items.

    .venv/bin/python benchmarks/bench_decode_vs_hf.py [--compile] [--run-dir runs/toy] [--repeats 15]
    taskset -c 0 .venv/bin/python benchmarks/bench_decode_vs_hf.py --shape smollm-135m --repeats 7
    .venv/bin/python benchmarks/bench_decode_vs_hf.py --run-dir runs/toy --eval-batch 8 --rows 8
    .venv/bin/python benchmarks/bench_decode_vs_hf.py --shape smollm-135m --run-dir runs/toy --eval-batch 8 \
        --eval-items 32 --repeats 5
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable

import torch
from _bench import common_args, toy_model
from bench_loss_memory import SMOLLM_135M

from distillgates.config import ModelConfig
from distillgates.hf import to_hf
from distillgates.model import Transformer
from distillgates.runtime.decoder import MATMULS, FusedDecoder, compiled_available, packed_available
from distillgates.runtime.torch_engine import TorchEngine

BANDWIDTH_BUFFER_BYTES = 2**30  # 1 GiB: ~30x the last-level cache of the boxes this ran on


def seconds(fn: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def weight_bytes(model: Transformer) -> int:
    """Bytes of weights one decode step reads: every parameter once (``parameters()`` lists a tied
    embedding once, as the LM head); an untied embedding table only gives one row, so it is left out."""
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    if not model.config.tie_embeddings:
        total -= model.embed.weight.numel() * model.embed.weight.element_size()
    return total


def read_bandwidth(buffer: torch.Tensor, repeats: int = 3) -> float:
    """Bytes/s of the fastest of ``repeats`` full reads (``sum``) of ``buffer``."""
    return buffer.numel() * buffer.element_size() / min(seconds(buffer.sum) for _ in range(repeats))


def rows_vs_one(model: Transformer, rows: int, steps: int, repeats: int) -> None:
    """Print decode tok/s of ``rows`` rows stepping together vs one row (module docstring)."""
    one, batched = TorchEngine(model), TorchEngine(model, max_batch_size=rows)
    engines = [one, batched]
    if batched.decoder.plan().matmuls == "packed":  # also the same rows over MKL (without oneDNN's packed weights)
        engines.append(TorchEngine(model, max_batch_size=rows))
        engines[-1].decoder = FusedDecoder(model, matmuls="mkl")
    prompts = [[(17 * i + 11 * r) % model.config.vocab_size for i in range(32)] for r in range(rows)]

    def step_one() -> float:
        one.prefill(prompts[0])
        return seconds(lambda: [one.decode_step(5) for _ in range(steps)])

    def step_rows(engine: TorchEngine) -> float:
        engine.write_rows(range(rows), prompts, [0] * rows)
        return seconds(lambda: [engine.write_rows(range(rows), [[5]] * rows, [32 + i] * rows) for i in range(steps)])

    def round_() -> list[float]:
        return [step_one()] + [step_rows(e) for e in engines[1:]]

    round_()  # warm-up
    times = [round_() for _ in range(repeats)]
    tps_one = statistics.median(steps / t[0] for t in times)
    tps_rows = statistics.median(rows * steps / t[1] for t in times)
    ratio = statistics.median(rows * t[0] / t[1] for t in times)
    print(f"decode, {steps} steps: 1 row {tps_one:.1f} tok/s; {rows} rows {tps_rows:.1f} tok/s (all rows) "
          f"= {ratio:.2f}x")  # fmt: skip
    if len(engines) == 3:
        print(f"  {rows} rows over MKL only: {statistics.median(rows * steps / t[2] for t in times):.1f} tok/s; "
              f"packed / MKL only {statistics.median(t[2] / t[1] for t in times):.2f}x")  # fmt: skip


def eval_batch_vs_one(args, batch: int) -> None:  # type: ignore[no-untyped-def]
    """Print eval items/s at ``batch`` vs 1 on ``--run-dir``'s eval set, and whether the outputs are equal."""
    from distillgates.eval.runners import EngineRunner, run_items
    from distillgates.model import model_fingerprint
    from distillgates.rundir import RunDir

    run = RunDir(args.run_dir)
    tokenizer, items = run.tokenizer(), run.items("eval")[: args.eval_items or None]
    if args.shape == "toy":
        model = toy_model(args)
    else:  # the SmolLM-135M body over the run's vocabulary (random weights): the eval needs its tokenizer
        torch.manual_seed(0)
        max_seq_len = toy_model(args).config.max_seq_len  # the run's student: what the eval's prompts fit
        cfg = ModelConfig(**{**SMOLLM_135M, "vocab_size": len(tokenizer)}, max_seq_len=max_seq_len)  # type: ignore[arg-type]
        model = Transformer(cfg).eval()
        print(f"eval model: SmolLM-135M body, vocabulary {cfg.vocab_size}, {cfg.n_params / 1e6:.1f}M params")
    runners = {size: EngineRunner(TorchEngine(model, max_batch_size=size), tokenizer, model_fingerprint(model),
                                  batch_size=size) for size in (1, batch)}  # fmt: skip
    outputs = {size: run_items(runner, items) for size, runner in runners.items()}  # warm-up, and the outputs
    same = sum(a == b for a, b in zip(outputs[1], outputs[batch], strict=True))
    times = [tuple(seconds(lambda r=runner: run_items(r, items)) for runner in runners.values())
             for _ in range(max(1, args.repeats // 5))]  # fmt: skip
    per_s = {size: statistics.median(len(items) / t[i] for t in times) for i, size in enumerate(runners)}
    ratio = statistics.median(t1 / tb for t1, tb in times)
    print(f"eval of {len(items)} items ({len(times)} interleaved rounds): batch 1 {per_s[1]:.2f} items/s; batch "
          f"{batch} {per_s[batch]:.2f} items/s = {ratio:.2f}x; outputs identical to batch 1: {same}/{len(items)}")


def build_model(args) -> Transformer:  # type: ignore[no-untyped-def]
    if args.shape == "toy":
        return toy_model(args)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    max_seq_len = args.prompt_len + args.new_tokens + 16
    return Transformer(ModelConfig(**SMOLLM_135M, max_seq_len=max_seq_len)).eval()  # type: ignore[arg-type]


def main() -> None:
    parser = common_args(__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=["toy", "smollm-135m"], default="toy",
                        help="toy: the config's student (or --run-dir); smollm-135m: random weights, fp32")  # fmt: skip
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--compile", action="store_true", help="also time TorchEngine(compile=True)")
    parser.add_argument("--rows", type=int, default=0, help="also time this many rows decoding together vs one")
    parser.add_argument("--eval-batch", type=int, default=0, help="also time the eval at this batch size vs 1 "
                        "(needs --run-dir)")  # fmt: skip
    parser.add_argument("--eval-items", type=int, default=0, help="with --eval-batch: the first N eval items (0: all)")
    parser.set_defaults(repeats=15)
    args = parser.parse_args()
    if args.eval_batch and not args.run_dir:
        parser.error("--eval-batch needs --run-dir (a trained student, its tokenizer and eval set)")
    model = build_model(args)
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
    chosen = engines[0][1].decoder.plan().matmuls
    weight = model.embed.weight
    available = {"mkl": True, "packed": packed_available(weight.dtype, weight.device),
                 "compiled": compiled_available(weight.dtype, weight.device)}  # fmt: skip
    for matmuls in MATMULS if args.shape != "toy" else ():  # also the matmul plans the engine does not choose
        if matmuls != chosen and available[matmuls]:
            other = TorchEngine(model)
            other.decoder = FusedDecoder(model, matmuls=matmuls)
            engines.append((f"TorchEngine, {matmuls}", other))
    engines[0] = (f"TorchEngine ({chosen})", engines[0][1])
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
    buffer = torch.ones(BANDWIDTH_BUFFER_BYTES // 4) if args.shape != "toy" else None
    bandwidths: list[float] = []
    tps: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(args.repeats):
        for name, (gen, pre) in runs.items():
            tps[name].append((n - 1) / (seconds(gen) - seconds(pre)))
        if buffer is not None:
            bandwidths.append(read_bandwidth(buffer))
    base = tps["HF generate()"]
    print(f"{args.shape}: {model.config.n_params / 1e6:.2f}M params, prompt {len(prompt)}, new tokens {n}, threads "
          f"{args.threads}, {args.repeats} interleaved rounds, load average {os.getloadavg()[0]:.1f}")  # fmt: skip
    limits: list[float] = []  # per round: that round's bandwidth / weight bytes
    if bandwidths:
        nbytes, bandwidth = weight_bytes(model), statistics.median(bandwidths)
        low, high = min(bandwidths) / 1e9, max(bandwidths) / 1e9
        limits = [b / nbytes for b in bandwidths]
        print(f"weights read per token {nbytes / 1e6:.1f} MB, read bandwidth {bandwidth / 1e9:.1f} GB/s (median of "
              f"rounds, {low:.1f}-{high:.1f}), limit {bandwidth / nbytes:.1f} tok/s\n"
              f"'of limit': median over rounds of tok/s / that round's limit")  # fmt: skip
    print(f"{'engine':<24}{'decode tok/s':>14}{'vs HF':>8}  {'ratio p10-p90':>14}{'of limit':>10}  same tokens as HF")
    for name, samples in tps.items():
        ratios = sorted(s / b for s, b in zip(samples, base, strict=True))
        lo, hi = ratios[len(ratios) // 10], ratios[-1 - len(ratios) // 10]
        same = tokens[name] == tokens["HF generate()"]
        of_limit = f"{statistics.median(s / lim for s, lim in zip(samples, limits)):>9.0%}" if limits else f"{'':>9}"
        print(f"{name:<24}{statistics.median(samples):>14.1f}{statistics.median(ratios):>7.2f}x  "
              f"{lo:>6.2f}-{hi:.2f}x {of_limit}  {same}")  # fmt: skip
    del buffer, runs, engines
    if args.rows:
        rows_vs_one(model, args.rows, n, args.repeats)
    if args.eval_batch:
        eval_batch_vs_one(args, args.eval_batch)


if __name__ == "__main__":
    main()
