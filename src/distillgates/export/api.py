"""``export_model``: checkpoint -> one multifunction ``.mlpackage`` + contract, lints, ANE op lint, parity.

Run-directory layout (contract.md): ``export/model.mlpackage`` (functions ``prefill_<L>`` per
enumerated length and ``decode``, weights stored once), ``export/contract.json`` and
``export/ane_lint.json`` (the ANE op-eligibility lint), plus on macOS ``export/ane_residency.json``
(``MLComputePlan``, per function) and ``export/coreml_parity.json`` (Core ML's own logits vs
PyTorch, ``MLModel.predict``). With ``export.target: both`` also ``export/model.aimodel`` (Core AI,
:mod:`distillgates.export.coreai`): the same functions, run by Core AI's runtime here (Linux too) for
its parity gate (``gate_inputs.coreai_parity``); without the coreai extra it is recorded as skipped,
with the reason (``contract.coreai.skipped``). With ``export.target: coreai`` the asset alone: no Core ML
conversion, the export's parity is the asset's (``export.source``), the Core ML lints and the ANE op lint are
recorded as skipped with the reason, and a missing coreai extra is an :class:`ExportError`.

One package, as Apple's LLM guide and ANEMLL ship them: each function is converted (and
compressed) on its own, saved to a scratch package, and ``save_multifunction`` joins them; its const
deduplication stores weights that are equal in every function once, so the package weighs one
model's weights, not one per function. Prefill is one static function per length (not one
``EnumeratedShapes`` model): a static function is what the ANE compiles best, and a runtime picks
the function by the padded length. All functions declare the same states, so on macOS 15 one
``MLState`` serves prefill and decode and no KV state is copied (``kv.shared_state``).

The parity gate runs after the package is saved: the exported programs with the weights read back
from each function of the saved package (dequantized int8/int4/palettized constants) against
eager PyTorch, so it measures the weights that ship (:mod:`distillgates.export.roundtrip`); the
weights read back must be the same in every function.
"""

from __future__ import annotations

import copy
import dataclasses
import importlib.metadata
import logging
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import coremltools as ct
import torch

from distillgates.config import Config, ExportConfig, to_dict
from distillgates.export.contract import (
    CONTRACT_VERSION,
    describe_package,
    kv_layout,
    logits_semantics,
    shared_state,
    verify_contract,
)
from distillgates.export.convert import attach_weight_grids, compress, convert_program, export_program
from distillgates.export.coreai import compression, coreai_parity, export_coreai
from distillgates.export.errors import ExportError
from distillgates.export.functions import (
    ASSET,
    COREAI_SOURCE,
    DECODE,
    PACKAGE,
    function_kind,
    function_names,
    prefill_function,
)
from distillgates.export.grid import WeightGrid, input_second_moments
from distillgates.export.headroom import fp16_headroom, residual_alpha, scale_residual
from distillgates.export.layout import ANETransformer, StandardLayout, build_layout, logits_names
from distillgates.export.lint import ane_op_lint, run_lints
from distillgates.export.parity import program_parity
from distillgates.export.roundtrip import (
    SOURCE,
    map_to_parameters,
    package_weights,
    roundtrip_module,
    weight_sharing_errors,
)
from distillgates.export.wrappers import DecodeModule, PrefillModule
from distillgates.io import atomic_write_json, tree_sha256
from distillgates.model import Transformer, load_model, model_fingerprint
from distillgates.runtime.coreai_engine import unavailable

log = logging.getLogger(__name__)

KINDS = ("prefill", "decode")
ANE_LINT_SKIPPED = ("export.target coreai: the ANE op-eligibility lint reads the Core ML package's MIL programs; Core "
                    "AI's own placement is its compute plan (contract.coreai.compute_plan, macOS 27)")
# the export lints read what coremltools converts. Not run on the asset's programs: its decode writes the KV slot with
# index_copy, whose index PyTorch holds as int64 (Core AI's runtime dies on index_put's int32 write)
LINTS_SKIPPED = ("export.target coreai: the export lints (int64 on the attention path, MIL ops, shapes) read the Core "
                 "ML conversion, and there is none")
# ExportResult.seconds: our int8/int4 grids, torch.export, coremltools.convert, coremltools compression of what is
# left, saving the functions and joining them (save_multifunction), reading the package back (spec + dequantized
# weights), the parity runs, the lints
PHASES = ("weight_grids", "torch_export", "convert", "compress", "save_multifunction", "read_back", "parity", "lint",
          "headroom")
