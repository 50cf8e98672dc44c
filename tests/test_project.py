"""Project settings: a project's own files where distillgates.yaml / [tool.distillgates] name them, else the
embedded defaults; bad settings name the file, line and field; thresholds override key by key."""

from __future__ import annotations

from pathlib import Path

import pytest

from distillgates.config import ConfigError, GatesConfig
from distillgates.project import EMBEDDED_CONFIG, EMBEDDED_PROFILES, EMBEDDED_THRESHOLDS, Project


def test_embedded_defaults_are_package_files_and_used_without_settings(tmp_path: Path) -> None:
    for path in (EMBEDDED_CONFIG, EMBEDDED_PROFILES, EMBEDDED_THRESHOLDS):
        assert path.is_file() and path.parent.parent.name == "distillgates"
    project = Project.load(tmp_path)
    assert project.source is None
    assert project.config_path == EMBEDDED_CONFIG and project.hardware_profiles_path == EMBEDDED_PROFILES
    assert project.baselines_dir == tmp_path.resolve() / "baselines"
    thresholds = project.thresholds()
    assert set(thresholds.sources.values()) == {str(EMBEDDED_THRESHOLDS)}
    assert thresholds.label() == str(EMBEDDED_THRESHOLDS)


def test_settings_file_names_the_projects_own_files(tmp_path: Path) -> None:
    (tmp_path / "cfg").mkdir()
    (tmp_path / "cfg" / "pipeline.yaml").write_text("name: mine\n")
    (tmp_path / "cfg" / "profiles.yaml").write_text("version: 1\nprofiles: []\n")
    (tmp_path / "distillgates.yaml").write_text("config: cfg/pipeline.yaml\nhardware_profiles: cfg/profiles.yaml\n"
                                                "baselines: ci/baselines\n")
    project = Project.load(tmp_path)
    root = tmp_path.resolve()
    assert project.source == str(root / "distillgates.yaml")
    assert project.config_path == root / "cfg" / "pipeline.yaml"
    assert project.hardware_profiles_path == root / "cfg" / "profiles.yaml"
    assert project.baselines_dir == root / "ci" / "baselines"


def test_pyproject_table_works_like_the_settings_file(tmp_path: Path) -> None:
    (tmp_path / "mine.yaml").write_text("name: mine\n")
    (tmp_path / "pyproject.toml").write_text('[project]\nname = "x"\n\n[tool.distillgates]\nconfig = "mine.yaml"\n')
    project = Project.load(tmp_path)
    assert project.config_path == tmp_path.resolve() / "mine.yaml"
    assert project.source is not None and project.source.endswith("pyproject.toml [tool.distillgates]")


def test_a_pyproject_without_the_table_is_not_a_distillgates_project(tmp_path: Path) -> None:
    (tmp_path / "pyproject.toml").write_text('[tool.pytest.ini_options]\naddopts = "-q"\n')
    assert Project.load(tmp_path).source is None


def test_both_settings_places_are_refused(tmp_path: Path) -> None:
    (tmp_path / "distillgates.yaml").write_text("baselines: b\n")
    (tmp_path / "pyproject.toml").write_text('[tool.distillgates]\nbaselines = "b"\n')
    with pytest.raises(ConfigError, match=r"distillgates\.yaml: the project's settings are also in .*pyproject"):
        Project.load(tmp_path)


def test_bad_settings_name_file_line_and_field(tmp_path: Path) -> None:
    settings = tmp_path / "distillgates.yaml"
    settings.write_text("baselines: b\nthreshold: gates.yaml\n")
    with pytest.raises(ConfigError, match=r"distillgates\.yaml:2: threshold: unknown key"):
        Project.load(tmp_path)
    settings.write_text("baselines: b\nconfig: nowhere.yaml\n")
    project = Project.load(tmp_path)
    with pytest.raises(ConfigError, match=r"distillgates\.yaml:2: config: .*nowhere\.yaml does not exist"):
        _ = project.config_path
    (tmp_path / "pyproject.toml").write_text("[tool.distillgates\n")
    settings.unlink()
    with pytest.raises(ConfigError, match=r"pyproject\.toml: invalid TOML"):
        Project.load(tmp_path)


def test_thresholds_override_key_by_key_and_name_their_file(tmp_path: Path) -> None:
    own = tmp_path / "gates.yaml"
    own.write_text("gates:\n  f1_lax_min: 0.95\n  controls_with_integration_max: 0\n")
    (tmp_path / "distillgates.yaml").write_text("thresholds: gates.yaml\n")
    thresholds = Project.load(tmp_path).thresholds()
    defaults = GatesConfig()
    assert thresholds.values.f1_lax_min == 0.95
    assert thresholds.values.json_validity_min == defaults.json_validity_min  # not set: the embedded value
    own = own.resolve()
    assert thresholds.sources["f1_lax_min"] == str(own)
    assert thresholds.sources["controls_with_integration_max"] == str(own)
    assert thresholds.sources["json_validity_min"] == str(EMBEDDED_THRESHOLDS)
    assert thresholds.label() == f"{own} (f1_lax_min, controls_with_integration_max); the rest: {EMBEDDED_THRESHOLDS}"
    assert thresholds.loosened() == {}  # tighter and equal values are not looser


