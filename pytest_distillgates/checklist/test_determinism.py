"""Determinism gates: sharded eval equals unsharded per example; fingerprints present and consistent."""

from __future__ import annotations

import pytest

from distillgates.data.chat import prompt_wrapper_sha256
from distillgates.data.fingerprints import dataset_sha256
from distillgates.data.registry import tool_registry_sha256
from distillgates.eval.fingerprints import FINGERPRINT_KEYS
from distillgates.eval.sharding import outputs_sha256, read_outputs

SHARDING = [  # (gate_inputs.determinism key, expected, definition)
    ("coverage", 1.0, "share of eval items present in the union of shards"),
    ("duplicates", 0, "items scored by more than one shard"),
    ("missing", 0, "items scored by no shard"),
    ("mismatches", 0, "items whose sharded result differs from the unsharded run"),
    ("sharded_equal", True, "sharded results equal unsharded per example"),
]


@pytest.mark.determinism
@pytest.mark.parametrize(("key", "expected", "definition"), SHARDING, ids=[s[0] for s in SHARDING])
def test_sharded_equals_unsharded(gate, report, key, expected, definition):
    gate.equals(f"determinism.{key}", report.get(f"gate_inputs.determinism.{key}"), expected, definition)


@pytest.mark.determinism
def test_shards_were_compared_with_the_reported_run(gate, report):
    """The unsharded arm of the check is the evaluation whose quality the report gives (evaluated once): the
    sha256 of ``eval/outputs.jsonl``, computed now, equals the report's and the one the shards were compared with."""
    path = report.run.require(report.run.eval_outputs)
    measured = outputs_sha256(read_outputs(path))
    gate.equals("determinism.outputs_are_reported", measured, report.get("quality.student.outputs_sha256"),
                f"sha256 of {path} (measured now) equals quality.student.outputs_sha256 of the report")
    gate.equals("determinism.unsharded_is_reported", report.get("gate_inputs.determinism.unsharded_sha256"),
                measured, f"the unsharded arm the shards were compared with is {path} (its sha256)")


@pytest.mark.determinism
def test_more_than_one_shard(gate, report):
    per_shard = report.get("gate_inputs.determinism.items_per_shard")
    gate.at_least("determinism.shards_with_items", sum(1 for n in per_shard or [] if n > 0), 2,
                  f"shards that scored at least one eval item (items per shard: {per_shard}): a sharded run must "
                  "actually split the eval set")


@pytest.mark.determinism
@pytest.mark.parametrize("key", FINGERPRINT_KEYS)
def test_fingerprint_present(gate, report, key):
    value = report.get("header.fingerprints").get(key)
    gate.equals(f"fingerprint.{key}.present", isinstance(value, str) and bool(value), True,
                f"report header fingerprint {key} is a non-empty string (found {value!r})")


@pytest.mark.determinism
def test_report_describes_the_eval_set(gate, report):
    """The report's quality was measured on the run's eval set as it is now (a regenerated or edited
    data/eval.jsonl beside a stale report would let the gates vouch for items nobody evaluated)."""
    path = report.run.require(report.run.dataset("eval"))
    gate.equals("fingerprint.dataset_sha256.eval_set", report.get("header.fingerprints.dataset_sha256"),
                dataset_sha256(path), f"report's dataset_sha256 equals the sha256 of {path}")


@pytest.mark.determinism
def test_api_teacher_made_no_retries(gate, report):
    """HTTP determinism mode: an API teacher's KD set is reproducible only if it was built in determinism
    mode (temperature 0, fixed seed) and no request was retried."""
    kind = report.get("gate_inputs.teacher.kind")
    if kind != "openai":
        pytest.skip(f"teacher kind {kind!r}: the HTTP determinism gate applies to API teachers")
    gate.equals("determinism.teacher_determinism_mode", report.get("gate_inputs.teacher.determinism"), True,
                "the KD set was built with teacher.api.determinism: true")
    gate.equals("determinism.teacher_retries", report.get("gate_inputs.teacher.retries"), 0,
                "requests the HTTP teacher retried while building the KD set (any retry fails)")


CODE_FINGERPRINTS = {"tool_registry_sha256": tool_registry_sha256, "prompt_wrapper_sha256": prompt_wrapper_sha256}


@pytest.mark.determinism
@pytest.mark.parametrize("key", ["tokenizer_fingerprint", "tool_registry_sha256", "prompt_wrapper_sha256"])
def test_fingerprint_matches_eval_set(gate, report, eval_set_header, key):
    gate.equals(f"fingerprint.{key}.eval_set", report.get(f"header.fingerprints.{key}"), eval_set_header[key],
                "report fingerprint equals the eval set header's (data/eval.jsonl)")
    if key in CODE_FINGERPRINTS:
        gate.equals(f"fingerprint.{key}.code", report.get(f"header.fingerprints.{key}"), CODE_FINGERPRINTS[key](),
                    "report fingerprint equals the one of the code under test")
