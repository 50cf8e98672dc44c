"""``export_model``: checkpoint -> prefill/decode ``.mlpackage`` + contract, lints, ANE op lint, parity.

Run-directory layout (contract.md): ``export/prefill.mlpackage``, ``export/decode.mlpackage``,
``export/contract.json`` (one contract for both packages, which share one KV state layout) and
``export/ane_lint.json`` (the ANE op-eligibility lint), plus on macOS ``export/ane_residency.json`` and
``export/ane_residency_decode.json`` (``MLComputePlan``, per package) and ``export/coreml_parity.json``
(Core ML's own logits vs PyTorch, ``MLModel.predict``).

The parity gate runs after the packages are saved: the exported programs with the weights read
back from the saved packages (dequantized int8/palettized constants) against eager PyTorch, so it
measures the weights that ship (:mod:`distillgates.export.roundtrip`).

Two packages, not one multifunction package: each is a plain stateful model a runtime loads
on its own; the decode model continues from a prefill by copying the state buffers
(``MLState.read_state``/``write_state``, same names and shapes in both).
"""

from __future__ import annotations

import dataclasses
import shutil
import sys
import tempfile
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
    verify_contract,
)
from distillgates.export.convert import ExportError, attach_qat_grids, compress, convert_program, export_program
from distillgates.export.layout import build_layout, logits_names
from distillgates.export.lint import ane_op_lint, run_lints
from distillgates.export.parity import program_parity
from distillgates.export.roundtrip import SOURCE, roundtrip_module
from distillgates.export.wrappers import DecodeModule, PrefillModule
from distillgates.io import atomic_write_json, tree_sha256
from distillgates.model import Transformer, load_model, model_fingerprint

KINDS = ("prefill", "decode")


@dataclasses.dataclass
class ExportResult:
    """Everything the pipeline and the gates need from one export."""

    out_dir: Path
    packages: dict[str, Path]  # "prefill"/"decode" -> .mlpackage
    contract_path: Path
    ane_lint_path: Path
    contract: dict[str, Any]
    lint: dict[str, list[str]]  # lint name -> messages (all empty: clean)
    ane: dict[str, Any]  # gate_inputs.ane_lint; on macOS also .ane_residency(_decode) and .coreml_parity
    parity: dict[str, Any]  # shipped weights vs eager (source, cosine_by_shape, decode_cosine)
    qat_exact: list[str]  # weights exported on their own int8 grid (no re-quantization)
    errors: list[str]  # every reason the export fails (lints, parity, contract)

    @property
    def gate_inputs(self) -> dict[str, Any]:
        """``gate_inputs.export``, ``gate_inputs.ane_lint`` (and on macOS ``ane_residency``,
        ``ane_residency_decode``, ``coreml_parity``) of report.json."""
        return {
            "export": {
                "source": self.parity["source"],
                "cosine_by_shape": self.parity["cosine_by_shape"],
                "decode_cosine": self.parity["decode_cosine"],
                "int64_on_attention": self.lint["int64_on_attention"],
                "lint_errors": [m for name, msgs in self.lint.items() for m in msgs if name != "int64_on_attention"],
                "contract_ok": self.contract["ok"],
            },
            **self.ane,
        }


