"""Baseline store: lookup, cross-hardware and other-eval-set refusal, staged atomic blessing, unused report."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from distillgates.gates.baselines import (
    EVAL_SET_KEYS,
    BaselineEntry,
    BaselineError,
    BaselineStore,
    CrossHardwareBaseline,
    MissingBaseline,
    OtherEvalSetBaseline,
)

RUN = {key: f"{key}-1" for key in (*EVAL_SET_KEYS, "runner_fingerprint", "model_fingerprint")}  # the gated run's


def bless(root: Path, profile: str, group: str, key: str, value: float, hardware_dependent: bool = True) -> Path:
    store = BaselineStore(root, profile)
    store.stage(group, key, BaselineEntry(value, "test metric", [value] * 5, {"git_sha": "abc"}, RUN),
                hardware_dependent=hardware_dependent)
    return store.commit()[0]


def test_round_trip_and_layout(tmp_path):
    path = bless(tmp_path, "m1-max-64g", "speed", "ttft_ms.p50", 12.5)
    assert path == tmp_path / "m1-max-64g" / "speed.json"
    data = json.loads(path.read_text())
    assert data["hardware_profile_key"] == "m1-max-64g" and data["schema_version"] == 1
    entry = BaselineStore(tmp_path, "m1-max-64g").load("speed", "ttft_ms.p50", hardware_dependent=True,
                                                       run_fingerprints=RUN)
    assert entry.value == 12.5 and entry.samples == [12.5] * 5 and entry.provenance == {"git_sha": "abc"}
    assert entry.fingerprints == RUN and entry.path == path
    common = bless(tmp_path, "m1-max-64g", "f1_drift", "f1_lax_macro", 0.9, hardware_dependent=False)
    assert common == tmp_path / "common" / "f1_drift.json"
    assert json.loads(common.read_text())["hardware_profile_key"] is None


def test_missing_baseline_names_the_bless_command(tmp_path):
    with pytest.raises(MissingBaseline, match="bless it with: pytest x --bless"):
        BaselineStore(tmp_path, "p").load("quality", "k", hardware_dependent=False, run_fingerprints=RUN,
                                          bless_command="pytest x --bless")


def test_other_profile_is_refused_unless_allowed(tmp_path):
    bless(tmp_path, "m1-max-64g", "speed", "tps.p50", 100.0)
    store = BaselineStore(tmp_path, "m3-max-48g")
    with pytest.raises(CrossHardwareBaseline, match="only for: m1-max-64g"):
        store.load("speed", "tps.p50", hardware_dependent=True, run_fingerprints=RUN)
    entry = store.load("speed", "tps.p50", hardware_dependent=True, run_fingerprints=RUN, allow_cross_hw=True)
    assert entry.value == 100.0 and entry.hardware_profile_key == "m1-max-64g"


def test_copied_file_from_other_hardware_is_refused(tmp_path):
    path = bless(tmp_path, "m1-max-64g", "speed", "tps.p50", 100.0)
    (tmp_path / "m3-max-48g").mkdir()
    os.replace(path, tmp_path / "m3-max-48g" / "speed.json")
    with pytest.raises(CrossHardwareBaseline, match="measured on hardware profile 'm1-max-64g'"):
        BaselineStore(tmp_path, "m3-max-48g").load("speed", "tps.p50", hardware_dependent=True, run_fingerprints=RUN)


def test_commit_merges_and_unused_lists_untouched(tmp_path):
    bless(tmp_path, "p", "speed", "a", 1.0)
    bless(tmp_path, "p", "speed", "b", 2.0)
    store = BaselineStore(tmp_path, "p")
    store.load("speed", "a", hardware_dependent=True, run_fingerprints=RUN)
    assert store.unused() == [f"{tmp_path / 'p' / 'speed.json'}::b"]
    entries = json.loads((tmp_path / "p" / "speed.json").read_text())["entries"]
    assert sorted(entries) == ["a", "b"]


def test_staged_entries_are_not_written_before_commit(tmp_path):
    path = bless(tmp_path, "p", "speed", "a", 1.0)
    before = path.read_bytes()
    store = BaselineStore(tmp_path, "p")
    store.stage("speed", "a", BaselineEntry(9.0, "d"), hardware_dependent=True)
    assert path.read_bytes() == before  # an interrupted bless (no commit) leaves the old file


def test_crash_during_commit_leaves_old_file_whole(tmp_path, monkeypatch):
    path = bless(tmp_path, "p", "speed", "a", 1.0)
    before = path.read_bytes()
    store = BaselineStore(tmp_path, "p")
    store.stage("speed", "a", BaselineEntry(9.0, "d"), hardware_dependent=True)

    def crash(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(os, "replace", crash)
    with pytest.raises(KeyboardInterrupt):
        store.commit()
    assert path.read_bytes() == before
    assert [p.name for p in path.parent.iterdir()] == ["speed.json"]  # no temp file left behind


@pytest.mark.parametrize(
    ("text", "message"),
    [("{not json", "invalid JSON"), ('{"schema_version": 1}', "entries"),
     ('{"schema_version": 2, "entries": {}}', "schema_version"),
     ('{"schema_version": 1, "entries": {"a": {"value": 1}}}', "entries.a"),
     ('{"schema_version": 1, "entries": {"a": {"value": 1, "definition": "d", "fingerprints": "x"}}}',
      "entries.a.fingerprints must be a mapping")],
)
def test_corrupt_file_names_the_problem(tmp_path, text, message):
    (tmp_path / "common").mkdir()
    (tmp_path / "common" / "g.json").write_text(text)
    with pytest.raises(BaselineError, match=message):
        BaselineStore(tmp_path, "p").load("g", "a", hardware_dependent=False, run_fingerprints=RUN)


@pytest.mark.parametrize("key", EVAL_SET_KEYS)
def test_baseline_of_another_eval_set_is_refused_unless_allowed(tmp_path, key):
    bless(tmp_path, "p", "f1_drift", "f1", 0.9, hardware_dependent=False)
    store = BaselineStore(tmp_path, "p")
    run = {**RUN, key: "other"}
    with pytest.raises(OtherEvalSetBaseline, match=rf"{key}: baseline '{key}-1', run 'other'.*--allow-other-eval-set"):
        store.load("f1_drift", "f1", hardware_dependent=False, run_fingerprints=run)
    with pytest.raises(OtherEvalSetBaseline, match=rf"{key}: baseline '{key}-1', run None"):
        store.load("f1_drift", "f1", hardware_dependent=False, run_fingerprints=None)
    entry = store.load("f1_drift", "f1", hardware_dependent=False, run_fingerprints=run, allow_other_eval_set=True)
    assert entry.value == 0.9


def test_another_model_or_runner_is_not_another_eval_set(tmp_path):
    bless(tmp_path, "p", "f1_drift", "f1", 0.9, hardware_dependent=False)
    run = {**RUN, "model_fingerprint": "retrained", "runner_fingerprint": "new scorer"}
    entry = BaselineStore(tmp_path, "p").load("f1_drift", "f1", hardware_dependent=False, run_fingerprints=run)
    assert entry.value == 0.9


def test_entry_without_fingerprints_is_refused_even_when_allowed(tmp_path):
    store = BaselineStore(tmp_path, "p")
    store.stage("f1_drift", "f1", BaselineEntry(0.9, "d"), hardware_dependent=False)  # as blessed before they were kept
    store.commit()
    with pytest.raises(OtherEvalSetBaseline, match=r"records no fingerprints.*re-bless it: pytest x --bless"):
        store.load("f1_drift", "f1", hardware_dependent=False, run_fingerprints=RUN, allow_other_eval_set=True,
                   bless_command="pytest x --bless")
