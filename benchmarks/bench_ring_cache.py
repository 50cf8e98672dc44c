"""The sliding layers' ring (rotating local cache) vs the full cache with a window mask, in the exported decode.

Gemma 3 270M (the gemma3 extra's GGUF, converted as ``init_from: gguf:`` converts it): 15 of its 18 layers attend a
512-token window. With ``max_seq_len`` above the window, the export keeps each sliding layer's K/V as a ring of 512
slots (:mod:`distillgates.export.wrappers`), where the full cache holds ``max_seq_len`` positions in every layer.
For each context: the KV state bytes of the exported program (fp16, as Core ML and Core AI's fp16 assets store
them: ``kv_layout``), and the decode module's seconds per token, ring vs full, in eager PyTorch on this CPU (the
program the export converts, not a device's speed): ``--repeats`` interleaved pairs at the last position of the
context, the ratio full/ring per pair, and their median. Both give the same logits at the timed step (checked;
the tests check whole decodes past the window).

    .venv/bin/python benchmarks/bench_ring_cache.py --contexts 1024 2048 4096 --repeats 15 \\
        --out benchmarks/results/ring_cache.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from bench_coreai_export import gemma3

from distillgates.export.contract import kv_layout
from distillgates.export.layout import build_layout
from distillgates.export.wrappers import DecodeModule


def step(module: DecodeModule, token: torch.Tensor, position: torch.Tensor) -> tuple[float, torch.Tensor]:
    """Seconds of one decode call, and its logits (the chunks of a split head joined)."""
    start = time.perf_counter()
    with torch.no_grad():
        out = module(token, position)
    return time.perf_counter() - start, torch.cat(out, -1) if isinstance(out, tuple) else out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--contexts", type=int, nargs="+", default=[1024, 2048, 4096])
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    rows = []
    for context in args.contexts:
        model, _ = gemma3(context, 1)
        cfg = model.config
        core = build_layout(model.eval(), "standard").eval()
        modules = {ring: DecodeModule(core, ring=ring).eval() for ring in (True, False)}
        token, position = torch.tensor([[2]], dtype=torch.int32), torch.tensor([context - 1], dtype=torch.int32)

        for ring in (True, False):  # warm-up (and the states' first writes)
            step(modules[ring], token, position)
        logits = {ring: step(modules[ring], token, position)[1] for ring in (True, False)}
        same = bool(torch.allclose(logits[True], logits[False], rtol=1e-4, atol=1e-4))
        pairs = []
        for i in range(args.repeats):
            order = (True, False) if i % 2 == 0 else (False, True)
            seconds = {ring: step(modules[ring], token, position)[0] for ring in order}
            pairs.append((seconds[True], seconds[False]))
        row = {
            "context": context, "window": cfg.sliding_window, "ring_len": cfg.ring_len,
            "sliding_layers": sum(cfg.sliding(i) for i in range(cfg.n_layers)), "layers": cfg.n_layers,
            "kv_bytes_ring": kv_layout(cfg)["bytes"], "kv_bytes_full": cfg.kv_cache_bytes(context),  # fp16
            "ms_ring": 1000 * statistics.median(p[0] for p in pairs),
            "ms_full": 1000 * statistics.median(p[1] for p in pairs),
            "speedup_median": statistics.median(p[1] / p[0] for p in pairs),
            "speedup_p10_p90": [float(x) for x in torch.tensor([p[1] / p[0] for p in pairs]).quantile(
                torch.tensor([0.1, 0.9])).tolist()],
            "same_logits": same,
        }  # fmt: skip
        rows.append(row)
        print(json.dumps(row), flush=True)
    print("| context | KV state (ring) | KV state (full) | ms/token ring | ms/token full | full/ring [p10, p90] |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        lo, hi = r["speedup_p10_p90"]
        print(f"| {r['context']} | {r['kv_bytes_ring'] / 2**20:.1f} MiB | {r['kv_bytes_full'] / 2**20:.1f} MiB | "
              f"{r['ms_ring']:.1f} | {r['ms_full']:.1f} | {r['speedup_median']:.3f} [{lo:.3f}, {hi:.3f}] |")
    if args.out:
        args.out.write_text(json.dumps({"threads": args.threads, "repeats": args.repeats, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
