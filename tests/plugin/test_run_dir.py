"""--run-dir: every gate passes on a good run and fails when its criterion is violated."""

from __future__ import annotations

import copy
import json
import re
import sys

import pytest

from distillgates.export.api import ANE_LINT_SKIPPED, LINTS_SKIPPED
from distillgates.export.functions import COREAI_SOURCE
from distillgates.model import model_fingerprint, save_model
from distillgates.rundir import RunDir

from .conftest import DELETE, SHAPES, good_item_scores, project_file, tiny_student, tps_per_process

NAN = float("nan")
EXTRA = "Core AI needs the coreai extra (coreai_torch is not installed): pip install 'distillgates[coreai]'"


def lose_f1(field: str, shapes: list[str] | tuple[str, ...], n_per_shape: int = 8) -> list[dict]:
    """The good item scores with ``n_per_shape`` items of each of ``shapes`` (of 120, at 1.0) dropped to 0."""
    rows = good_item_scores()
    for shape in shapes:
        for row in [r for r in rows if r["shape"] == shape and r[field] == 1.0][:n_per_shape]:
            row[field] = 0.0
    return rows

GATE_FILES = ["quality", "f1_drift", "privacy", "determinism", "identity", "latency_loss", "shape_drift", "qat_cosine",
              "export", "ane_residency", "coreml_parity", "coreai_parity", "prompt_cache", "speculative",
              "speed_targets"]
BASELINED = ["gates/test_f1_drift.py", "gates/test_shape_drift.py", "gates/test_ane_residency.py"]

