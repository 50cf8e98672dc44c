"""Hardware detection and hardware-profile matching (the embedded ``distillgates/configs/hardware_profiles.yaml``,
or a project's own: :mod:`distillgates.project`).

Speed numbers are only comparable on the same hardware, so every speed report carries a
``hardware_profile_key`` and baselines live under ``baselines/<key>/``.

Design choices:
- Matching picks the **most specific** profile: among the profiles whose ``soc_regex``
  matches the SoC brand string, the one with the largest ``min_ram_gb`` that the machine
  has. Never the first that happens to match (an M3 Max with 128 GB is ``m3-max-96g``, not
  ``m3-max-48g``).
- A machine that matches no profile (any Linux CI box, or an Apple chip with less RAM than
  every profile of its family) gets a generated key ``<system>-<arch>-<cpu-slug>-<cores>c``
  so its baselines never mix with an Apple profile's.
- ``--hw-profile`` (:func:`select_profile`) refuses a key that is not this machine's unless
  cross-hardware comparison is explicitly allowed.
- Profiles load through :func:`distillgates.config.from_dict`, so a bad field names the file,
  line and field; duplicate keys (YAML or profile ``key``) and invalid regexes are errors.
"""

from __future__ import annotations

import importlib.metadata
import os
import platform
import re
import resource
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from distillgates.config import ConfigError, from_dict, read_yaml
from distillgates.project import EMBEDDED_PROFILES

DEFAULT_PROFILES_PATH = EMBEDDED_PROFILES


class HardwareMismatchError(ValueError):
    """The selected hardware profile is not the profile of the machine measuring."""


# --------------------------------------------------------------------------------------
# Profile schema


@dataclass
class GatingPolicy:
    """Relative speed gating against the blessed baseline of the same profile."""

    max_regression: float = 0.05  # relative regression (TTFT up / TPS down) tolerated
    min_samples: int = 20  # raw samples per worker process and arm (--speed-samples is raised to it)

    def __post_init__(self) -> None:
        if not 0.0 < self.max_regression < 1.0:
            raise ValueError(f"max_regression must be in (0, 1), got {self.max_regression}")
        if self.min_samples < 2:
            raise ValueError(f"min_samples must be >= 2, got {self.min_samples}")


@dataclass
class ShapeTarget:
    """Absolute speed at one enumerated prefill length (the speed report's ``per_shape``)."""

    length: int  # the enumerated shape, e.g. 4096
    ttft_ms_p50_max: float | None = None
    tps_p50_min: float | None = None

    def __post_init__(self) -> None:
        if self.length < 1:
            raise ValueError(f"length must be >= 1, got {self.length}")
        _positive(ttft_ms_p50_max=self.ttft_ms_p50_max, tps_p50_min=self.tps_p50_min)


@dataclass
class SpeedTargets:
    """Absolute speed bands a student must meet on this profile, besides not regressing vs its baseline: a student
    that was already slow when blessed fails them. They belong to a model size and precision (the planning
    documents': the ~9B INT8 worker on an M1 Max 64 GB, TTFT p50 300-500 ms, TPS p50 25-35): a project sets its
    own in its hardware profiles. TTFT is bounded above and TPS below (faster never fails)."""

    ttft_ms_p50_max: float | None = None
    ttft_ms_p95_max: float | None = None
    tps_p50_min: float | None = None
    tps_p5_min: float | None = None  # the slow tail: the 5th percentile of the TPS samples
    peak_memory_gb_max: float | None = None  # the speed worker's peak resident memory
    drafter_ttft_ms_p50_max: float | None = None  # the drafter decoding alone (the documents: 120-200 ms on M1 Max)
    shapes: list[ShapeTarget] = field(default_factory=list)

    def __post_init__(self) -> None:
        _positive(ttft_ms_p50_max=self.ttft_ms_p50_max, ttft_ms_p95_max=self.ttft_ms_p95_max,
                  tps_p50_min=self.tps_p50_min, tps_p5_min=self.tps_p5_min,
                  peak_memory_gb_max=self.peak_memory_gb_max,
                  drafter_ttft_ms_p50_max=self.drafter_ttft_ms_p50_max)  # fmt: skip
        lengths = [s.length for s in self.shapes]
        if len(set(lengths)) != len(lengths):
            raise ValueError(f"shapes: each length once, got {lengths}")


def reset_peak_rss() -> None:
    """Start a memory peak (a pipeline step's): Linux resets the process's peak resident set (``VmHWM``) when 5 is
    written to ``/proc/self/clear_refs``; elsewhere the peak stays the process's so far."""
    with suppress(OSError):
        Path("/proc/self/clear_refs").write_text("5")


