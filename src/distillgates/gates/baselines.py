"""Blessed baselines: ``<root>/<profile>/<group>.json`` and ``<root>/common/<group>.json``.

A group file holds the hardware profile it was measured on and one entry per baseline key
(value, raw samples for speed, the metric's definition and provenance). Design choices:

- Blessing never writes while gates run: entries are staged in memory and :meth:`commit`
  writes each group file atomically (temp file + rename via :mod:`distillgates.io`) at the end
  of the session, so an interrupted bless leaves every old file intact and a crash during the
  commit leaves each file either old or new, never half written.
- A baseline measured on another hardware profile is refused unless explicitly allowed: the
  file's ``hardware_profile_key`` must equal the selected profile.
- Every entry records the run's report fingerprints it was blessed with. A baseline blessed on
  another eval set (``EVAL_SET_KEYS`` differ from the run's) is refused unless explicitly
  allowed: a metric measured on other items, another tokenizer, tool registry or prompt
  wrapper is not comparable. An entry without fingerprints (blessed before they were
  recorded) is refused and must be re-blessed.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from distillgates.io import atomic_write_json

SCHEMA_VERSION = 1
COMMON = "common"  # folder of hardware-independent baselines
# The report fingerprints that define the eval set a metric was measured on (the model and runner
# may change: that is what a baseline comparison measures).
EVAL_SET_KEYS = ("dataset_sha256", "tokenizer_fingerprint", "tool_registry_sha256", "prompt_wrapper_sha256")


class BaselineError(AssertionError):
    """A gate cannot be compared with its baseline (missing, cross-hardware, corrupt)."""


class MissingBaseline(BaselineError):
    pass


class CrossHardwareBaseline(BaselineError):
    pass


class OtherEvalSetBaseline(BaselineError):
    """The baseline was blessed on another eval set, or records none (an old baseline)."""


@dataclass
class BaselineEntry:
    """One blessed value of one metric."""

    value: Any
    definition: str
    samples: list[list[float]] | None = None  # raw samples per worker process (speed gates)
    provenance: dict[str, Any] = field(default_factory=dict)  # git sha, date, config, hardware
    fingerprints: dict[str, str] | None = None  # the run report's fingerprints it was blessed with
    hardware_profile_key: str | None = None  # profile of the file it came from (None: common)
    path: Path | None = None  # the file it came from (None: not read from a file)
    items: dict[str, float] | None = None  # per-item scores by item id (paired quality drift gates)

    def to_json(self) -> dict[str, Any]:
        data = {"value": self.value, "definition": self.definition, "samples": self.samples,
                "fingerprints": self.fingerprints, "provenance": self.provenance}
        return data if self.items is None else {**data, "items": self.items}


def _read_group(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise BaselineError(f"{path}:{err.lineno}: invalid JSON baseline file: {err.msg}") from err
    if not isinstance(data, dict) or not isinstance(data.get("entries"), dict):
        raise BaselineError(f"{path}: baseline file must be an object with an 'entries' mapping")
    if data.get("schema_version") != SCHEMA_VERSION:
        raise BaselineError(f"{path}: schema_version must be {SCHEMA_VERSION}, found {data.get('schema_version')!r}")
    for key, entry in data["entries"].items():
        if not isinstance(entry, dict) or "value" not in entry or "definition" not in entry:
            raise BaselineError(f"{path}: entries.{key}: needs 'value' and 'definition'")
        if not isinstance(entry.get("items") or {}, dict):
            raise BaselineError(f"{path}: entries.{key}.items must be a mapping of item id to score")
        if not isinstance(entry.get("fingerprints") or {}, dict):
            found = entry["fingerprints"]
            raise BaselineError(f"{path}: entries.{key}.fingerprints must be a mapping, found {found!r}")
    return data


class BaselineStore:
    """Reads blessed baselines for one hardware profile and stages new ones for a bless."""

    def __init__(self, root: str | Path, profile: str) -> None:
        self.root = Path(root)
        self.profile = profile
        self._staged: dict[Path, dict[str, dict[str, Any]]] = {}
        self._used: set[tuple[Path, str]] = set()

    def path(self, group: str, hardware_dependent: bool) -> Path:
        return self.root / (self.profile if hardware_dependent else COMMON) / f"{group}.json"

    def load(self, group: str, key: str, *, hardware_dependent: bool, run_fingerprints: Mapping[str, Any] | None,
             allow_cross_hw: bool = False, allow_other_eval_set: bool = False,
             bless_command: str = "pytest --bless") -> BaselineEntry:
        """The blessed entry for ``key``, checked against the gated run's report ``run_fingerprints``.

        Raises:
            MissingBaseline: no entry (the message names ``bless_command``).
            CrossHardwareBaseline: the only entry was measured on another hardware profile.
            OtherEvalSetBaseline: the entry records no fingerprints, or (unless
                ``allow_other_eval_set``) its eval-set fingerprints differ from ``run_fingerprints``.
        """
        entry = self._find(group, key, hardware_dependent, allow_cross_hw, bless_command)
        where = f"{entry.path}: entries.{key}"
        if not entry.fingerprints:
            raise OtherEvalSetBaseline(f"{where} records no fingerprints (blessed before baselines recorded the "
                                       f"eval set they were measured on); re-bless it: {bless_command}")
        run = run_fingerprints or {}
        differ = [f"{k}: baseline {entry.fingerprints.get(k)!r}, run {run.get(k)!r}" for k in EVAL_SET_KEYS
                  if entry.fingerprints.get(k) != run.get(k)]
        if differ and not allow_other_eval_set:
            raise OtherEvalSetBaseline(
                f"{where} was blessed on another eval set ({'; '.join(differ)}); refusing to compare metrics of "
                f"different eval sets (pass --allow-other-eval-set to accept, or re-bless: {bless_command})"
            )
        return entry

    def _find(self, group: str, key: str, hardware_dependent: bool, allow_cross_hw: bool,
              bless_command: str) -> BaselineEntry:
        path = self.path(group, hardware_dependent)
        if path.exists():
            data = _read_group(path)
            file_profile = data.get("hardware_profile_key")
            if hardware_dependent and file_profile != self.profile and not allow_cross_hw:
                raise CrossHardwareBaseline(
                    f"{path}: baseline was measured on hardware profile {file_profile!r}, this run uses "
                    f"{self.profile!r}; refusing a cross-hardware comparison (pass --allow-cross-hw to accept, "
                    f"or bless for this profile: {bless_command})"
                )
            if key in data["entries"]:
                self._used.add((path, key))
                return self._entry(path, data["entries"][key], file_profile)
        if hardware_dependent:
            others = sorted(p for p in self.root.glob(f"*/{group}.json") if p.parent.name not in (COMMON, self.profile))
            others = [p for p in others if key in _read_group(p)["entries"]]
            if others and allow_cross_hw:
                data = _read_group(others[0])
                self._used.add((others[0], key))
                return self._entry(others[0], data["entries"][key], data.get("hardware_profile_key"))
            if others:
                names = ", ".join(p.parent.name for p in others)
                raise CrossHardwareBaseline(
                    f"no baseline {group}/{key} for hardware profile {self.profile!r} (only for: {names}); "
                    f"refusing a cross-hardware comparison (pass --allow-cross-hw), or bless it: {bless_command}"
                )
        raise MissingBaseline(f"missing baseline {key!r} in {path}; bless it with: {bless_command}")

    @staticmethod
    def _entry(path: Path, raw: dict[str, Any], profile: str | None) -> BaselineEntry:
        return BaselineEntry(raw["value"], raw["definition"], raw.get("samples"), raw.get("provenance", {}),
                             raw.get("fingerprints"), profile, path, raw.get("items"))

    def stage(self, group: str, key: str, entry: BaselineEntry, *, hardware_dependent: bool) -> Path:
        """Keep a blessed entry in memory until :meth:`commit`."""
        path = self.path(group, hardware_dependent)
        self._staged.setdefault(path, {})[key] = entry.to_json()
        return path

    @property
    def staged(self) -> dict[Path, list[str]]:
        return {path: sorted(entries) for path, entries in self._staged.items()}

    def commit(self) -> list[Path]:
        """Write every staged group file atomically (merging with the entries already there)."""
        written = []
        for path, entries in sorted(self._staged.items()):
            old = _read_group(path)["entries"] if path.exists() else {}
            hardware_key = None if path.parent.name == COMMON else self.profile
            atomic_write_json(path, {
                "schema_version": SCHEMA_VERSION,
                "group": path.stem,
                "hardware_profile_key": hardware_key,
                "entries": {**old, **entries},
            })
            written.append(path)
        self._staged.clear()
        return written

    def unused(self) -> list[str]:
        """``<file>::<key>`` of entries (this profile and common) that no gate used or blessed."""
        touched = self._used | {(p, k) for p, entries in self._staged.items() for k in entries}
        result = []
        for folder in (self.root / self.profile, self.root / COMMON):
            for path in sorted(folder.glob("*.json")):
                for key in sorted(_read_group(path)["entries"]):
                    if (path, key) not in touched:
                        result.append(f"{path}::{key}")
        return result
