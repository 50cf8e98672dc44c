"""--gate-summary: a Markdown table for a CI job summary; the rich terminal table."""

from __future__ import annotations

import json

from distillgates.project import EMBEDDED_THRESHOLDS


def test_markdown_summary(pytester, gates_project, make_run, own_profile):
    gates_project()
    run = make_run(**{"gate_inputs.export.cosine_by_shape.192": 0.98})
    result = pytester.runpytest("gates/test_export.py", f"--run-dir={run}", f"--hw-profile={own_profile}",
                                "--gate-summary=summary.md")
    result.assert_outcomes(passed=9, failed=1)
    text = (pytester.path / "summary.md").read_text()
    assert text.startswith("## distillgates gates")
    assert "**FAIL: 9 pass, 1 fail (1 gate test(s) failed or errored)**" in text
    assert f"Hardware profile `{own_profile}`, bless=False; checks: 1 fail, 9 pass." in text
    assert f"Thresholds: `{EMBEDDED_THRESHOLDS}`." in text
    # no n and CI: the export cosine is not an estimate
    assert "| fail | export | `export.cosine[shape=192]` | 0.98 | — | — | 0.999 | — |" in text
    # the ANE lint's checks name their source: a static lint, not a residency measurement
    assert "| pass | export | `ane.ineligible_ops[op-eligibility lint (static MIL)]` | [] | — | — | [] | — |" in text


def test_terminal_table(pytester, gates_project, make_run, own_profile):
    gates_project()
    run = make_run()
    result = pytester.runpytest("gates/test_speculative.py", "gates/test_determinism.py", f"--run-dir={run}",
                                f"--hw-profile={own_profile}")
    result.assert_outcomes(passed=23)
    # one line per check, even in an 80-column log: names whole, sha256 digests as a 12-character prefix
    result.stdout.fnmatch_lines(["*distillgates gates*", "*verdict*gate*check*measured*threshold*baseline*",
                                 "*pass*speculative*speculative.identical *",
                                 "*pass*determinism*fingerprint.tool_registry_sha256.eval_set *",
                                 f"*thresholds: {EMBEDDED_THRESHOLDS}*"])
    registry = json.loads((run / "data" / "eval.jsonl").read_text().splitlines()[0])["tool_registry_sha256"]
    assert f"{registry[:12]}…" in result.stdout.str() and registry not in result.stdout.str()