def peak_rss_bytes() -> int:
    """Peak resident memory of this process: Linux ``VmHWM`` (since :func:`reset_peak_rss`, or since the process's
    ``exec``), elsewhere ``ru_maxrss`` (bytes on macOS). Not Linux's ``ru_maxrss``: it keeps the peak across ``fork``
    and ``exec``, so a worker process started by a pipeline holding 19 GiB would report 19 GiB of its own."""
    with suppress(OSError, StopIteration, ValueError):
        status = Path("/proc/self/status").read_text().splitlines()
        return int(next(line for line in status if line.startswith("VmHWM:")).split()[1]) * 1024
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)


def _positive(**values: float | None) -> None:
    for name, value in values.items():
        if value is not None and not value > 0:
            raise ValueError(f"{name} must be > 0 (or absent), got {value}")


@dataclass
class HardwareProfile:
    """One Apple-silicon tier: how to recognise it and how to gate speed on it."""

    key: str  # e.g. "m1-max-64g"; names the baselines folder
    soc_regex: str  # matched (re.search) against the SoC brand string, e.g. "^Apple M1 Max$"
    min_ram_gb: float  # the machine needs at least this much RAM
    gating: GatingPolicy = field(default_factory=GatingPolicy)  # read by the speed gates (pytest_distillgates.fixtures)
    speed_targets: SpeedTargets | None = None  # absolute bands (the speed_targets gates); None: relative gates only
    description: str = ""

    def __post_init__(self) -> None:
        if not re.fullmatch(r"[a-z0-9][a-z0-9-]*", self.key):
            raise ValueError(f"key must be lowercase letters, digits and '-', got {self.key!r}")
        try:
            re.compile(self.soc_regex)
        except re.error as err:
            raise ValueError(f"soc_regex {self.soc_regex!r} is not a valid regular expression: {err}") from err
        if self.min_ram_gb <= 0:
            raise ValueError(f"min_ram_gb must be > 0, got {self.min_ram_gb}")

    def matches(self, hw: DetectedHardware) -> bool:
        """SoC regex matches and the machine has at least ``min_ram_gb``."""
        return re.search(self.soc_regex, hw.soc) is not None and hw.ram_gb >= self.min_ram_gb


# --------------------------------------------------------------------------------------
# Loading


def _duplicate_yaml_keys(text: str, source: str) -> None:
    """PyYAML silently keeps the last of two equal keys; a duplicated field is a config bug."""
    stack = [yaml.compose(text, Loader=yaml.SafeLoader)]
    while stack:
        node = stack.pop()
        if isinstance(node, yaml.MappingNode):
            seen: dict[str, int] = {}
            for key_node, value_node in node.value:
                line = key_node.start_mark.line + 1
                if key_node.value in seen:
                    first = seen[key_node.value]
                    raise ConfigError(
                        f"{source}:{line}: {key_node.value}: duplicate key (first defined on line {first})"
                    )
                seen[key_node.value] = line
                stack.append(value_node)
        elif isinstance(node, yaml.SequenceNode):
            stack.extend(node.value)


def load_profiles(path: str | Path = DEFAULT_PROFILES_PATH) -> list[HardwareProfile]:
    """Load and validate ``hardware_profiles.yaml``.

    Raises:
        ConfigError: naming the file, line and field of an unknown key, a wrong type, an
            invalid regex, a duplicated YAML key or a duplicated profile ``key``.
    """
    path = Path(path)
    source = str(path)
    data = read_yaml(path)
    try:
        _duplicate_yaml_keys(path.read_text(), source)
    except yaml.YAMLError as err:  # read_yaml already parsed it; kept for completeness
        raise ConfigError(f"{source}: invalid YAML: {err}") from err
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: <root>: expected a mapping with 'version' and 'profiles'")
    lines = data.get("__lines__", {})
    unknown = sorted(set(data) - {"version", "profiles", "__lines__"})
    if unknown:
        raise ConfigError(f"{source}:{lines.get(unknown[0])}: {unknown[0]}: unknown key (expected: profiles, version)")
    if data.get("version", 1) != 1:
        raise ConfigError(f"{source}:{lines.get('version')}: version: expected 1, got {data['version']!r}")
    items = data.get("profiles")
    if not isinstance(items, list) or not items:
        raise ConfigError(f"{source}:{lines.get('profiles')}: profiles: expected a non-empty list of profiles")
    profiles: list[HardwareProfile] = []
    first_line: dict[str, int | None] = {}
    for i, item in enumerate(items):
        item_lines = item.get("__lines__", {}) if isinstance(item, dict) else {}
        line = min(item_lines.values(), default=lines.get("profiles"))
        if isinstance(item, dict) and isinstance(item.get("soc_regex"), str):
            try:  # checked here too, for the exact line of the field
                re.compile(item["soc_regex"])
            except re.error as err:
                raise ConfigError(
                    f"{source}:{item_lines.get('soc_regex', line)}: profiles[{i}].soc_regex: "
                    f"{item['soc_regex']!r} is not a valid regular expression: {err}"
                ) from err
        profile = from_dict(HardwareProfile, item, source, f"profiles[{i}]", line)
        if profile.key in first_line:
            raise ConfigError(
                f"{source}:{item_lines.get('key', line)}: profiles[{i}].key: duplicate profile key "
                f"{profile.key!r} (first defined on line {first_line[profile.key]})"
            )
        first_line[profile.key] = item_lines.get("key", line)
        profiles.append(profile)
    return profiles


