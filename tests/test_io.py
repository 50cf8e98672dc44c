"""Atomic writes: the old file or the new one, never half of one; the usual file modes."""

from __future__ import annotations

import os
import stat

import pytest

from distillgates.io import atomic_write_bytes, atomic_write_json


def _mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def test_new_file_gets_the_umask_mode_and_a_replaced_file_keeps_its_own(tmp_path):
    old = os.umask(0o022)
    try:
        atomic_write_json(tmp_path / "a.json", {"x": 1})
        assert _mode(tmp_path / "a.json") == 0o644  # not mkstemp's 0o600: baselines are committed and shared
        os.chmod(tmp_path / "a.json", 0o640)
        atomic_write_json(tmp_path / "a.json", {"x": 2})
        assert _mode(tmp_path / "a.json") == 0o640
    finally:
        os.umask(old)


def test_a_failed_write_leaves_the_old_file_and_no_temp_file(tmp_path, monkeypatch):
    path = tmp_path / "b.bin"
    atomic_write_bytes(path, b"old")

    def boom(src, dst):
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", boom)
    with pytest.raises(OSError, match="disk full"):
        atomic_write_bytes(path, b"new")
    assert path.read_bytes() == b"old" and sorted(p.name for p in tmp_path.iterdir()) == ["b.bin"]