# (id, {dotted report key: value}, gate file, failing tests, fragment of the failure message)
VIOLATIONS = [
    ("lower_f1", {"quality.student.f1_lax_macro": 0.5}, "quality", ["test_quality[f1_lax_macro]"],
     "measured 0.5 >= threshold 0.9"),
    ("lower_tool_selection", {"quality.student.tool_selection": 0.8}, "quality", ["test_quality[tool_selection]"],
     "0.8"),
    ("invalid_json", {"quality.student.json_validity": 0.97}, "quality", ["test_quality[json_validity]"], "0.97"),
    ("fixture_misses", {"quality.student.fixture_hit_rate": 0.9}, "quality", ["test_quality[fixture_hit_rate]"],
     "0.9"),
    # 6.7% of the items lose their F1 (8 of 120 per shape): mean change -0.0667, significant
    ("f1_lax_drift", {"item_scores": lose_f1("f1_lax", SHAPES)}, "f1_drift", ["test_f1_drift[lax]"],
     "n=360 items (24 changed), mean change -0.0667"),
    ("f1_strict_drift", {"item_scores": lose_f1("f1_strict", SHAPES)}, "f1_drift", ["test_f1_drift[strict]"],
     "mean change -0.0667"),
    ("leaked_pii", {"quality.student.privacy_ok_rate": 0.99}, "privacy", ["test_privacy_ok_rate"], "0.99 >= "),
    ("control_calls_tool", {"quality.student.controls_with_integration": 1}, "privacy",
     ["test_controls_with_integration"], "measured 1 <= threshold 0"),
    ("nondeterministic_shards", {"gate_inputs.determinism.sharded_equal": False,
                                 "gate_inputs.determinism.mismatches": 3}, "determinism",
     ["test_sharded_equals_unsharded[mismatches]", "test_sharded_equals_unsharded[sharded_equal]"], "mismatches"),
    ("shard_gaps", {"gate_inputs.determinism.coverage": 0.9, "gate_inputs.determinism.duplicates": 2,
                    "gate_inputs.determinism.missing": 20}, "determinism",
     ["test_sharded_equals_unsharded[coverage]", "test_sharded_equals_unsharded[duplicates]",
      "test_sharded_equals_unsharded[missing]"], "coverage"),
    ("shards_compared_with_another_run", {"gate_inputs.determinism.unsharded_sha256": "x" * 64}, "determinism",
     ["test_shards_were_compared_with_the_reported_run"], "unsharded_is_reported"),
    ("single_shard", {"gate_inputs.determinism.items_per_shard": [360, 0]}, "determinism",
     ["test_more_than_one_shard"], "shards_with_items"),
    ("outputs_not_reported", {"quality.student.outputs_sha256": "x" * 64}, "determinism",
     ["test_shards_were_compared_with_the_reported_run"], "outputs_are_reported"),
    ("api_teacher_retried", {"gate_inputs.teacher.retries": 2}, "determinism",
     ["test_api_teacher_made_no_retries"], "measured 2 == threshold 0"),
    ("api_teacher_not_deterministic", {"gate_inputs.teacher.determinism": False}, "determinism",
     ["test_api_teacher_made_no_retries"], "teacher.api.determinism: true"),
    ("missing_teacher_inputs", {"gate_inputs.teacher": DELETE}, "determinism",
     ["test_api_teacher_made_no_retries"], "missing key 'gate_inputs.teacher.kind'"),
    ("missing_fingerprint", {"header.fingerprints.runner_fingerprint": DELETE}, "determinism",
     ["test_fingerprint_present[runner_fingerprint]"], "found None"),
    ("null_fingerprint", {"header.fingerprints.runner_fingerprint": None}, "determinism",
     ["test_fingerprint_present[runner_fingerprint]"], "runner_fingerprint"),
    ("registry_of_other_code", {"header.fingerprints.tool_registry_sha256": "0" * 64,
                                "eval_set.tool_registry_sha256": "0" * 64}, "determinism",
     ["test_fingerprint_matches_eval_set[tool_registry_sha256]"], "fingerprint.tool_registry_sha256.code"),
    ("prompt_wrapper_of_other_code", {"header.fingerprints.prompt_wrapper_sha256": "0" * 64,
                                      "eval_set.prompt_wrapper_sha256": "0" * 64}, "determinism",
     ["test_fingerprint_matches_eval_set[prompt_wrapper_sha256]"], "fingerprint.prompt_wrapper_sha256.code"),
    ("other_tokenizer", {"header.fingerprints.tokenizer_fingerprint": "other"}, "determinism",
     ["test_fingerprint_matches_eval_set[tokenizer_fingerprint]"], "'other'"),
    ("eval_set_replaced", {"header.fingerprints.dataset_sha256": "e" * 64}, "determinism",
     ["test_report_describes_the_eval_set"], "fingerprint.dataset_sha256.eval_set FAILED: measured 'eeee"),
    # a report left from before the eval step re-scored the outputs: the quality gates would read the old scoring
    ("report_scored_apart", {"quality.student.f1_lax_macro": 0.95}, "identity",
     ["test_report_scores_are_the_item_scores"], "if not, run the report step again"),
    ("stale_report", {"header.fingerprints.model_fingerprint": "f" * 64}, "identity",
     ["test_report_describes_the_checkpoint"], f"measured '{'f' * 64}' == threshold"),
    ("longer_outputs", {"quality.student.median_tokens_out": 28.0}, "latency_loss", ["test_median_tokens_out"],
     "<= threshold 0.85"),
    ("teacher_answered_nothing", {"quality.teacher.median_tokens_out": 0}, "latency_loss", ["test_median_tokens_out"],
     "median_tokens_out_ratio FAILED: measured None"),
    ("false_tool_calls", {"quality.student.false_tool_calls_tool_absent": 2}, "latency_loss",
     ["test_no_new_false_tool_calls"], "measured 2 <= threshold 0"),
    ("late_first_tool_call", {"quality.student.ttfa_tokens_p95": 30.0}, "latency_loss", ["test_ttfa_p95"],
     "ttfa_tokens_p95 FAILED: measured 30 <= threshold 25"),
    ("shape_drift", {"item_scores": lose_f1("f1_lax", ["256"])}, "shape_drift",
     ["test_shape_drift[256]"], "f1_lax_macro[shape=256]: significant drop beyond tolerance: n=120 items"),
    ("shape_without_eval_items", {"item_scores": [r for r in good_item_scores() if r["shape"] != "256"]},
     "shape_drift", ["test_shape_drift[256]"], "f1_lax_macro[shape=256] FAILED: measured None"),
    ("enumerated_shape_not_exported", {"header.config.shapes.lengths": [128, 192, 256, 320]}, "export",
     ["test_export_cosine[320]"], "export.cosine[shape=320]"),
    ("qat_low_cosine", {"gate_inputs.qat.probe_cosine_min": 0.95, "gate_inputs.qat.probe_cosine.layer0_mlp": 0.95},
     "qat_cosine", ["test_probe_cosine_min", "test_probe_cosine_every_module"], "0.95"),
    ("qat_broken_weights_nan", {"gate_inputs.qat.probe_cosine_min": NAN, "gate_inputs.qat.has_nan": True,
                                "gate_inputs.qat.probe_cosine.layer0_attn": NAN}, "qat_cosine",
     ["test_probe_cosine_min", "test_probe_cosine_every_module", "test_no_nan"], "nan"),
    ("qat_probe_missing", {"gate_inputs.qat": DELETE}, "qat_cosine",
     ["test_probe_cosine_min", "test_probe_cosine_every_module", "test_no_nan"], "missing key 'gate_inputs.qat'"),
    ("export_mismatch", {"gate_inputs.export.cosine_by_shape.192": 0.98}, "export", ["test_export_cosine[192]"],
     "0.98"),
    ("export_shape_missing", {"gate_inputs.export.cosine_by_shape.256": DELETE}, "export",
     ["test_export_cosine[256]"], "nan"),
    ("export_decode_mismatch", {"gate_inputs.export.decode_cosine": [0.9999, 0.97]}, "export",
     ["test_export_decode_cosine"], "export.decode_cosine_min"),
    ("export_decode_missing", {"gate_inputs.export.decode_cosine": []}, "export", ["test_export_decode_cosine"],
     "nan"),
    ("int64_attention", {"gate_inputs.export.int64_on_attention": ["layers.0.attn.mask"]}, "export",
     ["test_no_int64_on_attention"], "layers.0.attn.mask"),
    ("lint_errors", {"gate_inputs.export.lint_errors": ["shape op"]}, "export", ["test_lint_clean"], "shape op"),
    ("contract_broken", {"gate_inputs.export.contract_ok": False}, "export", ["test_contract"], "contract_ok"),
    ("ane_ineligible_op_on_attention", {"gate_inputs.ane_lint.ineligible_ops": [
        "prefill: cast (layers_0_attn_cast_3): fp32 output (ANE computes fp16)"]}, "export",
     ["test_ane_ops_eligible"], "ane.ineligible_ops[op-eligibility lint (static MIL)] FAILED"),
    ("ane_dimension_over_limit", {"gate_inputs.ane_lint.over_limits": [
        "prefill: linear (lm_head): dimension > 16384 in [1, 256, 32000]"]}, "export",
     ["test_ane_within_limits"], "dimension > 16384 in [1, 256, 32000]"),
    ("ane_low_residency", {"gate_inputs.ane_residency.functions.prefill_192.residency": 0.7}, "ane_residency",
     ["test_ane_residency[prefill_192]", "test_ane_residency_no_drop[prefill_192]"],
     "ane.residency[MLComputePlan].prefill_192 FAILED: measured 0.7 >= "),
    ("ane_residency_drop", {"gate_inputs.ane_residency.functions.prefill_128.residency": 0.83}, "ane_residency",
     ["test_ane_residency_no_drop[prefill_128]"], "change -0.12"),
    ("ane_residency_function_missing", {"gate_inputs.ane_residency.functions.prefill_256": DELETE}, "ane_residency",
     ["test_ane_residency[prefill_256]", "test_ane_residency_no_drop[prefill_256]"],
     "ane.residency[MLComputePlan].prefill_256 FAILED: measured None"),
    ("ane_low_decode_residency", {"gate_inputs.ane_residency.functions.decode.residency": 0.7}, "ane_residency",
     ["test_ane_residency[decode]", "test_ane_residency_no_drop[decode]"],
     "ane.residency[MLComputePlan].decode FAILED: measured 0.7 >= "),
    ("ane_decode_residency_drop", {"gate_inputs.ane_residency.functions.decode.residency": 0.81}, "ane_residency",
     ["test_ane_residency_no_drop[decode]"], "change -0.12"),
    ("coreml_mismatch", {"gate_inputs.coreml_parity.cosine_by_shape.192": 0.99}, "coreml_parity",
     ["test_coreml_parity[192]"], "coreml.cosine[shape=192] FAILED: measured 0.99 >= "),
    ("coreml_shape_missing", {"gate_inputs.coreml_parity.cosine_by_shape.256": DELETE}, "coreml_parity",
     ["test_coreml_parity[256]"], "coreml.cosine[shape=256] FAILED: measured None"),
    ("coreml_decode_mismatch", {"gate_inputs.coreml_parity.decode_cosine": [0.9999, 0.95]}, "coreml_parity",
     ["test_coreml_decode_parity"], "coreml.decode_cosine_min FAILED: measured 0.95"),
    ("coreai_mismatch", {"gate_inputs.coreai_parity.cosine_by_shape.128": 0.99}, "coreai_parity",
     ["test_coreai_parity[128]"], "coreai.cosine[shape=128] FAILED: measured 0.99 >= "),
    ("coreai_shape_missing", {"gate_inputs.coreai_parity.cosine_by_shape.256": DELETE}, "coreai_parity",
     ["test_coreai_parity[256]"], "coreai.cosine[shape=256] FAILED: measured None"),
    ("coreai_decode_mismatch", {"gate_inputs.coreai_parity.decode_cosine": [0.9999, 0.95]}, "coreai_parity",
     ["test_coreai_decode_parity"], "coreai.decode_cosine_min FAILED: measured 0.95"),
    ("coreai_argmax_flips", {"gate_inputs.coreai_parity.top1_gaps": [0.0] * 17 + [0.02, 0.6, 1.2]}, "coreai_parity",
     ["test_coreai_top1_agreement"], "coreai.top1_agreement = 0.9 violates >= 0.95 (n=20)"),
    ("fp16_overflow", {"gate_inputs.fp16_headroom.max_peak": 70000.0,
                       "gate_inputs.fp16_headroom.over": ["layers.0.mlp"]}, "export", ["test_fp16_headroom"],
     "export.fp16_max_activation FAILED: measured 70000 <= threshold 65504"),
    ("coreai_fp16_nan", {"gate_inputs.coreai_parity.non_finite": 3}, "coreai_parity", ["test_coreai_outputs_finite"],
     "coreai.non_finite FAILED"),
    ("coreai_outputs_differ", {"gate_inputs.coreai_eval.identical": 27}, "coreai_parity",
     ["test_coreai_outputs_equal_pytorch"],
     "coreai.outputs_identical = 0.84375 violates >= 0.9 (n=32, 95% CI [0.6825, 0.9314])"),
    # 8 of the 32 items the asset decoded miss their fixture where PyTorch hit: 360 - 8 * 360 / 32 hits of 360
    ("coreai_worse_quality", {"gate_inputs.coreai_eval.item_scores": [
        {**row, "fixture_hits": 0 if i < 8 else 1} for i, row in enumerate(good_item_scores()[:32])]},
     "coreai_parity", ["test_coreai_quality[fixture_hit_rate]"],
     "coreai.fixture_hit_rate = 0.75 violates >= 0.95 (n=360, 95% CI ["),
    # the asset decodes items that are not the eval step's: no figure
    ("coreai_other_items", {"gate_inputs.coreai_eval.item_scores": [
        {**row, "id": f"other-{i}"} for i, row in enumerate(good_item_scores()[:32])]}, "coreai_parity",
     [f"test_coreai_quality[{m}]" for m in ("f1_lax_macro", "tool_selection", "json_validity", "fixture_hit_rate")],
     "coreai.fixture_hit_rate FAILED: measured None"),
    ("prompt_cache_slow", {"gate_inputs.prompt_cache.ttft_hit_ms": [9.0, 9.5, 10.0]}, "prompt_cache",
     ["test_ttft_reduction"], "prompt_cache.ttft_reduction"),
    ("prompt_cache_misses", {"gate_inputs.prompt_cache.hit_rate": 0.5}, "prompt_cache", ["test_hit_rate"], "0.5"),
    ("speculative_differs", {"gate_inputs.speculative.identical": False}, "speculative", ["test_identical_output"],
     "identical"),
    ("speculative_slow", {"gate_inputs.speculative.tps_speculative": tps_per_process(80.0, shift=2),
                          "gate_inputs.speculative.acceptance_rate": 0.1},
     "speculative", ["test_speculative_speedup", "test_speculative_acceptance"], "speedup below the minimum"),
    # the pipeline used to gate one timing pair (1.218 at 135M, re-measured 0.31-0.39): one process cannot decide
    ("speculative_one_process", {"gate_inputs.speculative.tps_plain": tps_per_process(100.0, processes=1),
                                 "gate_inputs.speculative.tps_speculative": tps_per_process(160.0, processes=1)},
     "speculative", ["test_speculative_speedup"], "need samples of at least 2 worker processes"),
    # drafting before the first token: TTFT 25% slower than the worker alone
    ("speculative_ttft_slower", {"gate_inputs.speculative.ttft_speculative": tps_per_process(12.5, shift=2)},
     "speculative", ["test_speculative_ttft"], "speculative.ttft_speedup: speedup below the minimum"),
    # one item in ten rolls back on every verification
    ("speculative_rollbacks", {"gate_inputs.speculative.rollback_rate_per_item": [0.0] * 54 + [1.0] * 6},
     "speculative", ["test_speculative_rollback_p95"], "speculative.rollback_rate_p95 = 1 violates <= 0.1 (n=60"),
]


