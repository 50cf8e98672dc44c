"""Evaluation: scorer, tool broker, runners, sharded eval, fingerprints and the report schema."""

from distillgates.eval.broker import ToolBroker, fixture_key
from distillgates.eval.evaluate import build_runner, collect_fingerprints, evaluate, run_spec, sharded_determinism
from distillgates.eval.fingerprints import FINGERPRINT_KEYS, FingerprintError, check_fingerprints, items_sha256
from distillgates.eval.report import (
    SCHEMA_VERSION,
    ReportError,
    build_report,
    read_report,
    render_report,
    report_markdown,
    report_schema,
    validate_report,
    write_report,
)
from distillgates.eval.runners import EngineRunner, HFRunner, TeacherRunner, reference_output, run_item, run_items
from distillgates.eval.scorer import score
from distillgates.eval.sharding import determinism_check, merge_shards, shard_items, shard_of

__all__ = [
    "FINGERPRINT_KEYS",
    "SCHEMA_VERSION",
    "EngineRunner",
    "FingerprintError",
    "HFRunner",
    "ReportError",
    "TeacherRunner",
    "ToolBroker",
    "build_report",
    "build_runner",
    "check_fingerprints",
    "collect_fingerprints",
    "determinism_check",
    "evaluate",
    "fixture_key",
    "items_sha256",
    "merge_shards",
    "read_report",
    "reference_output",
    "render_report",
    "report_markdown",
    "report_schema",
    "run_item",
    "run_items",
    "run_spec",
    "score",
    "shard_items",
    "shard_of",
    "sharded_determinism",
    "validate_report",
    "write_report",
]