# and with target both, Core AI's: coreai-opt compression, torch.export + coreai-torch conversion (with saving the
# asset), the asset's parity run by Core AI's runtime (in a worker process)
COREAI_PHASES = ("coreai_compress", "coreai_convert", "coreai_parity")


@dataclasses.dataclass
class ExportResult:
    """Everything the pipeline and the gates need from one export."""

    out_dir: Path
    packages: dict[str, Path]  # package name -> .mlpackage ({"model": export/model.mlpackage})
    contract_path: Path
    ane_lint_path: Path
    contract: dict[str, Any]
    lint: dict[str, list[str]]  # lint name -> messages (all empty: clean); {} with target coreai (no lint ran)
    ane: dict[str, Any]  # gate_inputs.ane_lint; on macOS also .ane_residency (per function) and .coreml_parity
    coreai: dict[str, Any]  # gate_inputs.coreai_parity ({} with target coreml; {"skipped": reason} without the extra)
    headroom: dict[str, Any]  # gate_inputs.fp16_headroom ({"skipped": reason} without calibration rows)
    parity: dict[str, Any]  # shipped weights vs eager (source, cosine_by_shape, decode_cosine)
    qat_exact: list[str]  # weights exported on their own int8 grid (no re-quantization)
    errors: list[str]  # every reason the export fails (lints, parity, contract, weights not shared)
    seconds: dict[str, float]  # wall seconds per phase (PHASES; the macOS-only measurements under "macos")

    @property
    def _lints(self) -> dict[str, list[str]]:
        lint = self.lint
        return {"int64_on_attention": lint["int64_on_attention"],
                "lint_errors": [m for name, msgs in lint.items() for m in msgs if name != "int64_on_attention"]}

    @property
    def gate_inputs(self) -> dict[str, Any]:
        """``gate_inputs.export``, ``gate_inputs.ane_lint`` (and on macOS ``ane_residency``, ``coreml_parity``)
        of report.json."""
        return {
            "export": {
                "source": self.parity["source"],
                "cosine_by_shape": self.parity["cosine_by_shape"],
                "decode_cosine": self.parity["decode_cosine"],
                **(self._lints if self.lint else {"lints_skipped": LINTS_SKIPPED}),
                "contract_ok": self.contract["ok"],
            },
            **self.ane,
            **({"coreai_parity": self.coreai} if self.coreai else {}),
            "fp16_headroom": self.headroom,
        }


def _save_package(save: Callable[[str], None], path: Path) -> None:
    """``save(tmp_path)`` next to ``path`` then swap in: a reader never sees half a package."""
    tmp = Path(tempfile.mkdtemp(dir=path.parent, prefix=f".{path.name}."))
    try:
        save(str(tmp / path.name))
        if path.exists():
            shutil.rmtree(path)
        (tmp / path.name).rename(path)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


@contextmanager
def _timed(seconds: dict[str, float], phase: str) -> Iterator[None]:
    start = time.perf_counter()
    try:
        yield
    finally:
        seconds[phase] = seconds.get(phase, 0.0) + time.perf_counter() - start


def save_functions(models: dict[str, ct.models.MLModel], path: Path, default: str = DECODE) -> None:
    """One multifunction package at ``path`` holding ``models`` (function name -> single-function model),
    equal weights stored once (``save_multifunction`` deduplicates consts across functions)."""
    with tempfile.TemporaryDirectory(dir=path.parent, prefix=".functions.") as scratch:
        desc = ct.utils.MultiFunctionDescriptor()
        for name, mlmodel in models.items():
            source = str(Path(scratch) / f"{name}.mlpackage")
            mlmodel.save(source)
            desc.add_function(source, src_function_name="main", target_function_name=name)
        desc.default_function_name = default
        _save_package(lambda target: ct.utils.save_multifunction(desc, target), path)