def failed_tests(result: pytest.RunResult) -> list[str]:
    return sorted(re.findall(r"^FAILED gates/test_\w+\.py::(\S+)", result.stdout.str(), flags=re.MULTILINE))


def test_good_run_passes_every_gate(pytester, gates_project, make_run, own_profile):
    gates_project()
    run = make_run()
    common = [f"--run-dir={run}", f"--hw-profile={own_profile}"]
    pytester.runpytest(*BASELINED, *common, "--bless").assert_outcomes(passed=13)
    result = pytester.runpytest("gates", *common, "-rA")
    # the speed_targets bands skip: the embedded profiles set none (tests/plugin/test_speed_targets.py sets them)
    result.assert_outcomes(passed=80, skipped=12, deselected=4)
    for name in GATE_FILES:
        assert f"PASSED gates/test_{name}.py::" in result.stdout.str(), name


def test_top_up_items_are_not_in_the_quality_figures(pytester, gates_project, make_run, own_profile):
    """The eval top-up (``data.eval_min_per_shape``) serves the drift gates only: the quality figures, their n and
    interval, and the identity check are over the items as drawn, however the top-up scored."""
    gates_project()
    top_up = [{**row, "id": f"top-{i}", "f1_lax": 0.0, "selection_ok": False, "fixture_hits": 0, "top_up": True}
              for i, row in enumerate(good_item_scores()[:100])]
    run = make_run(item_scores=good_item_scores() + top_up)
    result = pytester.runpytest("gates/test_quality.py", "gates/test_identity.py", f"--run-dir={run}",
                                f"--hw-profile={own_profile}", "--gate-report=gates.json")
    result.assert_outcomes(passed=8)
    checks = {g["name"]: g for g in json.loads((pytester.path / "gates.json").read_text())["gates"]}
    assert checks["tool_selection"]["n"] == 360 and checks["fixture_hit_rate"]["n"] == 360
    assert checks["f1_lax_macro"]["n"] == 360 and checks["f1_lax_macro"]["ci"][1] < 1.0


