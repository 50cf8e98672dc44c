"""pytest --help lists every distillgates option in its own group."""

from __future__ import annotations


def test_help_lists_options(pytester):
    result = pytester.runpytest("--help")
    result.stdout.fnmatch_lines([
        "distillgates gates (quality and speed gates with blessed baselines):",
        "*--hw-profile=KEY*hardware profile*",
        "*--bless*measure and write baselines*",
        "*--allow-cross-hw*",
        "*--allow-other-eval-set*",
        "*accept baselines blessed on another eval set*",
        "*--baselines-dir=DIR*",
        "*--run-dir=DIR*",
        "*--gate-report=PATH*JSON*",
        "*--gate-summary=PATH*Markdown*",
        "*--reference-store=PATH|URL*",
        "*speed references' artifacts live: a folder or*",
        "*--speed-mode={ab,stored}*",
        "*--speed-samples=N*",
        "*--speed-max-rounds=N*",
        "*--speed-inconclusive*",
    ])


def test_bad_values_are_usage_errors(pytester):
    for option in ("--speed-samples=2", "--speed-max-rounds=-1", "--run-dir=/no/such/dir"):
        result = pytester.runpytest(option)
        assert result.ret == 4, option
