"""Hardware detection, profile loading/validation and most-specific profile matching."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from distillgates.config import ConfigError
from distillgates.hardware import (
    DEFAULT_PROFILES_PATH,
    DetectedHardware,
    HardwareMismatchError,
    chip_family,
    detect_hardware,
    generated_key,
    hardware_header,
    load_profiles,
    match_profile,
    peak_rss_bytes,
    profile_key,
    select_profile,
)


@pytest.fixture(scope="module")
def profiles():
    return load_profiles()


def mac(brand: str, ram_gb: float, cores: int = 12) -> DetectedHardware:
    return DetectedHardware("darwin", "arm64", brand, "macOS 15.1", ram_gb, cores)


REPO = Path(__file__).parents[1]
LINUX_BOX = DetectedHardware("linux", "x86_64", "Intel(R) Xeon(R) CPU E5-2686 v4 @ 2.30GHz", "Linux 6.8", 62.8, 8)


@pytest.mark.parametrize(
    ("brand", "ram_gb", "expected"),
    [
        ("Apple M1 Pro", 16, "m1-pro-16g"),
        ("Apple M1 Pro", 32, "m1-pro-16g"),
        ("Apple M1 Max", 64, "m1-max-64g"),
        ("Apple M1 Ultra", 128, "m1-ultra-64g"),
        ("Apple M2 Pro", 32, "m2-pro-16g"),
        ("Apple M2 Max", 96, "m2-max-32g"),
        ("Apple M2 Ultra", 192, "m2-ultra-64g"),
        ("Apple M3 Pro", 18, "m3-pro-18g"),
        ("Apple M3 Max", 48, "m3-max-48g"),
        ("Apple M3 Max", 64, "m3-max-48g"),
        ("Apple M3 Max", 96, "m3-max-96g"),
        ("Apple M3 Max", 128, "m3-max-96g"),  # most specific, not the first regex match
        ("Apple M4 Pro", 48, "m4-pro-24g"),
        ("Apple M4 Max", 36, "m4-max-36g"),
        ("Apple M4 Max", 128, "m4-max-36g"),
    ],
)
def test_profile_matching_table(profiles, brand, ram_gb, expected):
    hw = mac(brand, ram_gb)
    assert match_profile(hw, profiles).key == expected
    assert profile_key(hw, profiles) == expected


def test_matching_is_order_independent(profiles):
    hw = mac("Apple M3 Max", 128)
    assert match_profile(hw, list(reversed(profiles))).key == "m3-max-96g"
    assert match_profile(hw, profiles).key == "m3-max-96g"


def test_pro_regex_does_not_match_max_or_plain_chip(profiles):
    assert match_profile(mac("Apple M1", 16), profiles) is None
    assert match_profile(mac("Apple M2 Max", 16), profiles) is None  # below every M2 Max profile


def test_linux_box_gets_generated_key(profiles):
    assert match_profile(LINUX_BOX, profiles) is None
    key = profile_key(LINUX_BOX, profiles)
    assert key == "linux-x86_64-intel-xeon-e5-2686-v4-8c"
    assert key not in {p.key for p in profiles}


def test_apple_chip_with_too_little_ram_gets_no_apple_profile(profiles):
    hw = mac("Apple M1 Max", 32, cores=10)  # every M1 Max profile needs 64 GB
    assert match_profile(hw, profiles) is None
    assert profile_key(hw, profiles) == "darwin-arm64-apple-m1-max-10c"
    with pytest.raises(HardwareMismatchError, match=r"m1-max-64g.*Apple M1 Max.*32 GB.*>= 64 GB"):
        select_profile("m1-max-64g", hw, profiles=profiles)


@pytest.mark.parametrize(
    ("brand", "family"),
    [
        ("Apple M1", "M1"),
        ("Apple M1 Pro", "M1 Pro"),
        ("Apple M2 Ultra", "M2 Ultra"),
        ("Apple M3 Max", "M3 Max"),
        ("Apple M4 Pro", "M4 Pro"),
        ("AMD EPYC", None),
        ("Intel(R) Core(TM) i7-9750H CPU @ 2.60GHz", None),
    ],
)
def test_chip_family(brand, family):
    assert chip_family(brand) == family


def test_select_profile_auto_and_explicit(profiles):
    hw = mac("Apple M3 Max", 128)
    assert select_profile(None, hw, profiles=profiles) == "m3-max-96g"
    assert select_profile("m3-max-96g", hw, profiles=profiles) == "m3-max-96g"
    assert select_profile(generated_key(LINUX_BOX), LINUX_BOX, profiles=profiles) == generated_key(LINUX_BOX)


def test_select_profile_refuses_cross_hardware(profiles):
    with pytest.raises(HardwareMismatchError) as err:
        select_profile("m1-max-64g", LINUX_BOX, profiles=profiles)
    msg = str(err.value)
    assert "m1-max-64g" in msg and "Xeon" in msg and generated_key(LINUX_BOX) in msg and "--allow-cross-hw" in msg
    # a less specific profile of the same chip is still another profile
    with pytest.raises(HardwareMismatchError, match="more specific profile 'm3-max-96g'"):
        select_profile("m3-max-48g", mac("Apple M3 Max", 128), profiles=profiles)
    with pytest.raises(HardwareMismatchError, match="not a profile"):
        select_profile("no-such-profile", LINUX_BOX, profiles=profiles)
    assert select_profile("m1-max-64g", LINUX_BOX, allow_cross_hw=True, profiles=profiles) == "m1-max-64g"


def test_shipped_profiles_are_complete(profiles):
    keys = {p.key for p in profiles}
    for family in ("M1 Pro", "M1 Max", "M1 Ultra", "M2 Pro", "M2 Max", "M2 Ultra", "M3 Pro", "M4 Pro", "M4 Max"):
        assert any(re.search(p.soc_regex, f"Apple {family}") for p in profiles), family
    assert {"m3-max-48g", "m3-max-96g", "m1-max-64g"} <= keys
    for p in profiles:
        assert 0 < p.gating.max_regression <= 0.1 and p.gating.min_samples >= 2


# --------------------------------------------------------------------------------------
# YAML validation errors

GOOD_PROFILE = """\
  - key: m9-max-64g
    soc_regex: '^Apple M9 Max$'
    min_ram_gb: 64