def test_the_coreai_quality_gates_do_not_decide_on_their_sample_alone(pytester, gates_project, make_run, own_profile):
    """CI's build of 2026-12-04: the asset decoded its 32 sampled items exactly as PyTorch, two of them with a fixture
    miss (and one an invalid call) that PyTorch's 360 items hold too: 28 of 30 sampled calls hit (0.933, under 0.95),
    358 of 360 over the eval. The figure of what ships is the eval's: the gate passes with the eval's n and interval;
    the asset losing one more hit than PyTorch on the sample moves it down by 360 / 32 calls."""
    gates_project()
    rows = [{**row, "fixture_hits": 0 if i in (3, 17) else 1, "calls_valid": 0 if i == 5 else 1}
            for i, row in enumerate(good_item_scores())]
    sample = [{**row, "f1_lax": 1.0, "f1_strict": 1.0} for row in rows[:32]]  # the good run's sample F1s
    run = make_run("same", item_scores=rows, **{"gate_inputs.coreai_eval.item_scores": sample})
    common = [f"--hw-profile={own_profile}", "-k", "coreai_quality", "--gate-report=gates.json"]
    pytester.runpytest("gates/test_coreai_parity.py", f"--run-dir={run}", *common).assert_outcomes(passed=4)
    checks = {g["name"]: g for g in json.loads((pytester.path / "gates.json").read_text())["gates"]}
    assert checks["coreai.fixture_hit_rate"]["measured"] == 358 / 360 and checks["coreai.fixture_hit_rate"]["n"] == 360
    assert checks["coreai.json_validity"]["measured"] == 359 / 360
    worse = [{**row, "fixture_hits": 0} if i == 9 else row for i, row in enumerate(sample)]
    run = make_run("worse", item_scores=rows, **{"gate_inputs.coreai_eval.item_scores": worse})
    pytester.runpytest("gates/test_coreai_parity.py", f"--run-dir={run}", *common).assert_outcomes(passed=4)
    checks = {g["name"]: g for g in json.loads((pytester.path / "gates.json").read_text())["gates"]}
    assert checks["coreai.fixture_hit_rate"]["measured"] == pytest.approx((358 - 360 / 32) / 360)