def test_thresholds_looser_than_the_embedded_ones_are_named(tmp_path: Path) -> None:
    """A project may relax a gate, but the label (terminal table, Markdown summary, gate report) says so."""
    (tmp_path / "gates.yaml").write_text("gates:\n  privacy_ok_rate_min: 0.5\n  ttfa_p95_tokens_max: 40\n"
                                         "  significance_alpha: 0.01\n  speed_regression_max: 0.02\n")
    (tmp_path / "distillgates.yaml").write_text("thresholds: gates.yaml\n")
    thresholds = Project.load(tmp_path).thresholds()
    assert thresholds.loosened() == {"privacy_ok_rate_min": (0.5, 1.0), "ttfa_p95_tokens_max": (40.0, 25.0),
                                     "significance_alpha": (0.01, 0.05)}  # speed_regression_max 0.02 is tighter
    assert thresholds.label().endswith("; LOOSER than the embedded defaults: privacy_ok_rate_min 0.5 (embedded "
                                       "1.0), ttfa_p95_tokens_max 40.0 (embedded 25.0), significance_alpha 0.01 "
                                       "(embedded 0.05)")


def test_hardware_profiles_loosening_the_speed_gate_are_named(tmp_path: Path) -> None:
    """A project's hardware profile tolerating a larger speed regression than the embedded profile of its key (or,
    for a key of its own, than speed_regression_max) is flagged LOOSER like a loosened threshold."""
    text = EMBEDDED_PROFILES.read_text().replace("key: m1-max-64g\n    soc_regex: '^Apple M1 Max$'\n    min_ram_gb: "
                                                 "64\n    gating: {max_regression: 0.05", "key: m1-max-64g\n    "
                                                 "soc_regex: '^Apple M1 Max$'\n    min_ram_gb: 64\n    gating: "
                                                 "{max_regression: 0.2", 1)
    text += "\n  - key: my-box\n    soc_regex: '^Box$'\n    min_ram_gb: 8\n    gating: {max_regression: 0.08}\n"
    (tmp_path / "profiles.yaml").write_text(text)
    (tmp_path / "distillgates.yaml").write_text("hardware_profiles: profiles.yaml\n")
    thresholds = Project.load(tmp_path).thresholds()
    assert thresholds.loosened() == {"hardware_profiles[m1-max-64g].gating.max_regression": (0.2, 0.05),
                                     "hardware_profiles[my-box].gating.max_regression": (0.08, 0.05)}
    assert "LOOSER than the embedded defaults: hardware_profiles[m1-max-64g].gating.max_regression 0.2 (embedded " \
           "0.05)" in thresholds.label()


def test_a_bad_threshold_names_its_file_line_and_field(tmp_path: Path) -> None:
    (tmp_path / "gates.yaml").write_text("gates:\n  f1_lax_min: 0.95\n  json_validity_min: high\n")
    (tmp_path / "distillgates.yaml").write_text("thresholds: gates.yaml\n")
    with pytest.raises(ConfigError, match=r"gates\.yaml:3: gates\.json_validity_min: expected float, got str"):
        Project.load(tmp_path).thresholds()
    (tmp_path / "gates.yaml").write_text("f1_lax_min: 0.95\n")
    with pytest.raises(ConfigError, match=r"gates\.yaml: no 'gates:' section"):
        Project.load(tmp_path).thresholds()


def test_the_embedded_thresholds_are_the_documented_defaults(tmp_path: Path) -> None:
    """The gates.yaml shipped in the package states DESIGN.md's defaults, which GatesConfig also holds."""
    assert Project.load(tmp_path).thresholds().values == GatesConfig()


def test_find_walks_up_to_the_projects_root(tmp_path: Path) -> None:
    """The nearest folder with distillgates.yaml, a pyproject.toml or .git is the project (its settings or none)."""
    (tmp_path / "proj" / "tests" / "unit").mkdir(parents=True)
    (tmp_path / "proj" / "distillgates.yaml").write_text("baselines: blessed\n")
    found = Project.find(tmp_path / "proj" / "tests" / "unit")
    assert found.root == (tmp_path / "proj").resolve() and found.baselines_dir == found.root / "blessed"
    (tmp_path / "proj" / "tests" / "pyproject.toml").write_text("[tool.other]\n")  # a nested project of its own
    inner = Project.find(tmp_path / "proj" / "tests" / "unit")
    assert inner.root == (tmp_path / "proj" / "tests").resolve() and inner.source is None
