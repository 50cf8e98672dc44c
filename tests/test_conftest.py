"""The suite's own autouse fixtures (tests/conftest.py), run on two small test files through pytester."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

CONFTEST = Path(__file__).with_name("conftest.py")


def test_a_thread_count_set_by_a_test_or_a_module_fixture_does_not_reach_what_follows(
    pytester: pytest.Pytester,
) -> None:
    pytester.makeconftest(CONFTEST.read_text())
    before = torch.get_num_threads()  # in-process run: the inner session starts with this count
    pytester.makepyfile(
        test_a=f"""
        import pytest
        import torch

        @pytest.fixture(scope="module")
        def module_setting():
            torch.set_num_threads({before + 2})

        def test_sets_another_count():
            torch.set_num_threads({before + 1})

        def test_sees_the_count_it_would_have_alone():
            assert torch.get_num_threads() == {before}

        def test_module_fixture_sets_a_count(module_setting):
            assert torch.get_num_threads() == {before + 2}
        """,
        test_b=f"""
        import torch

        def test_the_next_module_sees_the_count_it_would_have_alone():
            assert torch.get_num_threads() == {before}
        """,
    )
    result = pytester.runpytest("-p", "no:cacheprovider", "-p", "no:hypothesispytest", "-p", "no:benchmark")
    result.assert_outcomes(passed=4)


def test_the_slowest_files_the_schedule_starts_with_exist() -> None:
    """A renamed or removed file would silently drop out of the longest-first order."""
    from .conftest import SLOWEST_FILES

    assert [name for name in SLOWEST_FILES if not (CONFTEST.parent / name).is_file()] == []