@pytest.mark.parametrize(("changes", "gate_file", "expected", "fragment"), [v[1:] for v in VIOLATIONS],
                         ids=[v[0] for v in VIOLATIONS])
def test_violation_fails_its_gate(pytester, gates_project, make_run, own_profile, changes, gate_file, expected,
                                  fragment):
    gates_project()
    common = [f"--hw-profile={own_profile}", "-rf"]
    path = f"gates/test_{gate_file}.py"
    if path in BASELINED:
        pytester.runpytest(path, f"--run-dir={make_run('good')}", *common, "--bless").assert_outcomes(
            passed={"f1_drift": 2, "shape_drift": 3, "ane_residency": 8}[gate_file])
    result = pytester.runpytest(path, f"--run-dir={make_run('bad', **changes)}", *common)
    assert failed_tests(result) == sorted(expected), result.stdout.str()
    assert fragment in result.stdout.str()
    assert result.ret == pytest.ExitCode.TESTS_FAILED


def test_drift_within_noise_passes(pytester, gates_project, make_run, own_profile):
    """Two items of the 120 in the 256 slice lose their F1 lax (1.0 -> 0): the slice mean drops by 0.0167, beyond
    the 0.01 tolerance, so a raw-mean gate fails; paired, the drop is not significantly beyond the tolerance and the
    gate passes, powered (it would call a drop of 0.0295, under 3x the tolerance). Over all 360 items the same
    change is -0.0056, within tolerance."""
    gates_project()
    common = [f"--hw-profile={own_profile}"]
    files = ["gates/test_f1_drift.py", "gates/test_shape_drift.py"]
    pytester.runpytest(*files, f"--run-dir={make_run('good')}", *common, "--bless").assert_outcomes(passed=5)
    result = pytester.runpytest(*files, f"--run-dir={make_run('two', item_scores=lose_f1('f1_lax', ['256'], 2))}",
                                *common, "--gate-report=gates.json")
    result.assert_outcomes(passed=5)
    checks = {g["name"]: g for g in json.loads((pytester.path / "gates.json").read_text())["gates"]}
    shape = checks["f1_lax_macro[shape=256]"]
    assert shape["measured"] == 116 / 120 and shape["baseline"] == 118 / 120  # raw means: -0.0167 < -0.01
    assert "drop beyond tolerance but within noise (not significant): n=120 items (2 changed), mean change -0.0167" \
        in shape["reason"]
    assert "detectable drop 0.0295 at n=120, spread 0.129" in shape["reason"] and "UNDERPOWERED" not in shape["reason"]
    assert shape["details"]["n"] == 120 and shape["details"]["p_value"] > 0.05 and not shape["details"]["underpowered"]