# --------------------------------------------------------------------------------------
# Detection


@dataclass(frozen=True)
class DetectedHardware:
    """What this machine is, as far as speed comparisons care."""

    system: str  # "darwin" / "linux" / ...
    machine: str  # "arm64" / "x86_64" / ...
    soc: str  # macOS: machdep.cpu.brand_string ("Apple M3 Max"); Linux: /proc/cpuinfo model name
    os: str  # "macOS 14.5" / "Linux 6.8.0-..."
    ram_gb: float  # physical memory in GiB
    cores: int  # logical CPU count

    @property
    def chip_family(self) -> str | None:
        return chip_family(self.soc)


_CHIP_RE = re.compile(r"\bApple\s+M(\d+)(?:\s+(Pro|Max|Ultra))?\b", re.IGNORECASE)


def chip_family(soc: str) -> str | None:
    """Normalised Apple chip family, e.g. ``"Apple M3 Max"`` -> ``"M3 Max"``; ``None`` if not Apple M."""
    m = _CHIP_RE.search(soc)
    if m is None:
        return None
    return f"M{m.group(1)}" + (f" {m.group(2).capitalize()}" if m.group(2) else "")


def _sysctl(name: str) -> str:
    return subprocess.run(["sysctl", "-n", name], check=True, capture_output=True, text=True, timeout=10).stdout.strip()


def _linux_cpu_model(cpuinfo: str) -> str:
    for key in ("model name", "Hardware", "Processor", "cpu model"):
        for line in cpuinfo.splitlines():
            name, _, value = line.partition(":")
            if name.strip() == key and value.strip():
                return value.strip()
    return platform.processor() or platform.machine() or "unknown-cpu"


def _linux_ram_gb(meminfo: str) -> float:
    for line in meminfo.splitlines():
        if line.startswith("MemTotal:"):
            return int(line.split()[1]) * 1024 / 2**30  # kB -> GiB
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30


def detect_hardware() -> DetectedHardware:
    """Detect SoC/CPU, OS, RAM and cores of this machine (macOS via sysctl, Linux via /proc)."""
    machine = platform.machine().lower() or "unknown"
    cores = os.cpu_count() or 1
    if sys.platform == "darwin":
        soc = _sysctl("machdep.cpu.brand_string")
        ram_gb = int(_sysctl("hw.memsize")) / 2**30
        os_name = f"macOS {platform.mac_ver()[0]}"
        return DetectedHardware("darwin", machine, soc, os_name, round(ram_gb, 1), cores)
    if sys.platform.startswith("linux"):
        cpuinfo = Path("/proc/cpuinfo").read_text(errors="replace") if Path("/proc/cpuinfo").exists() else ""
        meminfo = Path("/proc/meminfo").read_text() if Path("/proc/meminfo").exists() else ""
        soc = _linux_cpu_model(cpuinfo)
        return DetectedHardware(
            "linux", machine, soc, f"Linux {platform.release()}", round(_linux_ram_gb(meminfo), 1), cores
        )
    soc = platform.processor() or machine
    ram_gb = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30 if hasattr(os, "sysconf") else 0.0
    return DetectedHardware(
        sys.platform, machine, soc, f"{platform.system()} {platform.release()}", round(ram_gb, 1), cores
    )


# --------------------------------------------------------------------------------------
# Matching and selection