"""


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "hw.yaml"
    path.write_text(text)
    return path


def test_minimal_yaml_loads_with_defaults(tmp_path):
    (profile,) = load_profiles(write(tmp_path, "version: 1\nprofiles:\n" + GOOD_PROFILE))
    assert profile.key == "m9-max-64g" and profile.gating.max_regression == 0.05 and profile.gating.min_samples == 20


def test_speed_targets_load_from_the_documented_example(tmp_path):
    """docs/macos.md's example: the bands, per shape, of a profile."""
    text = (REPO / "docs" / "macos.md").read_text().split("**Absolute bands per profile.**")[1]
    example = text.split("```yaml\n")[1].split("```")[0]
    (profile,) = load_profiles(write(tmp_path, "version: 1\n" + example))
    targets = profile.speed_targets
    assert targets is not None and targets.ttft_ms_p50_max == 500 and targets.drafter_ttft_ms_p50_max == 200
    assert [(t.length, t.ttft_ms_p50_max, t.tps_p50_min) for t in targets.shapes] == [(4096, 2000, 25)]


@pytest.mark.parametrize(
    ("text", "pattern"),
    [
        # duplicate profile key: names the line of the second key and the first
        (
            "profiles:\n" + GOOD_PROFILE + GOOD_PROFILE,
            r"hw\.yaml:5: profiles\[1\]\.key: duplicate profile key .*line 2",
        ),
        # duplicate YAML key inside one profile
        ("profiles:\n" + GOOD_PROFILE + "    min_ram_gb: 32\n", r"hw\.yaml:5: min_ram_gb: duplicate key .*line 4"),
        # invalid regex
        (
            "profiles:\n" + GOOD_PROFILE.replace("^Apple M9 Max$", "Apple (M9"),
            r"hw\.yaml:3: profiles\[0\]\.soc_regex: .*not a valid regular expression",
        ),
        # wrong type
        (
            "profiles:\n" + GOOD_PROFILE.replace("min_ram_gb: 64", "min_ram_gb: lots"),
            r"hw\.yaml:4: profiles\[0\]\.min_ram_gb",
        ),
        # unknown field (typo) inside a section
        (
            "profiles:\n" + GOOD_PROFILE + "    gating: {max_regresion: 0.05}\n",
            r"hw\.yaml:5: profiles\[0\]\.gating\.max_regresion",
        ),
        # impossible value
        (
            "profiles:\n" + GOOD_PROFILE + "    gating: {max_regression: 1.5}\n",
            r"hw\.yaml:5: profiles\[0\]\.gating.*max_regression must be in \(0, 1\)",
        ),
        # a section that was dropped (nothing read it) is an unknown key, not silently ignored
        ("profiles:\n" + GOOD_PROFILE + "    kv: {max_context: 2048}\n", r"hw\.yaml:5: profiles\[0\]\.kv"),
        # speed targets: a band of the wrong sign, a misspelt shape field
        ("profiles:\n" + GOOD_PROFILE + "    speed_targets: {tps_p50_min: -25}\n",
         r"hw\.yaml:5: profiles\[0\]\.speed_targets.*tps_p50_min must be > 0"),
        ("profiles:\n" + GOOD_PROFILE + "    speed_targets:\n      shapes:\n        - {length: 4096, tps_min: 25}\n",
         r"hw\.yaml:7: profiles\[0\]\.speed_targets\.shapes\[0\]\.tps_min: unknown key"),
        ("profiles:\n" + GOOD_PROFILE.replace("    min_ram_gb: 64\n", ""), r"missing required field\(s\): min_ram_gb"),
        ("profile:\n" + GOOD_PROFILE, r"hw\.yaml:1: profile: unknown key"),
        ("profiles: []\n", r"profiles: expected a non-empty list"),
        ("profiles:\n" + GOOD_PROFILE + "    gating: {min_samples: 1}\n", r"hw\.yaml:5: .*min_samples must be >= 2"),
        ("profiles:\n" + GOOD_PROFILE + "    speed_targets:\n      shapes:\n        - {length: 0}\n",
         r"hw\.yaml:6: profiles\[0\]\.speed_targets\.shapes\[0\]: length must be >= 1"),
        ("profiles:\n" + GOOD_PROFILE + "    speed_targets:\n      shapes: [{length: 512}, {length: 512}]\n",
         r"hw\.yaml:5: .*each length once"),
        ("profiles:\n" + GOOD_PROFILE.replace("m9-max-64g", "M9_Max"), r"hw\.yaml:2: .*key must be lowercase"),
        ("profiles:\n" + GOOD_PROFILE.replace("min_ram_gb: 64", "min_ram_gb: 0"),
         r"hw\.yaml:2: .*min_ram_gb must be > 0"),
        ("profiles: [unclosed\n", r"hw\.yaml: invalid YAML"),
        ("- a\n- b\n", r"hw\.yaml: <root>: expected a mapping with 'version' and 'profiles'"),
        ("version: 2\nprofiles:\n" + GOOD_PROFILE, r"hw\.yaml:1: version: expected 1, got 2"),
    ],
)
def test_yaml_validation_errors(tmp_path, text, pattern):
    with pytest.raises(ConfigError, match=pattern):
        load_profiles(write(tmp_path, text))


