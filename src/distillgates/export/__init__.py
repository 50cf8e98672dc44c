"""Core ML export: prefill (enumerated shapes) + stateful decode, compression, contract, lints, ANE checks."""

from distillgates.export.api import ExportResult, export_model, export_transformer
from distillgates.export.compute_plan import ane_residency
from distillgates.export.contract import describe_package, kv_layout, verify_contract
from distillgates.export.convert import ExportError, int8_grid_scale
from distillgates.export.layout import ANETransformer, StandardLayout, build_layout
from distillgates.export.lint import ane_report, lint_int64_attention, lint_mil_ops, lint_shapes
from distillgates.export.parity import coreml_parity, exported_parity
from distillgates.export.wrappers import DecodeModule, PrefillModule

__all__ = [
    "ANETransformer",
    "DecodeModule",
    "ExportError",
    "ExportResult",
    "PrefillModule",
    "StandardLayout",
    "ane_report",
    "ane_residency",
    "build_layout",
    "coreml_parity",
    "describe_package",
    "export_model",
    "export_transformer",
    "exported_parity",
    "int8_grid_scale",
    "kv_layout",
    "lint_int64_attention",
    "lint_mil_ops",
    "lint_shapes",
    "verify_contract",
]