def export_transformer(
    model: Transformer,
    export_cfg: ExportConfig,
    lengths: list[int],
    out_dir: str | Path,
    tokenizer_fingerprint: str,
    cosine_min: float = 0.999,
    raise_on_error: bool = True,
    calibration: list[torch.Tensor] | None = None,
) -> ExportResult:
    """Export an in-memory model (``export_model`` loads it from a checkpoint first).

    ``calibration``: token-id rows ``(1, T)`` (the pipeline passes the first ``export.calibration_rows`` training
    conversations): the fp16 headroom scan (:mod:`distillgates.export.headroom`), and with ``export.calibration:
    clip_search`` the int4 scales (calibrated on a copy of the model; the parity gate compares with ``model`` itself).

    Raises:
        ExportError: a lint fired, the parity of the saved packages' weights is below
            ``cosine_min`` or the contract does not hold (after writing the packages, the
            contract and ANE lint, so they can be inspected). The ANE lint's findings are gated
            (``export`` gates), not export errors: the model still runs.
        RoundTripError: a weight of a saved package maps to no parameter (or one has no weight).
    """
    cfg = model.config
    lengths = sorted(lengths)
    too_long = [n for n in lengths if n > cfg.max_seq_len]
    if too_long:
        raise ExportError(f"shapes.lengths {too_long} exceed the model's max_seq_len {cfg.max_seq_len} (KV cache size)")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model = model.eval()
    seconds: dict[str, float] = {}
    fingerprint = model_fingerprint(model)  # before compression-info buffers are attached
    scaling: dict[str, Any] = {"residual_scale": 1.0}
    if export_cfg.fp16_scaling == "auto" and export_cfg.compute_precision == "fp16" and calibration:
        with _timed(seconds, "headroom"):
            before = fp16_headroom(model, calibration)
        if (alpha := residual_alpha(before)) < 1.0:  # the same logits from a stream fp16 holds (headroom module)
            scaling = {"residual_scale": alpha, "max_peak_unscaled": before["max_peak"],
                       "worst_unscaled": before["worst"]}  # fmt: skip
            model = scale_residual(model, alpha)
    input_moments = None
    exported = model
    if export_cfg.calibration != "none":
        if not calibration:
            raise ExportError(f"export.calibration {export_cfg.calibration!r} needs calibration rows, got none")
        with _timed(seconds, "weight_grids"):
            exported = copy.deepcopy(model)  # calibration snaps its weights to the grid
            input_moments = input_second_moments(exported, calibration, export_cfg.int4_block_size)
    core = build_layout(exported, export_cfg.layout).eval()
    chunks = getattr(core, "lm_head_chunks", None)
    if input_moments is not None and isinstance(chunks, torch.nn.ModuleList):  # copies of the head's rows
        head = input_moments[id(exported.lm_head.weight)]
        input_moments.update({id(chunk.weight): head for chunk in chunks})  # with the head's inputs
    grids: dict[str, WeightGrid] = {}
    if export_cfg.quantize in ("int8", "int4"):  # quantized by the converter, from our grids
        with _timed(seconds, "weight_grids"):
            grids = attach_weight_grids(core, export_cfg.quantize, export_cfg.int4_block_size, input_moments)
    qat_exact = [name for name, grid in grids.items() if grid.exact]
    if export_cfg.target == "coreai":
        coreml: dict[str, Any] = {"packages": {}, "lint": {}, "ane": {"ane_lint": {"skipped": ANE_LINT_SKIPPED}},
                                  "errors": []}  # fmt: skip
    else:
        coreml = _export_coreml(model, core, export_cfg, lengths, out, seconds)
    coreai, coreai_section = _export_coreai(model, exported, grids, export_cfg, lengths, out, seconds, calibration)
    packages, lint, ane = coreml["packages"], coreml["lint"], coreml["ane"]
    shipped_paths = [*packages.values(), *([out / ASSET] if "path" in coreai_section else [])]
    for stale in (set(out.glob("*.mlpackage")) | set(out.glob("*.aimodel"))) - set(shipped_paths):
        shutil.rmtree(stale)  # an earlier layout's (prefill/decode), or an asset of an earlier target
    if packages:
        artifact, weights, parity = packages[PACKAGE].name, " weights", coreml["parity"]  # the weights read back
    else:  # Core AI alone: the export gates read the asset's own parity, run by Core AI's runtime
        artifact, weights = ASSET, ""
        parity = {"source": COREAI_SOURCE, **{k: coreai[k] for k in ("cosine_by_shape", "decode_cosine")}}
    contract: dict[str, Any] = {
        "contract_version": CONTRACT_VERSION,
        "packages": {PACKAGE: {"path": packages[PACKAGE].name, **coreml["described"]}} if packages else {},
        "enumerated_lengths": lengths,
        "kv": kv_layout(cfg),
        "model_config": to_dict(cfg),
        "model_fingerprint": fingerprint,
        "tokenizer_fingerprint": tokenizer_fingerprint,
        "export": to_dict(export_cfg),
        "qat_exact_weights": qat_exact,
        "versions": {"coremltools": ct.__version__, "torch": torch.__version__, **coreai_section.pop("versions", {})},
        # every package as saved (every file in it), the .aimodel too: the identity gate and the Core ML speed worker
        # check them
        "package_sha256": {path.name: tree_sha256(path) for path in shipped_paths},
        **({"coreai": coreai_section} if coreai_section else {}),
    }
    contract["kv"]["shared_state"] = shared_state(contract["packages"] or {"coreai": coreai_section})
    contract_errors = verify_contract(contract, cfg, lengths)
    contract["ok"] = not contract_errors
    contract_path, ane_path = out / "contract.json", out / "ane_lint.json"
    if sys.platform == "darwin" and packages:  # residency (the compute plan) and Core ML's own logits: on the machine
        from distillgates.export.compute_plan import COREML_SOURCE, RESIDENCY_KEY, ane_residency
        from distillgates.export.parity import coreml_parity
        from distillgates.hardware import hardware_header

        package = packages[PACKAGE]
        measured_on = {"hardware_profile_key": hardware_header()["hardware_profile_key"]}  # the gates bind to it
        with _timed(seconds, "macos"):
            ane[RESIDENCY_KEY] = {**ane_residency(package, function_names(lengths), export_cfg.compute_units),
                                  **measured_on}  # fmt: skip
            atomic_write_json(out / f"{RESIDENCY_KEY}.json", ane[RESIDENCY_KEY])
            ane["coreml_parity"] = {"source": COREML_SOURCE, **measured_on, **coreml_parity(
                package, model, lengths, contract["kv"]["shared_state"], export_cfg.compute_units)}  # fmt: skip
            atomic_write_json(out / "coreml_parity.json", ane["coreml_parity"])
    atomic_write_json(contract_path, contract)
    atomic_write_json(ane_path, ane["ane_lint"])
    low = {shape: c for shape, c in parity["cosine_by_shape"].items() if c < cosine_min}
    errors = [m for msgs in lint.values() for m in msgs] + [f"contract: {m}" for m in contract_errors]
    errors += coreml["errors"]
    if low:
        errors.append(f"{artifact} prefill{weights} ({parity['source']}) vs eager cosine below {cosine_min} for "
                      f"shapes {low}")
    if min(parity["decode_cosine"], default=1.0) < cosine_min:
        worst = min(parity["decode_cosine"])
        errors.append(f"{artifact} decode{weights} ({parity['source']}) vs eager cosine below {cosine_min}: "
                      f"{worst:.6f}")
    with _timed(seconds, "headroom"):
        headroom = {**fp16_headroom(model, calibration), **scaling} if calibration else {
            "skipped": "no calibration rows: the pipeline's export step scans its first export.calibration_rows "
                       "training conversations"}  # fmt: skip
    result = ExportResult(out, packages, contract_path, ane_path, contract, lint, ane, coreai, headroom, parity,
                          qat_exact, errors, seconds)  # fmt: skip
    if errors and raise_on_error:
        raise ExportError("export failed:\n  " + "\n  ".join(errors))
    return result