# --------------------------------------------------------------------------------------
# Detection on this machine


def test_detect_hardware_on_this_machine():
    hw = detect_hardware()
    assert hw.system == ("darwin" if sys.platform == "darwin" else hw.system)
    assert hw.soc and hw.machine and hw.os
    assert hw.cores >= 1
    assert 0.25 < hw.ram_gb < 16384
    key = profile_key(hw)
    if sys.platform.startswith("linux"):
        assert hw.system == "linux" and hw.os.startswith("Linux ")
        assert key == generated_key(hw) and key.startswith(f"linux-{hw.machine}-") and key.endswith(f"-{hw.cores}c")
    assert re.fullmatch(r"[a-z0-9_-]+", key)


def test_hardware_header_keys():
    header = hardware_header("coreml", "runs/x/export")
    assert set(header) == {"soc", "chip_family", "os", "ram_gb", "cores", "torch_version", "coremltools_version",
                           "export_path", "export_dir", "hardware_profile_key"}
    assert header["export_path"] == "pytorch_exportedprogram_coreml" and header["export_dir"] == "runs/x/export"
    assert header["chip_family"] == detect_hardware().chip_family
    assert hardware_header("torch")["export_path"] == "pytorch_eager" and hardware_header()["export_path"] is None
    assert header["hardware_profile_key"] == profile_key(detect_hardware())
    assert header["torch_version"].startswith("2.")
    assert hardware_header(profile_key="m1-max-64g")["hardware_profile_key"] == "m1-max-64g"
    with pytest.raises(ValueError, match="engine must be one of"):
        hardware_header("onnx")


def test_default_profiles_path_is_shipped():
    assert DEFAULT_PROFILES_PATH.is_file()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="VmHWM and ru_maxrss's inheritance are Linux's")
def test_a_worker_process_reports_its_own_memory_peak_not_its_parents():
    """The speed worker is started by a pipeline process that may hold many GiB (the Gemma 3 example's: 19 GiB).
    Linux's ``ru_maxrss`` keeps the parent's peak across fork and exec: with it, the worker reported 16.3 GiB."""
    ballast = b"\x01" * (768 * 2**20)  # touched pages, resident in this process
    assert peak_rss_bytes() >= len(ballast)
    child = "from distillgates.hardware import peak_rss_bytes; print(peak_rss_bytes())"
    out = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, check=True, timeout=120)
    assert int(out.stdout) < 256 * 2**20, (int(out.stdout), len(ballast))
