"""A project's distillgates files: its own where it names them, else the package's embedded defaults.

A project names its files in ``distillgates.yaml`` or in ``[tool.distillgates]`` of its
``pyproject.toml`` (one of the two, never both), paths relative to the project folder::

    config: configs/pipeline.yaml                 # `distillgates run` with no argument; the gates' default run
    thresholds: configs/gates.yaml                # a `gates:` section; each key it sets overrides the embedded one
    hardware_profiles: configs/hardware_profiles.yaml
    baselines: baselines                          # blessed baselines (default: baselines/)
    references: s3://my-bucket/distillgates-refs  # speed reference store: a folder or an fsspec URL
                                                  # (default: references/ in the baselines folder)

Anything unset comes from ``distillgates/configs/`` inside the installed package (the embedded toy
config, gate thresholds and hardware profiles), so the command and the checklist work in any folder.
:class:`Project` is the one owner of these paths: the CLI, the gate session and the plugin's
fixtures ask it, nobody else spells them.
"""

from __future__ import annotations

import dataclasses
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from distillgates.config import ConfigError, GatesConfig, from_dict, load_config, read_yaml

EMBEDDED_DIR = Path(__file__).resolve().parent / "configs"
EMBEDDED_CONFIG = EMBEDDED_DIR / "toy.yaml"
EMBEDDED_THRESHOLDS = EMBEDDED_DIR / "gates.yaml"
EMBEDDED_PROFILES = EMBEDDED_DIR / "hardware_profiles.yaml"
SETTINGS_FILE = "distillgates.yaml"
PYPROJECT_SECTION = "pyproject.toml [tool.distillgates]"


@dataclass
class ProjectSettings:
    """``distillgates.yaml`` / ``[tool.distillgates]``: which of its own files a project uses."""

    config: str | None = None  # pipeline config (default: the embedded toy task)
    thresholds: str | None = None  # gate thresholds overriding the embedded ones key by key
    hardware_profiles: str | None = None  # hardware profiles replacing the embedded ones
    baselines: str = "baselines"  # blessed baselines folder
    # the speed references' model files (content-addressed; the baselines keep their digests): a folder or an
    # fsspec URL (s3://..., gs://...); None: references/ in the baselines folder
    references: str | None = None


@dataclass
class Thresholds:
    """Gate thresholds and, per field, the file it came from."""

    values: GatesConfig
    sources: dict[str, str]  # GatesConfig field -> file
    embedded: GatesConfig = field(default_factory=GatesConfig)  # the embedded values the project's replace
    # the project's hardware profiles' speed policies looser than the embedded ones: name -> (value, embedded)
    profiles_loosened: dict[str, tuple[Any, Any]] = field(default_factory=dict)

    def loosened(self) -> dict[str, tuple[Any, Any]]:
        """The thresholds set looser than the embedded ones, ``name -> (value, embedded value)``: a ``*_min``
        below it, a ``*_max`` above it, a smaller ``significance_alpha`` (fewer regressions called), a gate
        waived that the embedded ones do not waive, a hardware profile of the project's tolerating a larger speed
        regression (``gating.max_regression``) than the embedded profile of its key (a new key: than
        ``speed_regression_max``)."""
        looser = {}
        for name, value in dataclasses.asdict(self.values).items():
            default = getattr(self.embedded, name)
            if name == "waive":  # a waived gate no longer fails unmeasured under CI
                relaxed = bool(set(value) - set(default))
            elif name.endswith("_min") or name == "significance_alpha":
                relaxed = value < default
            else:
                relaxed = name.endswith("_max") and value > default
            if relaxed:
                looser[name] = (value, default)
        return looser | self.profiles_loosened

    def label(self) -> str:
        """``<file> (k1, k2); the rest: <embedded file>`` — which file each threshold came from, in one line,
        then any threshold set looser than the embedded one (a reviewer sees a gate that was relaxed)."""
        by_file: dict[str, list[str]] = {}
        for name, source in self.sources.items():
            by_file.setdefault(source, []).append(name)
        embedded = str(EMBEDDED_THRESHOLDS)
        own = [f"{source} ({', '.join(names)})" for source, names in by_file.items() if source != embedded]
        label = "; ".join(own) + f"; the rest: {embedded}" if len(by_file) > 1 else next(iter(by_file))
        looser = [f"{name} {value} (embedded {default})" for name, (value, default) in self.loosened().items()]
        return label + (f"; LOOSER than the embedded defaults: {', '.join(looser)}" if looser else "")


