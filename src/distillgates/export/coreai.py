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
- Compression is coreai-opt's, post-training: the linear layers (``nn.Linear``) get ``int8`` per output channel,
  ``int4`` per block of ``export.int4_block_size`` input channels, or ``palettize4/6/8``, a k-means palette per
  tensor or per ``export.palettize_group_size`` output channels (the ANE's format; Apple's iOS presets use groups of
  8 or 32). int8 and int4 linears take the Core ML export's codes and scales (:mod:`distillgates.export.grid`), so both
  targets ship the same linear weights and a QAT'd (or calibrated) grid is kept exactly. The embedding table is stored
  int8 per row, as Apple's presets store it, and a tied LM head reads that one table (the asset stores it once), unless
  the vocabulary is split into head chunks for the ANE (more than 16384 rows: the layout's ``lm_head_chunks``, copies
  of the rows, compressed as linears in both targets).
- The asset is written next to its final path and swapped in (a reader never sees half an asset).
"""

from __future__ import annotations

import copy
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from distillgates.config import ExportConfig, ModelConfig
from distillgates.export.contract import expected_io
from distillgates.export.convert import example_inputs
from distillgates.export.errors import ExportError
from distillgates.export.functions import ASSET, DECODE, function_kind, function_names
from distillgates.export.grid import WeightGrid, quantized_weights, weight_grid
from distillgates.export.layout import build_layout, head_widths
from distillgates.export.wrappers import DecodeModule, PrefillModule, state_names
from distillgates.model import Transformer
from distillgates.runtime.coreai_engine import unavailable

LINEAR = "torch.nn.modules.linear.Linear"
TIED_HEAD = "core.model.lm_head"  # in the prefill wrapper


def compression(cfg: ExportConfig, config: ModelConfig) -> str | None:
    """What coreai-opt does to the weights for ``cfg`` (``contract.coreai.compression``), or ``None``, for a model of
    ``config``: a tied LM head reads the embedding table, unless the vocabulary is split into head chunks
    (:func:`distillgates.export.layout.head_widths`), which are copies of its rows, compressed as linears."""
    if cfg.quantize == "none":
        return None
    if cfg.quantize == "int8":
        linears = "int8 per output channel (the Core ML package's codes and scales)"
    elif cfg.quantize == "int4":
        linears = f"int4 per block of {cfg.int4_block_size} input channels (the Core ML package's codes and scales)"
    else:
        per = f"per {cfg.palettize_group_size} output channels" if cfg.palettize_group_size else "per tensor"
        linears = f"k-means palette of {2 ** int(cfg.quantize.removeprefix('palettize'))} values {per} (coreai-opt)"
    chunks = len(head_widths(config.vocab_size))
    if chunks > 1:
        linears += f" (the LM head too: {chunks} chunks of its rows)"
    reads = config.tie_embeddings and chunks == 1
    return f"linears: {linears}; embedding{' (and the tied LM head)' if reads else ''}: int8 per row (coreai-opt w8)"


def coreai_compressors(cfg: ExportConfig, tied: bool) -> list[Callable[[nn.Module], Any]]:
    """coreai-opt's post-training compressors for ``cfg.quantize``, each made from the module the one before it
    returned (eager mode: the wrappers hold KV buffers a graph capture would have to carry). The ``nn.Linear``
    weights: int8 per output channel, int4 per block of ``cfg.int4_block_size`` input channels, or a k-means palette
    of ``2**n`` values per tensor or per ``cfg.palettize_group_size`` output channels (coreai-opt palettizes by
    k-means only, whatever ``palettize_mode`` the Core ML package uses). The embedding table: int8 per row, and a
    ``tied`` LM head with it (left out of the linears: the head reads the table)."""
    from coreai_opt.quantization.config.quantization_config import (
        ExecutionMode,
        ModuleQuantizerConfig,
        QuantizerConfig,
    )
    from coreai_opt.quantization.quantizer import Quantizer

    head = [TIED_HEAD] if tied else []  # left out of the linears' pass: the embedding's pass compresses its table

    def quantizer(config: ModuleQuantizerConfig, kind: str = LINEAR) -> Callable[[nn.Module], Any]:
        return lambda module: Quantizer(module, QuantizerConfig(
            global_config=None, execution_mode=ExecutionMode.EAGER, module_type_configs={kind: config},
            module_name_configs=dict.fromkeys(head if kind == LINEAR else [], None)))  # fmt: skip

    embedding = quantizer(ModuleQuantizerConfig.presets.w8(), "torch.nn.modules.sparse.Embedding")
    if cfg.quantize == "int8":
        return [quantizer(ModuleQuantizerConfig.presets.w8()), embedding]
    if cfg.quantize == "int4":
        return [quantizer(ModuleQuantizerConfig.presets.w4_per_block(block_size=cfg.int4_block_size)), embedding]
    from coreai_opt.palettization.config.palettization_config import (
        KMeansPalettizerConfig,
        ModuleKMeansPalettizerConfig,
        OpKMeansPalettizerConfig,
    )
    from coreai_opt.palettization.kmeans import KMeansPalettizer
    from coreai_opt.palettization.spec import PalettizationSpec
    from coreai_opt.palettization.spec.granularity import (
        PerGroupedChannelGranularity,
        PerTensorGranularity,
    )

    granularity = (PerGroupedChannelGranularity(axis=0, group_size=cfg.palettize_group_size)
                   if cfg.palettize_group_size else PerTensorGranularity())  # fmt: skip
    bits = int(cfg.quantize.removeprefix("palettize"))
    spec = PalettizationSpec(n_bits=bits, granularity=granularity)  # type: ignore[arg-type]  # 4, 6 or 8
    palette = ModuleKMeansPalettizerConfig(op_input_spec=None, op_output_spec=None, op_state_spec=dict.fromkeys(
        OpKMeansPalettizerConfig.get_default_state_spec(), spec))  # fmt: skip
    palettizer = KMeansPalettizerConfig(global_config=None, module_type_configs={LINEAR: palette},
                                        module_name_configs=dict.fromkeys(head, None))  # fmt: skip
    return [lambda module: KMeansPalettizer(module, palettizer), embedding]


def coreai_modules(
    model: Transformer, cfg: ExportConfig, lengths: list[int], grids: dict[str, WeightGrid] | None = None
) -> dict[str, nn.Module]:
    """The prefill and decode wrappers as the Core AI asset runs them: a copy of ``model`` at the compute
    precision, its weights compressed by coreai-opt (``cfg.quantize``: :func:`coreai_compressors`). int8 and int4
    weights then take the Core ML export's codes and scales, ``grids`` (``{weight name in the standard layout: grid}``,
    :func:`distillgates.export.convert.attach_weight_grids`; by default :func:`distillgates.export.grid.weight_grid`
    of each): both targets ship the same weights, and a QAT'd grid is kept exactly (coreai-opt's own int4 grid is
    ``max|block| / 7.5``, codes in [-8, 7])."""
    if cfg.layout != "standard":
        raise ExportError(f"export.layout {cfg.layout!r}: the Core AI target converts layout standard only")
    copy_ = copy.deepcopy(model).eval()
    if cfg.compute_precision == "fp16":
        copy_ = copy_.half()
    core = build_layout(copy_, "standard").eval()
    prefill: nn.Module = PrefillModule(core).eval()
    if cfg.quantize != "none":
        from coreai_opt import ExportBackend

        for make in coreai_compressors(cfg, model.config.tie_embeddings):
            compressor = make(prefill)
            with torch.no_grad():
                prefill = compressor.finalize(compressor.prepare(example_inputs("prefill", max(lengths))),
                                              ExportBackend.CoreAI)  # fmt: skip
    if cfg.quantize in ("int8", "int4"):
        if grids is None:
            grids = {name: weight_grid(weight, cfg.quantize, cfg.int4_block_size)
                     for name, (_, weight) in quantized_weights(build_layout(model, "standard")).items()}  # fmt: skip
        compressed: Any = prefill.core  # type: ignore[union-attr]  # coreai-opt's parametrized modules
        with torch.no_grad():
            for name, grid in grids.items():
                stored = compressed.get_submodule(name.removesuffix(".weight")).parametrizations.weight[0]
                if stored.quantized_data.shape != grid.codes.shape or stored.scale.shape != grid.scale.shape:
                    raise ExportError(f"{name}: coreai-opt stores {tuple(stored.quantized_data.shape)} codes and "
                                      f"{tuple(stored.scale.shape)} scales, the export grid {tuple(grid.codes.shape)} "
                                      f"and {tuple(grid.scale.shape)}")  # fmt: skip
                stored.quantized_data.copy_(grid.codes.to(torch.int8))
                stored.scale.copy_(grid.scale)
                stored.zero_point.zero_()
    return {"prefill": prefill, "decode": DecodeModule(prefill.core, kv_write="index_copy").eval()}  # type: ignore[arg-type]


def export_coreai(
    model: Transformer, cfg: ExportConfig, lengths: list[int], out_dir: str | Path,
    grids: dict[str, WeightGrid] | None = None,
) -> dict[str, Any]:
    """Convert ``model`` into ``out_dir/model.aimodel`` (int8/int4 on ``grids``: :func:`coreai_modules`);
    ``{"path", "seconds"}``.

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
    modules = coreai_modules(model, cfg, lengths, grids)
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
