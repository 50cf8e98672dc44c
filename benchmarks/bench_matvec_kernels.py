"""Read bandwidth of the one-row matmuls a decode step runs, per kernel, against a plain ``sum()``.

The SmolLM-135M decode step (docs/benchmarks.md section 8) is five one-row matmuls per layer plus the
LM head. This times ``x @ W^T`` for each of those weight shapes with MKL (through ``torch.mm``), with
oneDNN's inner product over a pre-packed weight (``torch.ops.mkldnn._reorder_linear_weight`` /
``_linear_pointwise``, what inductor's CPU freezing uses), and as a reduction over the weight's rows,
``(W * x).sum(-1)``, compiled by inductor (what the engine's ``"compiled"`` plan runs for one row:
``runtime/decoder.py``), over enough copies of each weight (>= 256 MB) that none is read from cache,
and a ``sum()`` over 1 GiB on the same threads: what a bandwidth-bound kernel could read. Best of 3
passes each.

    taskset -c 0 .venv/bin/python benchmarks/bench_matvec_kernels.py --threads 1
    .venv/bin/python benchmarks/bench_matvec_kernels.py --threads 2
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from functools import partial

import torch

# (rows, columns) of the weights a SmolLM-135M decode step reads: LM head, gate/up, QKV, down, o
SHAPES = [(49152, 576), (3072, 576), (960, 576), (576, 1536), (576, 576)]


def best_seconds(call: Callable[[torch.Tensor], object], weights: list[torch.Tensor], passes: int = 3) -> float:
    """Best over ``passes`` of the mean time of ``call`` over every weight (one warm-up pass first)."""
    for w in weights:
        call(w)
    best = float("inf")
    for _ in range(passes):
        start = time.perf_counter()
        for w in weights:
            call(w)
        best = min(best, (time.perf_counter() - start) / len(weights))
    return best


def mkl_row(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return torch.mm(x, weight.t())  # what the engine runs


def onednn_row(x: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")


@torch.compile(dynamic=False, options={"cpp.dynamic_threads": True})
def compiled_row(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return (weight * x).sum(-1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    buffer = torch.ones(256 * 1024 * 1024)  # 1 GiB
    sum_s = best_seconds(lambda b: b.sum(), [buffer])
    print(f"threads {args.threads}: sum() over 1 GiB reads {buffer.numel() * 4 / sum_s / 1e9:.1f} GB/s")
    del buffer
    print(f"{'weight':>12s} {'MKL x@W^T':>14s} {'oneDNN packed':>14s} {'compiled rows':>14s}")
    for rows, cols in SHAPES:
        copies = max(2, int(256e6 // (rows * cols * 4)))
        weights = [torch.randn(rows, cols) for _ in range(copies)]
        x = torch.randn(1, cols)
        packed = [torch.ops.mkldnn._reorder_linear_weight(w, 1) for w in weights]
        mkl = best_seconds(partial(mkl_row, x), weights)
        onednn = best_seconds(partial(onednn_row, x), packed)
        compiled = best_seconds(partial(compiled_row, x), weights)
        torch.testing.assert_close(onednn_row(x, packed[0]), mkl_row(x, weights[0]), atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(compiled_row(x, weights[0])[None], mkl_row(x, weights[0]), atol=1e-4, rtol=1e-4)
        gbs = [rows * cols * 4 / s / 1e9 for s in (mkl, onednn, compiled)]
        print(f"{rows:>6d}x{cols:<5d} " + " ".join(f"{g:>9.1f} GB/s" for g in gbs))


if __name__ == "__main__":
    main()