@dataclass
class Project:
    """The project folder (the command's working directory; for pytest :meth:`find` from its rootdir) and its
    settings."""

    root: Path
    settings: ProjectSettings = field(default_factory=ProjectSettings)
    source: str | None = None  # the settings' file, None when the project has none (all embedded)
    lines: dict[str, int] = field(default_factory=dict)  # settings key -> line in ``source`` (YAML only)

    @classmethod
    def load(cls, root: str | Path) -> Project:
        """Read ``root``'s settings; a bad key or type names the file, line and field.

        Raises:
            ConfigError: both ``distillgates.yaml`` and ``[tool.distillgates]`` exist, or either is invalid.
        """
        root = Path(root).resolve()
        yaml_path = root / SETTINGS_FILE
        table = _pyproject_table(root / "pyproject.toml")
        if yaml_path.exists() and table is not None:
            raise ConfigError(f"{yaml_path}: the project's settings are also in {root / PYPROJECT_SECTION}; "
                              "keep one of the two")
        if yaml_path.exists():
            data = read_yaml(yaml_path) or {}
            settings = from_dict(ProjectSettings, data, source=str(yaml_path))
            lines = data.get("__lines__", {}) if isinstance(data, dict) else {}
            return cls(root, settings, str(yaml_path), lines)
        if table is not None:
            source = str(root / PYPROJECT_SECTION)
            return cls(root, from_dict(ProjectSettings, table, source=source), source)
        return cls(root)

    @classmethod
    def find(cls, start: str | Path) -> Project:
        """The project of the nearest folder at or above ``start`` that has ``distillgates.yaml``, a
        ``pyproject.toml`` or ``.git`` (where a project's root is, as black and ruff find it): pytest's rootdir
        is a test folder when the project has no pytest ini-file (``pytest tests/``). None such: ``start``."""
        start = Path(start).resolve()
        for folder in (start, *start.parents):
            if any((folder / name).exists() for name in (SETTINGS_FILE, "pyproject.toml", ".git")):
                return cls.load(folder)
        return cls.load(start)

    def _own(self, key: str) -> Path | None:
        """The project's file named by setting ``key`` (None: unset); it must exist."""
        value = getattr(self.settings, key)
        if value is None:
            return None
        path = self.root / value
        if not path.exists():
            where = f"{self.source}:{self.lines[key]}" if key in self.lines else str(self.source)
            raise ConfigError(f"{where}: {key}: {path} does not exist")
        return path

    @property
    def config_path(self) -> Path:
        return self._own("config") or EMBEDDED_CONFIG

    @property
    def hardware_profiles_path(self) -> Path:
        return self._own("hardware_profiles") or EMBEDDED_PROFILES

    @property
    def baselines_dir(self) -> Path:
        return self.root / self.settings.baselines

    @property
    def runs_dir(self) -> Path:
        return self.root / "runs"

    def thresholds(self) -> Thresholds:
        """The embedded thresholds, each key the project's thresholds file sets replaced by its value."""
        embedded = _gates_section(EMBEDDED_THRESHOLDS)
        values = dataclasses.asdict(embedded)
        sources = dict.fromkeys(values, str(EMBEDDED_THRESHOLDS))
        own = self._own("thresholds")
        if own is not None:
            section = _gates_section(own, partial=True)
            for key in section:
                values[key], sources[key] = section[key], str(own)
        return Thresholds(GatesConfig(**values), sources, embedded, self._profiles_loosened(embedded))

    def _profiles_loosened(self, embedded: GatesConfig) -> dict[str, tuple[Any, Any]]:
        own = self._own("hardware_profiles")
        if own is None:
            return {}
        from distillgates.hardware import load_profiles

        base = {p.key: p.gating.max_regression for p in load_profiles(EMBEDDED_PROFILES)}
        return {f"hardware_profiles[{p.key}].gating.max_regression": (p.gating.max_regression, allowed)
                for p in load_profiles(own)
                if p.gating.max_regression > (allowed := base.get(p.key, embedded.speed_regression_max))}


def _pyproject_table(path: Path) -> dict[str, Any] | None:
    if not path.exists():
        return None
    try:
        data = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as err:
        raise ConfigError(f"{path}: invalid TOML: {err}") from err
    return data.get("tool", {}).get("distillgates")


def _gates_section(path: Path, partial: bool = False) -> Any:
    """The ``gates:`` section of a thresholds file: a validated ``GatesConfig``, or with ``partial`` the
    validated values of the keys it sets."""
    data = read_yaml(path)
    if not isinstance(data, dict) or "gates" not in data:
        raise ConfigError(f"{path}: no 'gates:' section (the gate thresholds); add one, or unset `thresholds` "
                          "to gate with the embedded defaults")
    gates = load_config(path).gates  # the whole file validated: a bad key or type names the file, line and field
    if not partial:
        return gates
    return {key: getattr(gates, key) for key in (data["gates"] or {}) if key != "__lines__"}
