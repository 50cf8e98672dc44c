"""Atomic file writes and checksummed torch payloads.

Every baseline, cache, report and checkpoint goes through here: write to a temp file in the
same directory, fsync, then ``os.replace`` so a reader sees the old file or the new one,
never half of one.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch


class ChecksumError(ValueError):
    """A checksummed file does not match its recorded sha256 (corrupted or truncated)."""


def _umask() -> int:
    umask = os.umask(0)
    os.umask(umask)
    return umask


def _default_mode() -> int:
    """``0o666`` minus the process umask: what ``open(path, "w")`` would give (mkstemp gives 0o600)."""
    return 0o666 & ~_umask()


def staging_dir(target: str | Path, tag: str = "") -> Path:
    """A new empty directory beside ``target`` (same filesystem, so it can be renamed over it) with the mode
    ``mkdir`` would give: a directory swapped in keeps it (``mkdtemp`` alone gives 0o700)."""
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    path = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{target.name}.{tag}"))
    path.chmod(0o777 & ~_umask())
    return path


def swap_in_dir(staging: Path, out_dir: Path) -> None:
    """Replace ``out_dir`` by the complete ``staging`` folder (two renames; the old one is removed last)."""
    old = None
    if out_dir.exists():
        old = Path(tempfile.mkdtemp(dir=out_dir.parent, prefix=f".{out_dir.name}.old-"))
        out_dir.rename(old / out_dir.name)
    staging.rename(out_dir)
    if old is not None:
        shutil.rmtree(old)


def atomic_write_bytes(path: str | Path, data: bytes) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    mode = path.stat().st_mode & 0o777 if path.exists() else _default_mode()
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        os.fchmod(fd, mode)  # a replaced file keeps its mode; a new one gets the usual one
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def atomic_write_text(path: str | Path, text: str) -> None:
    atomic_write_bytes(path, text.encode())


def atomic_write_json(path: str | Path, obj: Any) -> None:
    atomic_write_text(path, json.dumps(obj, indent=2, sort_keys=True, default=str) + "\n")


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def sha256_file(path: str | Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def tree_sha256(path: str | Path) -> str:
    """Deterministic sha256 of a folder (an ``.mlpackage``): over every file in it, in sorted order, its
    path relative to ``path`` and its content's sha256. A plain file: its sha256."""
    root = Path(path)
    if root.is_file():
        return sha256_file(root)
    h = hashlib.sha256()
    for file in sorted(p for p in root.rglob("*") if p.is_file()):
        h.update(f"{file.relative_to(root).as_posix()}\0{sha256_file(file)}\n".encode())
    return h.hexdigest()


def save_checksummed(obj: Any, path: str | Path) -> str:
    """``torch.save`` atomically with a ``<path>.sha256`` sidecar; returns the digest.

    The payload is written first and the sidecar second, so a crash between them leaves a
    payload whose sidecar is stale: :func:`load_checksummed` then refuses it loudly.
    """
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    data = buffer.getvalue()
    digest = sha256_bytes(data)
    atomic_write_bytes(path, data)
    atomic_write_text(f"{path}.sha256", digest + "\n")
    return digest


def load_checksummed(path: str | Path, map_location: str = "cpu") -> Any:
    """Load a file written by :func:`save_checksummed`, verifying its sha256 first."""
    path = Path(path)
    sidecar = Path(f"{path}.sha256")
    if not path.exists():
        raise FileNotFoundError(f"{path}: checkpoint not found")
    if not sidecar.exists():
        raise ChecksumError(f"{path}: checksum file {sidecar.name} is missing")
    data = path.read_bytes()
    expected = sidecar.read_text().strip()
    actual = sha256_bytes(data)
    if actual != expected:
        raise ChecksumError(f"{path}: checksum mismatch (expected {expected[:12]}..., found {actual[:12]}...)")
    return torch.load(io.BytesIO(data), map_location=map_location, weights_only=False)