@pytest.mark.parametrize("per_shape", [4, 1])
def test_a_drift_gate_that_cannot_fail_is_underpowered(pytester, gates_project, make_run, own_profile, monkeypatch,
                                                       per_shape):
    """The toy's 4-item slice passed two of its items dropping to 0 (p = 0.094), a 1-item slice can never fail:
    each is "underpowered" (skipped with the detectable drop locally, a fail under CI unless waived), never a pass."""
    for name in ("CI", "GITHUB_ACTIONS", "GITLAB_CI", "BUILDKITE", "CIRCLECI", "TF_BUILD"):
        monkeypatch.delenv(name, raising=False)
    gates_project()
    rows = [r for r in good_item_scores() if r["shape"] != "128" or int(r["id"].split("-")[1]) < per_shape]
    for row in rows:
        if row["shape"] == "128":
            row["f1_lax"] = 1.0
    dropped = [dict(r, f1_lax=0.0) if r["id"] in ("128-0", "128-1") else r for r in rows]
    common = ["gates/test_shape_drift.py", f"--hw-profile={own_profile}", "-k", "128"]
    pytester.runpytest(*common, f"--run-dir={make_run('good', item_scores=rows)}", "--bless").assert_outcomes(
        passed=1, deselected=2)
    run = make_run("dropped", item_scores=dropped)
    result = pytester.runpytest(*common, f"--run-dir={run}", "--gate-report=gates.json", "-rs")
    result.assert_outcomes(skipped=1, deselected=2)
    result.stdout.fnmatch_lines([f"*f1_lax_macro?shape=128?: underpowered: *detectable drop * at n={per_shape}*"])
    report = json.loads((pytester.path / "gates.json").read_text())
    assert report["summary"] == {"underpowered": 1, "deselected": 2}
    assert report["gates"][0]["verdict"] == "underpowered" and report["gates"][0]["details"]["underpowered"]
    monkeypatch.setenv("CI", "true")
    result = pytester.runpytest(*common, f"--run-dir={run}")
    result.assert_outcomes(failed=1, deselected=2)
    result.stdout.fnmatch_lines(["*fails under CI (CI=true) unless gates.waive names 'f1_lax_macro?shape=128?'*"])
    project_file(pytester.path, "thresholds", "configs/gates.yaml", "gates:\n  waive: ['f1_lax_macro[shape=128]']\n")
    pytester.runpytest(*common, f"--run-dir={run}").assert_outcomes(skipped=1, deselected=2)


def test_shapes_come_from_the_run_config(pytester, gates_project, make_run, own_profile):
    """A shape the run enumerates but no eval item has is gated (and fails), never silently skipped."""
    gates_project()
    run = make_run(**{"header.config.shapes.lengths": [128, 192, 256, 320]})
    result = pytester.runpytest("gates/test_shape_drift.py", f"--run-dir={run}", f"--hw-profile={own_profile}",
                                "--bless", "-rf")
    assert failed_tests(result) == ["test_shape_drift[320]"], result.stdout.str()
    result.stdout.fnmatch_lines(["*refusing to bless: shape_drift/f1_lax_macro.shape.320: "
                                 "f1_lax_macro[[]shape=320[]] = None is not a finite number*"])


