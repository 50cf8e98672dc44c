"""Core ML parity gates (macOS): Core ML's own logits vs eager PyTorch, per enumerated shape and over
stateful decode steps.

Core ML predicts only on macOS: the export step measures it there (``gate_inputs.coreml_parity``, by
:func:`distillgates.export.parity.coreml_parity`: every shape with and without padding, a split LM
head's outputs joined, then decode steps continuing from the prefill's state). Off macOS a run has no
such figure and the gates skip, saying so; the ``export`` gates measure the shipped weights there.
"""

from __future__ import annotations

import sys
from typing import Any

import pytest

from distillgates.export.compute_plan import COREML_SOURCE

DEFINITION = ("cosine(Core ML logits, PyTorch logits) of the last real token, worst case of the shape's padded and "
              f"unpadded prompt, measured by {COREML_SOURCE} when the run was exported (None: exported off macOS; "
              "re-run `distillgates step export` on this Mac)")


@pytest.fixture
def parity(report) -> dict[str, Any]:
    measured = report.get("gate_inputs").get("coreml_parity")
    if measured is None and sys.platform != "darwin":
        pytest.skip(f"Core ML parity is measured only by {COREML_SOURCE} (macOS); this run was exported on "
                    f"{report.header.get('hardware', {}).get('os')} and has no Core ML figure")
    report.run.verify_packages()  # figures of the packages in export/ only: else an error naming each package
    return measured or {}


def measured_here(gate, report, parity) -> None:
    gate.measured_on("coreml.hardware_profile_key", report.measured_on(parity), "Core ML parity")


@pytest.mark.coreml_parity
def test_coreml_parity(gate, report, parity, thresholds, shape):
    measured_here(gate, report, parity)
    gate.at_least(f"coreml.cosine[shape={shape}]", parity.get("cosine_by_shape", {}).get(shape),
                  thresholds.coreml_cosine_min, DEFINITION)


@pytest.mark.coreml_parity
def test_coreml_decode_parity(gate, report, parity, thresholds):
    measured_here(gate, report, parity)
    decode = parity.get("decode_cosine") or [None]
    gate.at_least("coreml.decode_cosine_min", None if None in decode else min(decode), thresholds.coreml_cosine_min,
                  "worst cosine(Core ML decode logits, PyTorch logits) over the stateful decode steps after a prefill")