def _save_package(mlmodel: ct.models.MLModel, path: Path) -> None:
    """Save next to ``path`` then swap in: a reader never sees half a package."""
    tmp = Path(tempfile.mkdtemp(dir=path.parent, prefix=f".{path.name}."))
    try:
        mlmodel.save(str(tmp / path.name))
        if path.exists():
            shutil.rmtree(path)
        (tmp / path.name).rename(path)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def export_transformer(
    model: Transformer,
    export_cfg: ExportConfig,
    lengths: list[int],
    out_dir: str | Path,
    tokenizer_fingerprint: str,
    cosine_min: float = 0.999,
    raise_on_error: bool = True,
) -> ExportResult:
    """Export an in-memory model (``export_model`` loads it from a checkpoint first).

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
    fingerprint = model_fingerprint(model)  # before compression-info buffers are attached
    core = build_layout(model, export_cfg.layout).eval()
    qat_exact = attach_qat_grids(core) if export_cfg.quantize == "int8" else []
    modules = {"prefill": PrefillModule(core), "decode": DecodeModule(core)}
    eps = {kind: export_program(modules[kind], kind, lengths) for kind in KINDS}
    packages: dict[str, Path] = {}
    programs: dict[str, Any] = {}
    for kind in KINDS:
        mlmodel = convert_program(eps[kind], kind, lengths, export_cfg, logits_names(cfg.vocab_size))
        mlmodel = compress(mlmodel, export_cfg.quantize, export_cfg.palettize_mode)
        mlmodel.short_description = f"distillgates {kind} ({export_cfg.layout} layout, {export_cfg.quantize})"
        programs[kind] = mlmodel._mil_program
        packages[kind] = out / f"{kind}.mlpackage"
        _save_package(mlmodel, packages[kind])
    described = {kind: describe_package(path) for kind, path in packages.items()}  # read back from disk
    shipped = {kind: roundtrip_module(eps[kind], packages[kind]) for kind in KINDS}  # weights read back from disk
    parity = {"source": SOURCE, **program_parity(shipped, model, lengths)}
    lint = run_lints(eps, programs, ct.utils.load_spec(str(packages["prefill"])), lengths, cfg.max_seq_len)
    contract: dict[str, Any] = {
        "contract_version": CONTRACT_VERSION,
        "packages": {
            kind: {"path": path.name, **described[kind], "logits": logits_semantics(kind, cfg.vocab_size)}
            for kind, path in packages.items()
        },
        "enumerated_lengths": lengths,
        "kv": kv_layout(cfg),
        "model_config": to_dict(cfg),
        "model_fingerprint": fingerprint,
        "tokenizer_fingerprint": tokenizer_fingerprint,
        "export": to_dict(export_cfg),
        "qat_exact_weights": qat_exact,
        "versions": {"coremltools": ct.__version__, "torch": torch.__version__},
        # every package as saved (every file in it): the identity gate and the Core ML speed worker check them
        "package_sha256": {path.name: tree_sha256(path) for path in packages.values()},
    }
    contract_errors = verify_contract(contract, cfg, lengths)
    contract["ok"] = not contract_errors
    ane = {"ane_lint": ane_op_lint(programs, symbol_size=max(lengths))}
    contract_path, ane_path = out / "contract.json", out / "ane_lint.json"
    if sys.platform == "darwin":  # residency (the compute plan) and Core ML's own logits exist only on the machine
        from distillgates.export.compute_plan import COREML_SOURCE, RESIDENCY_KEYS, ane_residency
        from distillgates.export.parity import coreml_parity
        from distillgates.hardware import hardware_header

        measured_on = {"hardware_profile_key": hardware_header()["hardware_profile_key"]}  # the gates bind to it
        for kind, key in RESIDENCY_KEYS.items():
            ane[key] = {**ane_residency(packages[kind], export_cfg.compute_units), **measured_on}
            atomic_write_json(out / f"{key}.json", ane[key])
        ane["coreml_parity"] = {"source": COREML_SOURCE, **measured_on,
                                **coreml_parity(packages["prefill"], packages["decode"], model, lengths)}  # fmt: skip
        atomic_write_json(out / "coreml_parity.json", ane["coreml_parity"])
    atomic_write_json(contract_path, contract)
    atomic_write_json(ane_path, ane["ane_lint"])
    low = {shape: c for shape, c in parity["cosine_by_shape"].items() if c < cosine_min}
    errors = [m for msgs in lint.values() for m in msgs] + [f"contract: {m}" for m in contract_errors]
    if low:
        errors.append(f"prefill.mlpackage weights ({SOURCE}) vs eager cosine below {cosine_min} for shapes {low}")
    if min(parity["decode_cosine"], default=1.0) < cosine_min:
        worst = min(parity["decode_cosine"])
        errors.append(f"decode.mlpackage weights ({SOURCE}) vs eager cosine below {cosine_min}: {worst:.6f}")
    result = ExportResult(out, packages, contract_path, ane_path, contract, lint, ane, parity, qat_exact, errors)
    if errors and raise_on_error:
        raise ExportError("export failed:\n  " + "\n  ".join(errors))
    return result


def export_model(
    ckpt_path: str | Path, cfg: Config, out_dir: str | Path, tokenizer_fingerprint: str, raise_on_error: bool = True
) -> ExportResult:
    """Export the checkpoint at ``ckpt_path`` (its own model config) with ``cfg.export``/``cfg.shapes``."""
    model = load_model(ckpt_path)
    return export_transformer(
        model, cfg.export, list(cfg.shapes.lengths), out_dir, tokenizer_fingerprint,
        cosine_min=cfg.gates.export_cosine_min, raise_on_error=raise_on_error,
    )  # fmt: skip
