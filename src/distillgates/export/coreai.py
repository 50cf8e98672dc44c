"""Core AI export: the prefill/decode wrappers converted by coreai-torch into one multifunction
``export/model.aimodel``, compressed by coreai-opt, and run by Core AI's runtime to measure what ships.

Design choices:
- One design, two backends: the same :mod:`distillgates.export.wrappers` (layout, enumerated
  lengths, state names, logits outputs) go to coremltools for ``model.mlpackage`` and to coreai-torch
  here. The decode's KV write is the one op that differs (``kv_write="index_copy"``: Core AI's runtime
  aborts on the index_put that Core ML lowers to ``slice_update``).
- One asset: ``TorchConverter.add_exported_program`` stages each function (``prefill_<L>`` per
  enumerated length, ``decode``) with the same state names, and ``to_coreai().save_asset`` writes them
  into one ``.aimodel`` whose functions share the states and store the weights once.
- Precision is the model's dtype, as Apple's coreai-models exports do: ``compute_precision: fp16``
  converts an fp16 copy of the model (fp16 weights, activations and states), ``fp32`` the model as is.
- Compression is coreai-opt's, post-training on the linear layers (``nn.Linear``; the embedding, and
  a tied LM head with it, stays at the compute precision): ``int8`` per output channel (``w8``),
  ``int4`` per block of ``export.int4_block_size`` input channels (``w4_per_block``). Its weights are
  re-quantized on coreai-opt's own grid: a QAT'd int8 grid is not kept bit for bit here (the Core ML
  export keeps it), and the parity gate measures the difference.
- The asset is written next to its final path and swapped in (a reader never sees half an asset).
"""

from __future__ import annotations

import copy
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from distillgates.config import ExportConfig
from distillgates.export.contract import expected_io
from distillgates.export.convert import ExportError, example_inputs
from distillgates.export.functions import ASSET, DECODE, function_kind, function_names
from distillgates.export.layout import build_layout
from distillgates.export.wrappers import DecodeModule, PrefillModule, state_names
from distillgates.model import Transformer
from distillgates.runtime.coreai_engine import unavailable

QUANTIZE = ("none", "int8", "int4")  # what coreai-opt does here; palettization: see coreai_quantizer


def coreai_quantizer(module: nn.Module, cfg: ExportConfig) -> Any:
    """coreai-opt's post-training quantizer of ``module``'s ``nn.Linear`` weights for ``cfg.quantize`` (eager
    mode: the wrappers hold KV buffers a graph capture would have to carry)."""
    from coreai_opt.quantization.config.quantization_config import (
        ExecutionMode,
        ModuleQuantizerConfig,
        QuantizerConfig,
    )
    from coreai_opt.quantization.quantizer import Quantizer

    if cfg.quantize not in QUANTIZE:
        raise ExportError(f"export.quantize {cfg.quantize!r}: the Core AI target compresses none/int8/int4 "
                          "(palettization through coreai-opt is not wired yet); use target coreml for it")  # fmt: skip
    if cfg.quantize == "int8":
        linear = ModuleQuantizerConfig.presets.w8()
    else:
        linear = ModuleQuantizerConfig.presets.w4_per_block(block_size=cfg.int4_block_size)
    config = QuantizerConfig(global_config=None, execution_mode=ExecutionMode.EAGER,
                             module_type_configs={"torch.nn.modules.linear.Linear": linear})  # fmt: skip
    return Quantizer(module, config)


def coreai_modules(model: Transformer, cfg: ExportConfig, lengths: list[int]) -> dict[str, nn.Module]:
    """The prefill and decode wrappers as the Core AI asset runs them: a copy of ``model`` at the compute
    precision, its linear weights quantized by coreai-opt (``cfg.quantize``)."""
    if cfg.layout != "standard":
        raise ExportError(f"export.layout {cfg.layout!r}: the Core AI target converts layout standard only")
    copy_ = copy.deepcopy(model).eval()
    if cfg.compute_precision == "fp16":
        copy_ = copy_.half()
    core = build_layout(copy_, "standard").eval()
    prefill: nn.Module = PrefillModule(core).eval()
    if cfg.quantize != "none":
        from coreai_opt import ExportBackend

        quantizer = coreai_quantizer(prefill, cfg)
        with torch.no_grad():
            prefill = quantizer.finalize(quantizer.prepare(example_inputs("prefill", max(lengths))),
                                         ExportBackend.CoreAI)  # fmt: skip
    return {"prefill": prefill, "decode": DecodeModule(prefill.core, kv_write="index_copy").eval()}  # type: ignore[arg-type]


