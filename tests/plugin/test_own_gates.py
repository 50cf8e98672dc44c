"""A project's own gates with the plugin's fixtures: the example of docs/project.md, run as written."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest

from distillgates.config import load_config
from distillgates.model import Transformer, model_fingerprint, save_model
from distillgates.project import EMBEDDED_CONFIG
from distillgates.rundir import RunDir

from ..conftest import tiny_model_config

DOC = Path(__file__).resolve().parents[2] / "docs" / "project.md"


def example() -> str:
    match = re.search(r"<!-- example: test_my_gates.py -->\n```python\n(.*?)```", DOC.read_text(), re.DOTALL)
    assert match, f"{DOC}: the example block (<!-- example: test_my_gates.py -->) is gone"
    return match.group(1)


@pytest.fixture
def own_gates(pytester: pytest.Pytester) -> pytest.Pytester:
    pytester.makeini("[pytest]\naddopts = -p no:cacheprovider -p no:hypothesispytest -p no:benchmark -p no:xdist "
                     "--import-mode=importlib\n")
    pytester.makepyfile(test_my_gates=example())
    return pytester


def test_the_documented_quality_gate_passes_and_fails(own_gates, make_run, own_profile):
    args = ["test_my_gates.py", f"--hw-profile={own_profile}", "--gate-report=gates.json"]
    own_gates.runpytest(*args, f"--run-dir={make_run()}").assert_outcomes(passed=1, deselected=1)
    record = json.loads((own_gates.path / "gates.json").read_text())["gates"][0]
    assert record["group"] == "quality" and record["name"] == "tool_selection[kind=single]"
    assert (record["measured"], record["threshold"]) == (0.97, 0.9)  # the run's slice, the embedded threshold

    run = make_run("weak", **{"quality.student.slices.kind.single.tool_selection": 0.5})
    result = own_gates.runpytest(*args, f"--run-dir={run}")
    result.assert_outcomes(failed=1, deselected=1)
    result.stdout.fnmatch_lines(["*gate quality/tool_selection[[]kind=single[]] FAILED: measured 0.5 >= threshold 0.9*"
                                 ])


@pytest.mark.integration  # live samples of a tiny student (~5 s)
def test_the_documented_speed_gate_measures_live(own_gates, make_run, own_profile, toy_data):
    cfg = load_config(EMBEDDED_CONFIG)
    student = Transformer(tiny_model_config(vocab_size=cfg.tokenizer.vocab_size, max_seq_len=512))
    run = make_run("live", **{"header.fingerprints.model_fingerprint": model_fingerprint(student)})  # its report
    shutil.copytree(toy_data, run / "data", dirs_exist_ok=True)  # the speed sampler's prompts
    save_model(run / "student" / "model.pt", student)
    RunDir(run).contract.unlink()  # not exported: the PyTorch engine on every platform
    result = own_gates.runpytest("test_my_gates.py", "-m", "speed", f"--run-dir={run}", f"--hw-profile={own_profile}",
                                 "--gate-report=gates.json")
    outcomes = result.parseoutcomes()
    assert outcomes.get("passed", 0) + outcomes.get("failed", 0) == 1 and outcomes["deselected"] == 1
    record = json.loads((own_gates.path / "gates.json").read_text())["gates"][0]
    assert record["group"] == "speed" and record["name"] == f"ttft_ms.p50[{own_profile}]"
    assert record["measured"] > 0 and record["threshold"] == 50.0
    assert record["verdict"] == ("pass" if record["measured"] <= 50.0 else "fail")  # the gate, not the clock, decides
