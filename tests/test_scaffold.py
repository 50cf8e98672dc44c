"""`distillgates init` scaffolds a project that works with the installed package; it never overwrites."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from distillgates import __version__
from distillgates.cli import _project_defaults, build_parser, main
from distillgates.config import load_config
from distillgates.hardware import load_profiles
from distillgates.pipeline import default_run_dir
from distillgates.project import EMBEDDED_CONFIG, Project
from distillgates.scaffold import project_files, scaffold


def test_init_writes_a_project_the_settings_describe(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["init", str(tmp_path)]) == 0
    written = sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*") if p.is_file())
    assert written == sorted(project_files())
    assert "wrote" in capsys.readouterr().out
    project = Project.load(tmp_path)
    assert project.config_path == tmp_path.resolve() / "configs" / "pipeline.yaml"
    assert load_config(project.config_path) == load_config(EMBEDDED_CONFIG)  # the embedded toy, to edit
    thresholds = project.thresholds()
    assert set(thresholds.sources.values()) == {str(tmp_path.resolve() / "configs" / "gates.yaml")}
    assert project.baselines_dir.is_dir()
    load_profiles(project.hardware_profiles_path)  # unset: the embedded profiles


def test_the_workflows_use_the_installed_package(tmp_path: Path) -> None:
    scaffold(tmp_path)
    for name in ("distillgates-quality.yml", "distillgates-macos-speed.yml"):
        text = (tmp_path / ".github" / "workflows" / name).read_text()
        workflow = yaml.safe_load(text)
        steps = next(iter(workflow["jobs"].values()))["steps"]
        commands = "\n".join(step.get("run", "") for step in steps)
        assert f'"distillgates=={__version__}" "torch==2.13.0"' in commands  # torch pinned wherever installed
        assert "distillgates run" in commands and "pytest" in commands
        for repo_only in ("make ", ".venv/", "gates/", "configs/toy.yaml", "pytest_distillgates"):
            assert repo_only not in commands, (name, repo_only)
    linux = (tmp_path / ".github" / "workflows" / "distillgates-quality.yml").read_text()
    assert "--index-url https://download.pytorch.org/whl/cpu" in linux  # never a CUDA torch on the Linux runner
    assert "runs-on: ubuntu-latest" in linux
    # the speed references out of git: an ignored folder cached by the blessed digests (the speed.json files)
    macos = yaml.safe_load((tmp_path / ".github" / "workflows" / "distillgates-macos-speed.yml").read_text())
    job = next(iter(macos["jobs"].values()))
    store = job["env"]["DISTILLGATES_REFERENCE_STORE"]
    cache = {step["uses"].split("@")[0]: step["with"] for step in job["steps"]
             if "actions/cache/" in step.get("uses", "")}
    assert cache["actions/cache/restore"]["path"] == cache["actions/cache/save"]["path"] == store
    assert cache["actions/cache/restore"]["key"] == cache["actions/cache/save"]["key"]
    assert "hashFiles('baselines/*/speed.json')" in cache["actions/cache/save"]["key"]


def test_the_nightly_workflow_rebuilds_every_step_through_the_two_gate_workflows(tmp_path: Path) -> None:
    """The nightly calls the quality and macOS workflows (one definition of each job) with fresh: true, and there
    they restore no cached run and rebuild every step (--force); a pull request keeps the cache."""
    scaffold(tmp_path)
    workflows = tmp_path / ".github" / "workflows"
    nightly = yaml.safe_load((workflows / "distillgates-nightly.yml").read_text())
    triggers = nightly[True]  # YAML 1.1 reads the key `on` as True
    assert "schedule" in triggers and "workflow_dispatch" in triggers
    called = {job["uses"]: job["with"] for job in nightly["jobs"].values()}
    assert called == {"./.github/workflows/distillgates-quality.yml": {"fresh": True},
                      "./.github/workflows/distillgates-macos-speed.yml": {"fresh": True}}
    for path in called:
        workflow = yaml.safe_load((tmp_path / path).read_text())
        assert workflow[True]["workflow_call"]["inputs"]["fresh"] == {
            "description": workflow[True]["workflow_call"]["inputs"]["fresh"]["description"], "default": False,
            "type": "boolean"}
        assert "pull_request" in workflow[True]
        steps = {step.get("name", ""): step for step in next(iter(workflow["jobs"].values()))["steps"]}
        assert steps["Restore the pipeline run"]["if"] == "${{ !inputs.fresh }}"
        pipeline = next(step for name, step in steps.items() if name.startswith("Pipeline"))
        assert pipeline["run"] == "distillgates run ${{ inputs.fresh && '--force' || '' }}"


def test_init_refuses_to_overwrite_and_names_the_files(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "configs").mkdir()
    (tmp_path / "configs" / "gates.yaml").write_text("mine\n")
    (tmp_path / "distillgates.yaml").write_text("mine\n")
    assert main(["init", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "distillgates.yaml" in err and "configs/gates.yaml" in err and "pipeline.yaml" not in err
    assert (tmp_path / "configs" / "gates.yaml").read_text() == "mine\n"
    assert not (tmp_path / "configs" / "pipeline.yaml").exists()  # nothing written at all


def test_commands_work_from_any_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                       capsys: pytest.CaptureFixture[str]) -> None:
    """The issue's failure: `distillgates profile` in an empty folder read configs/hardware_profiles.yaml."""
    monkeypatch.chdir(tmp_path)
    assert main(["profile"]) == 0
    assert '"hardware_profile_key"' in capsys.readouterr().out
    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert exit_info.value.code == 0 and capsys.readouterr().out.strip() == f"distillgates {__version__}"


def test_commands_in_a_subfolder_use_the_projects_config_and_runs(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """From a subfolder of a project, a command takes the project's config and writes to the project's runs/
    (where the gates look), as the gates find the project above pytest's rootdir."""
    (tmp_path / "configs").mkdir()
    (tmp_path / "configs" / "pipeline.yaml").write_text(EMBEDDED_CONFIG.read_text().replace("name: toy", "name: mine"))
    (tmp_path / "distillgates.yaml").write_text("config: configs/pipeline.yaml\n")
    (tmp_path / "tests" / "unit").mkdir(parents=True)
    monkeypatch.chdir(tmp_path / "tests" / "unit")
    args = build_parser().parse_args(["data"])
    _project_defaults(args)
    assert Path(args.config) == tmp_path.resolve() / "configs" / "pipeline.yaml"
    assert default_run_dir(load_config(args.config)) == tmp_path.resolve() / "runs" / "mine"


@pytest.mark.integration  # a Python process (~3 s)
def test_python_dash_m_distillgates(tmp_path: Path) -> None:
    out = subprocess.run([sys.executable, "-m", "distillgates", "--version"], cwd=tmp_path, capture_output=True,
                         text=True, check=True)
    assert out.stdout.strip() == f"distillgates {__version__}"


@pytest.mark.integration  # the data step of the embedded toy task (~5 s)
def test_a_step_with_no_config_runs_the_embedded_toy_in_an_empty_folder(tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """The issue's failure: `distillgates run` in an empty folder looked for configs/toy.yaml there."""
    monkeypatch.chdir(tmp_path)
    assert main(["data"]) == 0
    header = (tmp_path / "runs" / "toy" / "data" / "eval.jsonl").read_text().splitlines()[0]
    assert '"__header__": true' in header
