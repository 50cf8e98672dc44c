"""Where int8/int4 weights are quantized: coremltools' ``linear_quantize_weights`` pass after conversion
(the export before issue 33) vs our grids as compression-info buffers before conversion (the export now).

Converts the decode function of a SmolLM-135M-shaped model (random weights, ``--layers`` of its 30
layers) both ways in one process, alternating ``--repeats`` times, and records the wall and CPU
seconds of conversion + compression, and how far the two paths' dequantized weights are apart.

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
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = Transformer(ModelConfig(**{**SMOLLM_135M, "n_layers": args.layers}, max_seq_len=2048)).eval()  # type: ignore[arg-type]
    cfg = ExportConfig(quantize=args.quantize)
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
        "wall_s": seconds,
        "cpu_s": cpu,
        "quantized_weights": {"coremltools_pass": len(a), "our_grids": len(b)},
        "max_abs_diff_dequantized": max(float(np.abs(a[k] - b[k]).max()) for k in a) if a.keys() == b.keys() else None,
    }
    out = Path(__file__).resolve().parent / "results" / f"export_quantize_paths_{args.quantize}_{args.layers}layers.json"
    out.write_text(json.dumps(record, indent=2) + "\n")
    print(json.dumps(record, indent=2))


if __name__ == "__main__":
    main()