def export_coreai(model: Transformer, cfg: ExportConfig, lengths: list[int], out_dir: str | Path) -> dict[str, Any]:
    """Convert ``model`` into ``out_dir/model.aimodel``; ``{"path", "seconds"}``.

    Raises:
        ExportError: the coreai extra is missing, or the conversion failed.
    """
    reason = unavailable()
    if reason is not None:
        raise ExportError(reason)
    import coreai_torch

    lengths = sorted(lengths)
    seconds: dict[str, float] = {}
    start = time.perf_counter()
    modules = coreai_modules(model, cfg, lengths)
    seconds["compress"] = time.perf_counter() - start
    converter = coreai_torch.TorchConverter(mode=coreai_torch.TorchConverter.Mode.RELEASE)
    io = {kind: expected_io(kind, model.config.vocab_size) for kind in ("prefill", "decode")}
    start = time.perf_counter()
    for name in function_names(lengths):
        kind = function_kind(name)
        length = 1 if name == DECODE else int(name.removeprefix("prefill_"))
        with torch.no_grad():
            program = torch.export.export(modules[kind], example_inputs(kind, length))
            program = program.run_decompositions(coreai_torch.get_decomp_table())
        converter.add_exported_program(
            program, input_names=io[kind]["inputs"], output_names=io[kind]["outputs"],
            state_names=state_names(model.config.n_layers), entrypoint_name=name,
        )  # fmt: skip
    seconds["torch_export"] = time.perf_counter() - start
    start = time.perf_counter()
    try:
        asset = converter.to_coreai()
    except Exception as err:  # coreai-torch raises plain exceptions for an op it cannot lower
        raise ExportError(f"coreai-torch could not convert the wrappers: {type(err).__name__}: {err}") from err
    path = Path(out_dir) / ASSET
    scratch = Path(tempfile.mkdtemp(dir=path.parent, prefix=f".{ASSET}."))
    try:
        asset.save_asset(scratch / ASSET)
        if path.exists():
            shutil.rmtree(path)
        (scratch / ASSET).rename(path)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    seconds["convert"] = time.perf_counter() - start
    return {"path": path, "seconds": seconds}


def coreai_parity(
    path: str | Path, model: Transformer, lengths: list[int], decode_steps: int = 16, rows: list[Tensor] | None = None
) -> dict[str, Any]:
    """The asset's own logits (Core AI's runtime, in a worker process) vs eager PyTorch
    (:func:`distillgates.export.parity.runner_parity`), plus each function's inputs, outputs and states as the
    runtime reads them from the asset (``functions``). ``rows``: real text (token ids ``(1, T)``) the prompts are
    cut from; else random tokens.

    Raises:
        CoreAIRuntimeError: the runtime failed or died (naming the function and the call).
    """
    from distillgates.export.functions import prefill_function
    from distillgates.export.layout import logits_names
    from distillgates.export.parity import runner_parity
    from distillgates.runtime.coreai_engine import CoreAIRunner, CoreAIWorker

    lengths = sorted(lengths)
    with CoreAIWorker(path) as worker:
        prefill = {n: CoreAIRunner(worker, prefill_function(n)) for n in lengths}
        measured = runner_parity(prefill, CoreAIRunner(worker, DECODE), logits_names(model.config.vocab_size), model,
                                 lengths, decode_steps=decode_steps, rows=rows)  # fmt: skip
        return {**measured, "functions": worker.functions}


def coreai_compute_plan(path: str | Path, compute_units: str = "CPU_AND_NE") -> dict[str, Any]:
    """Where Core AI places the asset's operations (``coreai_torch.debugging.compute_plan``; macOS 27, the OS
    framework): the share of placed operations on the Neural Engine and the device histogram, specialized for
    ``compute_units``. Counts operations, not cost: Core AI's plan gives no per-operation cost.

    Raises:
        RuntimeError: off macOS (the compute plan needs the OS framework).
    """
    import asyncio
    import sys

    if sys.platform != "darwin":
        raise RuntimeError(f"Core AI's compute plan needs macOS 27 (the OS framework); none on {sys.platform}")
    from coreai.authoring import AIModelAsset
    from coreai_torch.debugging.compute_plan import ComputePlan

    from distillgates.runtime.coreai_engine import specialization

    program = AIModelAsset.load(path).program
    data = asyncio.run(ComputePlan.from_program(program, specialization(compute_units))).to_dict(program)
    placed = [entry for entry in data["entries"] if entry["residency"] == "PLACED"]
    on_ane = sum("NEURAL_ENGINE" in entry["devices"] for entry in placed)
    return {"source": "Core AI compute plan (coreai_torch.debugging.compute_plan)", "compute_units": compute_units,
            "placed_operations": len(placed), "ane_share": on_ane / len(placed) if placed else None,
            "device_histogram": data["device_histogram"]}  # fmt: skip
