"""Markers: registered, requires_macos skips with a reason, speed gates only with -m speed."""

from __future__ import annotations

import sys

import pytest

from pytest_distillgates.plugin import GATE_MARKERS

SPEED_AND_MAC = """
import pytest

@pytest.mark.speed
def test_speed():
    pass

@pytest.mark.requires_macos
def test_mac():
    pass

def test_plain():
    pass
"""


def test_markers_registered(pytester):
    result = pytester.runpytest("--markers", "--strict-markers")
    for name in [*GATE_MARKERS, "requires_macos"]:
        result.stdout.fnmatch_lines([f"@pytest.mark.{name}:*"])


@pytest.mark.skipif(sys.platform == "darwin", reason="checks the skip off macOS")
def test_requires_macos_skips_with_reason_and_speed_is_opt_in(pytester):
    pytester.makepyfile(test_m=SPEED_AND_MAC)
    result = pytester.runpytest("-rs", "--strict-markers")
    result.assert_outcomes(passed=1, skipped=1, deselected=1)
    result.stdout.fnmatch_lines(["*1 speed gate(s) deselected*-m speed*", "*requires macOS (running on linux)*"])
    selected = pytester.runpytest("-m", "speed")
    selected.assert_outcomes(passed=1, deselected=2)
