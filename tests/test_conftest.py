"""The suite's own autouse fixtures (tests/conftest.py), run on a two-test file through pytester."""

from __future__ import annotations

from pathlib import Path

import pytest

CONFTEST = Path(__file__).with_name("conftest.py")


def test_a_thread_count_set_by_one_test_does_not_reach_the_next(pytester: pytest.Pytester) -> None:
    pytester.makeconftest(CONFTEST.read_text())
    pytester.makepyfile(
        test_threads="""
        import torch

        BEFORE = torch.get_num_threads()

        def test_sets_another_count():
            torch.set_num_threads(BEFORE + 1)

        def test_sees_the_count_it_would_have_alone():
            assert torch.get_num_threads() == BEFORE
        """
    )
    result = pytester.runpytest("-p", "no:cacheprovider", "-p", "no:hypothesispytest", "-p", "no:benchmark")
    result.assert_outcomes(passed=2)
