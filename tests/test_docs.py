"""The docs stay true to the code: the generated config reference is current, every command-line
option the docs and the CI workflow mention exists, and the workflow is valid YAML that publishes
the reports."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "docs" / name for name in ("user-guide.md", "metrics.md", "configuration.md", "macos.md", "project.md")]
WORKFLOW = ROOT / ".github" / "workflows" / "macos-speed-gates.yml"
OPTION = re.compile(r"(?<![\w-])--[a-z][a-z0-9_-]*")
EXTERNAL_OPTIONS = {"--nproc_per_node"}  # torchrun


def _generator():
    spec = importlib.util.spec_from_file_location("gen_config_reference", ROOT / "docs" / "gen_config_reference.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_configuration_reference_is_current():
    gen = _generator()
    current = (ROOT / "docs" / "configuration.md").read_text(encoding="utf-8")
    assert gen.splice(current, gen.render()) == current, (
        "docs/configuration.md is stale: run `.venv/bin/python docs/gen_config_reference.py`"
    )


def test_generator_lists_every_config_field():
    from dataclasses import fields

    from distillgates.config import APIConfig, Config, KDConfig, TeacherConfig, ToyTeacherTrainConfig

    block = _generator().render()
    for cls in (Config, TeacherConfig, ToyTeacherTrainConfig, APIConfig, KDConfig):
        for f in fields(cls):
            assert f"| `{f.name}` |" in block, f"{cls.__name__}.{f.name} missing from the reference"


def _cli_help(add_parser) -> str:
    """Help text of one subcommand parser (``add_parser(subparsers)``), every option included."""
    import argparse

    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers()
    return add_parser(sub).format_help()


def _known_options(pytestconfig: pytest.Config) -> set[str]:
    from distillgates.cli import build_parser
    from distillgates.train import recipe

    parser = build_parser()
    texts = [parser.format_help(), _cli_help(recipe.add_parser)]
    for action in parser._subparsers._group_actions:  # the distillgates subcommands
        texts += [sub.format_help() for sub in action.choices.values()]
    # every option string pytest (and its plugins) registered, aliases such as --junitxml included
    texts.append(" ".join(pytestconfig._parser._opt2dest))
    return {opt for text in texts for opt in OPTION.findall(text)} | EXTERNAL_OPTIONS


def test_documented_options_exist(pytestconfig):
    known = _known_options(pytestconfig)
    unknown = {
        f"{path.relative_to(ROOT)}: {opt}"
        for path in [*DOCS, WORKFLOW]
        for opt in OPTION.findall(path.read_text(encoding="utf-8"))
        if opt not in known
    }
    assert not unknown, f"options in the docs that no command accepts: {sorted(unknown)}"


def test_workflow_runs_speed_gates_and_publishes_reports():
    workflow = yaml.safe_load(WORKFLOW.read_text(encoding="utf-8"))
    steps = workflow["jobs"]["speed-gates"]["steps"]
    scripts = "\n".join(step.get("run", "") for step in steps)
    assert "make setup" in scripts
    assert re.search(r"pytest pytest_distillgates/checklist -m speed .*--run-dir", scripts)
    # residency is measured only on the Mac (MLComputePlan), so its gates run there, with Core ML parity
    assert re.search(r'pytest pytest_distillgates/checklist -m "ane_residency or coreml_parity" .*--run-dir', scripts)
    for option in ("--junitxml=", "--gate-report=", "--gate-summary=", "--hw-profile="):
        assert option in scripts, option
    assert "GITHUB_STEP_SUMMARY" in scripts
    uses = [step.get("uses", "") for step in steps]
    assert any(u.startswith("actions/setup-python") for u in uses)
    assert any(u.startswith("actions/upload-artifact") for u in uses)
    python = next(s for s in steps if s.get("uses", "").startswith("actions/setup-python"))
    assert python["with"]["python-version"] == "3.11"


def _anchors(path: Path) -> set[str]:
    """GitHub-style heading anchors of a Markdown file."""
    headings = re.findall(r"^#+ (.+)$", path.read_text(encoding="utf-8"), flags=re.MULTILINE)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in headings}


def test_links_between_docs_resolve():
    broken = []
    for path in DOCS:
        for target, anchor in re.findall(r"\]\(([^)#\s]*)(?:#([^)\s]+))?\)", path.read_text(encoding="utf-8")):
            if target.startswith(("http://", "https://")):
                continue
            linked = path if not target else (path.parent / target)
            if not linked.exists():
                broken.append(f"{path.name}: {target}")
            elif anchor and linked.suffix == ".md" and anchor not in _anchors(linked):
                broken.append(f"{path.name}: {target}#{anchor}")
    assert not broken, f"broken links: {broken}"