def _export_coreml(
    model: Transformer, core: StandardLayout | ANETransformer, export_cfg: ExportConfig, lengths: list[int], out: Path,
    seconds: dict[str, float],
) -> dict[str, Any]:
    """``out/model.mlpackage`` of ``core`` (the layout, its int8/int4 grids attached), read back from disk:
    ``{"packages", "described", "parity", "lint", "ane", "errors"}`` (parity: the exported programs with the weights
    read back from each function vs eager ``model``; errors: weights not stored once)."""
    cfg = model.config
    modules = {"prefill": PrefillModule(core), "decode": DecodeModule(core)}
    with _timed(seconds, "torch_export"):
        eps = {kind: export_program(modules[kind], kind, lengths) for kind in KINDS}
    functions = function_names(lengths)
    shapes = {**{prefill_function(n): [n] for n in lengths}, DECODE: lengths}  # function -> its input lengths
    models: dict[str, ct.models.MLModel] = {}
    programs: dict[str, Any] = {}
    for name in functions:
        kind, shape = function_kind(name), shapes[name]
        with _timed(seconds, "convert"):
            mlmodel = convert_program(eps[kind], kind, shape, export_cfg, logits_names(cfg.vocab_size))
        with _timed(seconds, "compress"):
            models[name] = compress(mlmodel, export_cfg)
        programs[name] = models[name]._mil_program
    package = out / f"{PACKAGE}.mlpackage"
    with _timed(seconds, "save_multifunction"):
        save_functions(models, package)
    with _timed(seconds, "read_back"):
        described = describe_package(package)  # read back from disk
        stored = package_weights(package)  # function -> dequantized weights, read back from disk
        shipped = {name: map_to_parameters(stored[name], eps[function_kind(name)], f"{package}:{name}")
                   for name in functions}  # fmt: skip
    sharing_errors = weight_sharing_errors(shipped)
    with _timed(seconds, "parity"):
        prefill = {n: roundtrip_module(eps["prefill"], shipped[prefill_function(n)]) for n in lengths}
        parity = {"source": SOURCE, **program_parity(prefill, roundtrip_module(eps["decode"], shipped[DECODE]),
                                                     model, lengths)}  # fmt: skip
    with _timed(seconds, "lint"):
        lint = run_lints(eps, programs, ct.utils.load_spec(str(package)), lengths, cfg.max_seq_len)
        ane = {"ane_lint": ane_op_lint(programs, symbol_size=max(lengths))}
    for name, fn in described["functions"].items():
        fn["kind"] = function_kind(name)
        fn["logits"] = logits_semantics(function_kind(name), cfg.vocab_size)
    errors = [f"{package.name}: {m} (weights are stored once for all functions)" for m in sharing_errors]
    return {"packages": {PACKAGE: package}, "described": described, "parity": parity, "lint": lint, "ane": ane,
            "errors": errors}


