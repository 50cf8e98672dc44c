"""Core AI parity gates: what ships, run. ``export/model.aimodel`` (``export.target: both``) is executed by Core
AI's runtime, on Linux too, and its logits are compared with eager PyTorch: every ``prefill_<L>`` with and
without padding, then stateful decode steps continuing a prefill in the shared state.

The export step measures it (``gate_inputs.coreai_parity``, by :func:`distillgates.export.coreai.coreai_parity`, in a
worker process: a runtime fatal error is an error naming the function, not a dead session). A run exported with
``target: coreml`` has no Core AI figure, and one exported without the coreai extra recorded why: both skip, saying
so.
"""

from __future__ import annotations

from typing import Any

import pytest

from distillgates.export.functions import COREAI_SOURCE
from distillgates.gates.stats import wilson_interval
from pytest_distillgates.fixtures import corrected_figure

# the quality gates' metrics and thresholds (test_quality.py), here on the asset's outputs
QUALITY = {"f1_lax_macro": "f1_lax_min", "tool_selection": "tool_selection_min", "json_validity": "json_validity_min",
           "fixture_hit_rate": "fixture_hit_rate_min"}
# a flipped argmax whose eager log-probabilities differ by at most this is a near-tie, not a loss: measured,
# SmolLM2-135M int8's flips are 0.018-0.022 nats, int4 post-training's real flips 0.6-1.2 (benchmarks.md section 12)
TOP1_TIE_NATS = 0.1
DEFINITION = (f"cosine(logits of {COREAI_SOURCE.split(' vs ')[0]}, eager PyTorch logits) of the last real token, worst "
              "case of the length's padded and unpadded prompt")  # fmt: skip


def measured(report, key: str, missing: str, skipped: str) -> dict[str, Any]:
    """``gate_inputs.<key>`` of the asset in export/ (else an error naming each changed asset); skips, saying why,
    where the run has none (``missing``) or recorded why not (``skipped``: the reason follows)."""
    figures = report.get("gate_inputs").get(key)
    if figures is None:
        pytest.skip(missing)
    if "skipped" in figures:
        pytest.skip(f"{skipped}: {figures['skipped']}")
    report.run.verify_packages()  # figures of the assets in export/ only: else an error naming each one
    return figures  # type: ignore[no-any-return]


@pytest.fixture
def parity(report) -> dict[str, Any]:
    return measured(report, "coreai_parity", "no Core AI asset: the run was exported with export.target coreml (set it "
                    "to both)", "the export skipped Core AI")


@pytest.mark.coreai_parity
def test_coreai_parity(gate, parity, thresholds, shape):
    gate.at_least(f"coreai.cosine[shape={shape}]", parity.get("cosine_by_shape", {}).get(shape),
                  thresholds.coreai_cosine_min, DEFINITION)


@pytest.mark.coreai_parity
def test_coreai_decode_parity(gate, parity, thresholds):
    decode = parity.get("decode_cosine") or [None]
    gate.at_least("coreai.decode_cosine_min", None if None in decode else min(decode), thresholds.coreai_cosine_min,
                  "worst cosine(Core AI decode logits, eager PyTorch logits) over the decode steps after a prefill, in "
                  "the state every function shares")


@pytest.mark.coreai_parity
def test_coreai_top1_agreement(gate, parity, thresholds):
    """A flipped argmax counts only where eager PyTorch itself preferred its own by more than ``TOP1_TIE_NATS``: a flip
    between two near-equal logits is rounding, not a loss (SmolLM2-135M int8 flips 2 of 18 at 0.018 and 0.022 nats;
    int4 post-training flips 4 at 0.6-1.2 nats, and fails)."""
    gaps = parity.get("top1_gaps")
    share = sum(gap <= TOP1_TIE_NATS for gap in gaps) / len(gaps) if gaps else None
    gate.at_least("coreai.top1_agreement", share, thresholds.coreai_top1_min,
                  "share of the parity cases (every length padded and unpadded, every decode step) whose argmax of the "
                  f"Core AI logits is eager PyTorch's, or a token eager scores within {TOP1_TIE_NATS} nats of its own "
                  f"(a near-tie); exact agreement {parity.get('top1_agreement')}, flips' gaps "
                  f"{sorted(round(g, 3) for g in gaps if g > 0) if gaps else None} nats",
                  n=len(gaps) if gaps else None)


@pytest.mark.coreai_parity
def test_coreai_outputs_finite(gate, parity):
    gate.equals("coreai.non_finite", parity.get("non_finite"), 0,
                "parity cases whose logits from model.aimodel hold a NaN or an inf (at fp16 compute: an overflow)")


@pytest.fixture
def artifact_eval(report) -> dict[str, Any]:
    return measured(report, "coreai_eval", "no coreai_eval figures: the run was built before that step (run "
                    "`distillgates run` again)", "the coreai_eval step did not run")


@pytest.mark.coreai_parity
def test_coreai_outputs_equal_pytorch(gate, artifact_eval, thresholds):
    """Quality on what ships: the eval items decoded greedily through the asset (prompt, tool calls, tool results,
    answer: every turn) give the PyTorch engine's outputs."""
    items, identical = artifact_eval.get("items"), artifact_eval.get("identical")
    share = identical / items if items else None
    differing = artifact_eval.get("differing_ids", [])
    gate.at_least("coreai.outputs_identical", share, thresholds.coreai_outputs_identical_min,
                  f"share of the {items} sampled drawn eval items whose outputs through model.aimodel (Core AI's "
                  f"runtime, greedy, every turn) equal the eval step's PyTorch outputs; differing: "
                  f"{differing[:10] or 'none'}", wilson_interval(identical, items) if items else None)


@pytest.mark.coreai_parity
@pytest.mark.parametrize("metric", list(QUALITY))
def test_coreai_quality(gate, artifact_eval, drawn_student_items, thresholds, metric):
    """The quality thresholds, on what ships: the figure over every drawn eval item (the eval step's, decoded by
    PyTorch), corrected by how the asset's scores differ from PyTorch's on the sample it decoded (the difference
    estimator, :func:`~pytest_distillgates.fixtures.corrected_figure`; the eval's own figure and interval where
    they agree). A threshold on the sample's own figure would decide on its ~30 items: one stray miss in 29
    calls failed a student whose 200 items cleared every gate (CI, 2026-12-04)."""
    rows = artifact_eval.get("item_scores") or []
    measured, interval = corrected_figure(drawn_student_items, rows, metric)
    sample = artifact_eval.get("student", {}).get(metric)
    gate.at_least(f"coreai.{metric}", measured, getattr(thresholds, QUALITY[metric]),
                  f"{metric} of the drawn eval items as model.aimodel decodes them (Core AI's runtime, greedy): the "
                  f"eval step's PyTorch figure corrected by the asset-minus-PyTorch scores of the {len(rows)} items "
                  f"it decoded (their own figure through the asset: {sample}; the figure is None when they are not "
                  "the eval step's items)", interval)