@pytest.mark.parametrize(("swap", "expected"), [
    ("checkpoint", ["test_export_describes_the_checkpoint", "test_report_describes_the_checkpoint"]),
    ("export", ["test_export_describes_the_checkpoint"]),
])
def test_another_model_fails_the_identity_gates(pytester, gates_project, make_run, own_profile, swap, expected):
    """A retrained student.pt that the report and export do not describe, or a stale export contract."""
    gates_project()
    run = RunDir(make_run())
    other = copy.deepcopy(tiny_student())
    other.embed.weight.data.mul_(1.01)  # same config, other weights
    if swap == "checkpoint":
        save_model(run.model_path(), other)
    else:
        contract = run.read_json(run.contract)
        run.contract.write_text(json.dumps({**contract, "model_fingerprint": model_fingerprint(other)}))
    result = pytester.runpytest("gates/test_identity.py", f"--run-dir={run.root}", f"--hw-profile={own_profile}")
    assert failed_tests(result) == expected, result.stdout.str()
    out = result.stdout.str()
    shipped, described = ((model_fingerprint(other), model_fingerprint(tiny_student())) if swap == "checkpoint"
                          else (model_fingerprint(tiny_student()), model_fingerprint(other)))
    for fragment in (shipped, described, str(run.model_path()), str(run.contract if swap == "export" else run.report)):
        assert fragment in out, fragment


@pytest.mark.parametrize("select", [["-m", "quality"], ["gates/test_privacy.py"]])
def test_a_report_of_another_model_is_refused_in_every_session(pytester, gates_project, make_run, own_profile,
                                                               select):
    """-m quality alone (no identity gate selected) still checks that the report describes student/model.pt."""
    gates_project()
    run = RunDir(make_run())
    other = copy.deepcopy(tiny_student())
    other.embed.weight.data.mul_(1.01)
    save_model(run.model_path(), other)
    args = select if select[0] == "-m" else [*select]
    result = pytester.runpytest(*(["gates"] if select[0] == "-m" else []), *args, f"--run-dir={run.root}",
                                f"--hw-profile={own_profile}")
    outcomes = result.parseoutcomes()
    assert outcomes.get("errors") == (4 if select[0] == "-m" else 2) and "passed" not in outcomes, outcomes
    result.stdout.fnmatch_lines([f"*model_fingerprint '{model_fingerprint(tiny_student())}' is not the "
                                 f"model_fingerprint '{model_fingerprint(other)}'*the report describes another model*"])


def test_qat_gates_skip_a_run_trained_without_qat(pytester, gates_project, make_run, own_profile):
    """No probe because ``train.qat.enabled`` is off: the QAT gates do not apply, and say why."""
    gates_project()
    run = make_run("no_qat", **{"gate_inputs.qat": DELETE, "header.config.train.qat.enabled": False})
    result = pytester.runpytest("gates/test_qat_cosine.py", f"--run-dir={run}", f"--hw-profile={own_profile}", "-rs")
    result.assert_outcomes(skipped=3)
    assert "QAT is off in this run" in result.stdout.str()


def test_residency_gates_need_mlcomputeplan(pytester, gates_project, make_run, own_profile):
    """A run exported off macOS has no residency figure: the gates skip naming MLComputePlan (on a Mac they
    fail, since there the export step always records it); the static lint never stands in for it."""
    gates_project()
    run = make_run("linux_export", **{"gate_inputs.ane_residency": DELETE})
    result = pytester.runpytest("gates/test_ane_residency.py", f"--run-dir={run}", f"--hw-profile={own_profile}",
                                "-rs")
    if sys.platform == "darwin":
        functions = ["decode", *(f"prefill_{s}" for s in SHAPES)]
        failed = sorted(f"test_ane_residency{name}[{f}]" for name in ("", "_no_drop") for f in functions)
        assert failed_tests(result) == failed, result.stdout.str()
        assert "exported off macOS" in result.stdout.str()
    else:
        result.assert_outcomes(skipped=8)
        assert "ANE residency is measured only by MLComputePlan (macOS 14.4+)" in result.stdout.str()


def test_coreml_parity_gates_need_a_mac_export(pytester, gates_project, make_run, own_profile):
    """A run exported off macOS has no Core ML figure: the gates skip naming MLModel.predict (on a Mac they fail,
    since there the export step always records it); the shipped-weights parity of the export gates is not it."""
    gates_project()
    run = make_run("linux_export", **{"gate_inputs.coreml_parity": DELETE})
    result = pytester.runpytest("gates/test_coreml_parity.py", f"--run-dir={run}", f"--hw-profile={own_profile}",
                                "-rs")
    if sys.platform == "darwin":
        assert failed_tests(result) == ["test_coreml_decode_parity", *(f"test_coreml_parity[{s}]" for s in SHAPES)]
    else:
        result.assert_outcomes(skipped=1 + len(SHAPES))
        assert "Core ML parity is measured only by MLModel.predict (macOS)" in result.stdout.str()