def match_profile(hw: DetectedHardware, profiles: list[HardwareProfile]) -> HardwareProfile | None:
    """The most specific matching profile: regex match and the largest ``min_ram_gb`` that fits."""
    candidates = [p for p in profiles if p.matches(hw)]
    return max(candidates, key=lambda p: p.min_ram_gb, default=None)


def _slug(text: str) -> str:
    text = re.sub(r"\((r|tm|c)\)|\b(cpu|processor)\b|@.*$", " ", text.lower())
    return re.sub(r"[^a-z0-9]+", "-", text).strip("-")[:40].strip("-") or "unknown-cpu"


def generated_key(hw: DetectedHardware) -> str:
    """Key of a machine without a profile: ``<system>-<arch>-<cpu-slug>-<cores>c``."""
    return f"{hw.system}-{hw.machine}-{_slug(hw.soc)}-{hw.cores}c"


def profile_key(hw: DetectedHardware, profiles: list[HardwareProfile] | None = None) -> str:
    """The matched profile's key, or the generated key when no profile matches."""
    profile = match_profile(hw, load_profiles() if profiles is None else profiles)
    return profile.key if profile is not None else generated_key(hw)


_profile_key_of = profile_key  # hardware_header's argument shadows the function name


def _describe(hw: DetectedHardware) -> str:
    return f"{hw.soc!r} ({hw.chip_family or 'not Apple M'}), {hw.ram_gb:g} GB RAM, {hw.cores} cores"


def select_profile(
    key: str | None,
    detected: DetectedHardware | None = None,
    allow_cross_hw: bool = False,
    profiles: list[HardwareProfile] | None = None,
) -> str:
    """Resolve ``--hw-profile``: the key a measurement on ``detected`` is recorded and gated under.

    ``key=None`` means auto-detect. An explicit key must be this machine's own key (matched
    profile or generated key), unless ``allow_cross_hw``.

    Raises:
        HardwareMismatchError: naming the selected profile and the detected hardware/profile.
    """
    profiles = load_profiles() if profiles is None else profiles
    detected = detect_hardware() if detected is None else detected
    own = profile_key(detected, profiles)
    if key is None or key == own or allow_cross_hw:
        return own if key is None else key
    known = {p.key: p for p in profiles}
    if key in known:
        p = known[key]
        why = (
            f"profile {key!r} needs soc_regex {p.soc_regex!r} and >= {p.min_ram_gb:g} GB RAM"
            if not p.matches(detected)
            else f"a more specific profile {own!r} matches"
        )
    else:
        why = f"{key!r} is not a profile in the profiles file ({', '.join(known)}) nor this machine's generated key"
    raise HardwareMismatchError(
        f"--hw-profile {key!r} does not match this machine: detected {_describe(detected)} -> profile {own!r}; "
        f"{why}. Measure on matching hardware or pass --allow-cross-hw."
    )


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


# how the timed figures were produced, by ``speed.engine`` (the planning documents' ``export_path`` label)
EXPORT_PATHS = {"torch": "pytorch_eager", "coreml": "pytorch_exportedprogram_coreml",
                "coreai": "pytorch_exportedprogram_coreai"}


def hardware_header(engine: str | None = None, export_dir: str | Path | None = None,
                    profile_key: str | None = None) -> dict[str, Any]:  # fmt: skip
    """The ``hardware`` header of speed/eval reports (contract.md, report.json).

    ``engine`` (``speed.engine``: ``torch``, ``coreml`` or ``coreai``) gives the ``export_path`` label of what was timed
    (None: nothing timed); ``export_dir`` the exported package's folder where the timed model is one.
    ``profile_key`` defaults to this machine's (matched or generated) key.
    """
    if engine is not None and engine not in EXPORT_PATHS:
        raise ValueError(f"engine must be one of {sorted(EXPORT_PATHS)}, got {engine!r}")
    hw = detect_hardware()
    if profile_key is None:
        profile_key = _profile_key_of(hw)
    return {
        "soc": hw.soc,
        "chip_family": hw.chip_family,
        "os": hw.os,
        "ram_gb": hw.ram_gb,
        "cores": hw.cores,
        "torch_version": _version("torch"),
        "coremltools_version": _version("coremltools"),
        "export_path": None if engine is None else EXPORT_PATHS[engine],
        "export_dir": None if export_dir is None else str(export_dir),
        "hardware_profile_key": profile_key,
    }


@contextmanager
def torch_threads(n: int) -> Iterator[None]:
    """Run the block on ``n`` torch intra-op threads, then restore the caller's setting."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(threads)