def _export_coreai(
    model: Transformer, shipped: Transformer, grids: dict[str, WeightGrid], export_cfg: ExportConfig,
    lengths: list[int], out: Path, seconds: dict[str, float], rows: list[torch.Tensor] | None,
) -> tuple[dict[str, Any], dict[str, Any]]:
    """With ``target: both`` or ``coreai``: ``out/model.aimodel`` of ``shipped`` (``model``, or its copy snapped to the
    calibrated int4 grid), its int8/int4 weights on the Core ML package's ``grids``, and its parity against ``model``
    run by Core AI's runtime;
    ``(gate_inputs.coreai_parity, contract.coreai)``, both ``{"skipped": reason}`` without the coreai extra (target
    both), both ``{}`` with target coreml.

    Raises:
        ExportError: target coreai without the coreai extra (the reason names it).
    """
    if export_cfg.target == "coreml":
        return {}, {}
    reason = unavailable()
    if reason is not None and export_cfg.target == "coreai":
        raise ExportError(f"export.target coreai: {reason}")
    if reason is not None:
        log.warning("export.target both: %s; exported Core ML only", reason)
        return {"skipped": reason}, {"skipped": reason}
    made = export_coreai(shipped, export_cfg, lengths, out, grids)
    seconds.update({f"coreai_{phase}": s for phase, s in made["seconds"].items()})
    with _timed(seconds, "coreai_parity"):
        measured = coreai_parity(made["path"], model, lengths, rows=rows)  # prompts of real text where given
    functions = measured.pop("functions")
    for name, fn in functions.items():
        fn["kind"] = function_kind(name)
        fn["logits"] = logits_semantics(function_kind(name), model.config.vocab_size)
    compressed_by = "coreai-opt" if export_cfg.quantize != "none" else None
    section = {"path": ASSET, "functions": functions, "compute_precision": export_cfg.compute_precision,
               "quantize": export_cfg.quantize, "compressed_by": compressed_by,
               "compression": compression(export_cfg, model.config),
               "versions": {name: importlib.metadata.version(name) for name in ("coreai-torch", "coreai-core",
                                                                                "coreai-opt")}}  # fmt: skip
    gate = {"source": COREAI_SOURCE, **measured}
    if sys.platform == "darwin":  # where Core AI places the operations: the OS framework's plan (macOS 27)
        from distillgates.export.coreai import coreai_compute_plan

        with _timed(seconds, "macos"):
            section["compute_plan"] = coreai_compute_plan(made["path"], export_cfg.compute_units)
    return gate, section


def export_model(
    ckpt_path: str | Path, cfg: Config, out_dir: str | Path, tokenizer_fingerprint: str, raise_on_error: bool = True,
    calibration: list[torch.Tensor] | None = None,
) -> ExportResult:
    """Export the checkpoint at ``ckpt_path`` (its own model config) with ``cfg.export``/``cfg.shapes``."""
    model = load_model(ckpt_path)
    return export_transformer(
        model, cfg.export, list(cfg.shapes.lengths), out_dir, tokenizer_fingerprint,
        cosine_min=cfg.gates.export_cosine_min, raise_on_error=raise_on_error, calibration=calibration,
    )  # fmt: skip