@pytest.mark.parametrize(("recorded", "reason"), [
    ({"coreai_parity": DELETE, "coreai_eval": {"skipped": "export.target coreml: no Core AI asset"}},
     "export.target coreml"),
    ({"coreai_parity": {"skipped": EXTRA}, "coreai_eval": {"skipped": EXTRA}},
     "the export skipped Core AI: Core AI needs the coreai extra"),
], ids=["target_coreml", "extra_missing"])
def test_coreai_parity_gates_skip_naming_why_no_asset_was_exported(pytester, gates_project, make_run, own_profile,
                                                                   recorded, reason):
    """No Core AI figure: a run exported with target coreml, or without the coreai extra (the export recorded why).
    The gates skip, saying which; they never pass without a measurement."""
    gates_project()
    run = make_run("no_coreai", **{f"gate_inputs.{key}": value for key, value in recorded.items()})
    result = pytester.runpytest("gates/test_coreai_parity.py", f"--run-dir={run}", f"--hw-profile={own_profile}",
                                "-rs")
    result.assert_outcomes(skipped=3 + len(SHAPES) + 5)
    assert reason in result.stdout.str()


COREAI_ALONE = {"gate_inputs.export.source": COREAI_SOURCE, "gate_inputs.export.int64_on_attention": DELETE,
                "gate_inputs.export.lint_errors": DELETE, "gate_inputs.export.lints_skipped": LINTS_SKIPPED,
                "gate_inputs.ane_lint": {"skipped": ANE_LINT_SKIPPED}}


@pytest.mark.parametrize(("cosine", "expected"), [(0.9999, {"passed": len(SHAPES) + 3, "skipped": 4}),
                                                  (0.99, {"failed": len(SHAPES), "passed": 3, "skipped": 4})])
def test_a_coreai_only_export_is_gated_on_the_asset(pytester, gates_project, make_run, own_profile, cosine, expected):
    """``export.target: coreai``: the export gates' cosines are the asset's own, run by Core AI's runtime (a low one
    fails naming it); the lints of the Core ML conversion and the ANE op lint skip, saying why; none passes empty."""
    gates_project()
    cosines = {f"gate_inputs.export.cosine_by_shape.{s}": cosine for s in SHAPES}
    run = make_run("coreai_alone", **COREAI_ALONE, **cosines)
    result = pytester.runpytest("gates/test_export.py", f"--run-dir={run}", f"--hw-profile={own_profile}", "-rs")
    result.assert_outcomes(**expected)
    out = result.stdout.str()
    assert "export.target coreai: the export lints" in out and "export.target coreai: the ANE op-eligibility" in out
    if cosine < 0.999:
        assert "cosine(model.aimodel run by Core AI's runtime" in out


def test_an_aimodel_changed_since_the_export_fails_its_parity_gates(pytester, gates_project, make_run, own_profile):
    """The parity figures describe the asset the export measured: a swapped or corrupted ``model.aimodel`` is an
    error naming it, not a pass on the old figures."""
    gates_project()
    run = make_run("swapped_aimodel")
    (RunDir(run).export_dir / "model.aimodel" / "Data" / "weight.bin").write_bytes(b"another model")
    result = pytester.runpytest("gates/test_coreai_parity.py", f"--run-dir={run}", f"--hw-profile={own_profile}")
    result.assert_outcomes(errors=3 + len(SHAPES) + 5)
    assert "model.aimodel: sha256" in result.stdout.str()


def test_malformed_item_scores_fail_the_drift_gates_naming_file_and_row(pytester, gates_project, make_run, own_profile):
    gates_project()
    rows = good_item_scores()
    rows[3]["f1_lax"] = "0.9"  # a string, not a number
    run = make_run(item_scores=rows)
    result = pytester.runpytest("gates/test_f1_drift.py", f"--run-dir={run}", f"--hw-profile={own_profile}", "--bless")
    result.assert_outcomes(errors=2)
    result.stdout.fnmatch_lines([f"*{RunDir(run).item_scores}: items[[]3[]]: fields [[]'f1_lax'[]] missing or of the "
                                 "wrong type*"])


def test_a_speedup_the_samples_cannot_tell_is_inconclusive(pytester, gates_project, make_run, own_profile):
    """Speculative decoding 2% faster in some processes and 2% slower in others: the interval holds the minimum
    1.0, so the gate neither passes nor fails: it skips locally and fails under CI, with the numbers."""
    gates_project()
    plain = tps_per_process(100.0)
    mixed = [[s * (1.02 if k % 2 else 0.98) for s in samples] for k, samples in enumerate(plain)]
    run = make_run("mixed", **{"gate_inputs.speculative.tps_speculative": mixed})
    args = ["gates/test_speculative.py::test_speculative_speedup", f"--run-dir={run}", f"--hw-profile={own_profile}",
            "-rs"]
    local = pytester.runpytest(*args, "--speed-inconclusive=skip")
    local.assert_outcomes(skipped=1)
    assert "INCONCLUSIVE" in local.stdout.str() and "the samples cannot tell" in local.stdout.str()
    pytester.runpytest(*args, "--speed-inconclusive=fail").assert_outcomes(failed=1)
