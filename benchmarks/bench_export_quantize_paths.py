"""Where int8/int4 weights are quantized: coremltools' ``linear_quantize_weights`` pass after conversion
(the export before issue 33) vs our grids as compression-info buffers before conversion (the export now).

Converts the decode function of a SmolLM-135M-shaped model (random weights, ``--layers`` of its 30
layers) both ways in one process, alternating ``--repeats`` times, and records the wall and CPU
seconds of conversion + compression, and how far the two paths' dequantized weights are apart. It
also times the int8 grid search over the model's linear weights (is a weight on a QAT grid?): the
search over every row, as before issue 33, and the search that stops at the first rows off grid.

    taskset -c 0 .venv/bin/python benchmarks/bench_export_quantize_paths.py --layers 4 --quantize int8

Linux or macOS; not part of the test suite.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
import torch
from bench_loss_memory import SMOLLM_135M

from distillgates.config import ExportConfig, ModelConfig
from distillgates.export.convert import attach_weight_grids, compress, convert_program, export_program
from distillgates.export.grid import _grid_scale_rows, int8_grid_scale
from distillgates.export.layout import build_layout, logits_names
from distillgates.export.wrappers import DecodeModule
from distillgates.model import Transformer


def _dequantized(mlmodel) -> dict[str, np.ndarray]:
    ops = mlmodel._mil_program.functions["main"].operations
    return {op.outputs[0].name.split("_weight")[0]: np.asarray(op.materialized_val_inference(), np.float32)
            for op in ops if op.op_type == "constexpr_blockwise_shift_scale"}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--quantize", default="int8", choices=["int8", "int4"])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--grid-search-only", action="store_true", help="only the grid search timing (no conversion)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = Transformer(ModelConfig(**{**SMOLLM_135M, "n_layers": args.layers}, max_seq_len=2048)).eval()  # type: ignore[arg-type]
    cfg = ExportConfig(quantize=args.quantize)
    linears = [m.weight for m in model.modules() if isinstance(m, torch.nn.Linear)]
    start = time.process_time()
    for weight in linears:  # every chunk of rows searched, then the result thrown away for a weight off grid
        w = weight.detach().float().reshape(weight.shape[0], -1)
        [_grid_scale_rows(rows) for rows in w.split(max(1, (1 << 22) // (128 * w.shape[1])))]
    grid_all_rows = time.process_time() - start
    start = time.process_time()
    off_grid = sum(int8_grid_scale(weight) is None for weight in linears)
    grid_first_rows = time.process_time() - start
    if args.grid_search_only:
        print(
            json.dumps(
                {
                    "layers": args.layers,
                    "all_rows": round(grid_all_rows, 2),
                    "stop_at_first_off_grid_rows": round(grid_first_rows, 2),
                    "off_grid": off_grid,
                }
            )
        )
        return
    names = logits_names(model.config.vocab_size)
    plain = export_program(DecodeModule(build_layout(model, "standard").eval()), "decode", [128])
    core = build_layout(model, "standard").eval()
    attach_weight_grids(core, args.quantize, cfg.int4_block_size)
    with_grids = export_program(DecodeModule(core), "decode", [128])
    seconds: dict[str, list[float]] = {"coremltools_pass": [], "our_grids": []}
    cpu: dict[str, list[float]] = {"coremltools_pass": [], "our_grids": []}
    models = {}
    for _ in range(args.repeats):
        for path, ep in (("coremltools_pass", plain), ("our_grids", with_grids)):
            start, cpu_start = time.perf_counter(), time.process_time()
            models[path] = compress(convert_program(ep, "decode", [128], cfg, names), cfg)
            seconds[path].append(round(time.perf_counter() - start, 1))
            cpu[path].append(round(time.process_time() - cpu_start, 1))
    a, b = _dequantized(models["coremltools_pass"]), _dequantized(models["our_grids"])
    record = {
        "model": {**SMOLLM_135M, "n_layers": args.layers, "params": model.config.n_params},
        "quantize": args.quantize,
        "grid_search_cpu_s": {
            "all_rows": round(grid_all_rows, 2),
            "stop_at_first_off_grid_rows": round(grid_first_rows, 2),
            "linear_weights": len(linears),
            "off_grid": off_grid,
        },
        "wall_s": seconds,
        "cpu_s": cpu,
        "quantized_weights": {"coremltools_pass": len(a), "our_grids": len(b)},
        "max_abs_diff_dequantized": max(float(np.abs(a[k] - b[k]).max()) for k in a) if a.keys() == b.keys() else None,
    }
    out = (
        Path(__file__).resolve().parent / "results" / f"export_quantize_paths_{args.quantize}_{args.layers}layers.json"
    )
    out.write_text(json.dumps(record, indent=2) + "\n")
    print(json.dumps(record, indent=2))


if __name__ == "__main__":
    main()
