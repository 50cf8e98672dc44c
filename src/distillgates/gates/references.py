"""Re-runnable speed references: content-addressed artifacts and the code identity they were blessed with.

A speed bless records *what* was measured (the student checkpoint; on macOS the Core ML export)
and *which code* measured it (the git commit of the ``distillgates`` source), so that a later
session can run the blessed code on the blessed artifacts next to the candidate (interleaved
A/B, :mod:`distillgates.gates.speed_ab`). Design choices:

- :class:`ReferenceStore` owns a location: a local folder or an fsspec URL (``s3://bucket/refs``,
  ``gs://...``, ``memory://...``), so that model files can live outside git while the baselines
  record only their digests. Where it is: ``--reference-store``, else ``DISTILLGATES_REFERENCE_STORE``,
  else the project's ``references`` setting, else ``references/`` in the baselines folder (see
  :meth:`distillgates.gates.session.GateSession.reference_store`); never inside a run dir, which a
  rebuild overwrites. Files are stored once under their sha256 (``objects/<sha256>``); a directory
  (an ``.mlpackage`` export) becomes a deterministic tar first. Writes are atomic (a URL: a
  temporary object, then a rename); reads verify the hash of the bytes that will be measured, so an
  edited or truncated object is refused, never measured. An artifact of
  :data:`LARGE_ARTIFACT_BYTES` or more stored inside a git work tree (not ignored) warns, naming
  the file and its size: every clone would carry it.
- The code identity is ``git rev-parse HEAD`` of the checkout ``distillgates`` is imported
  from. A package tree with uncommitted changes is not refused: its changes against HEAD
  (``git diff --binary`` plus untracked files, under ``src/distillgates`` only) are stored as a
  content-addressed patch that :func:`checkout_code` applies on top of the commit.
- :func:`checkout_code` extracts the blessed package with ``git archive`` (no worktree is
  registered in the repository) into a folder the caller owns.
- An installed package (a wheel in a project's virtualenv: not tracked by any git repository) is
  identified by its version and a sha256 of its source files. Its code is re-runnable only while
  that same code is installed: the reference arm then imports the installed package; after an
  upgrade the gate fails naming both versions (install the blessed one, or re-bless).
"""

from __future__ import annotations

import io
import os
import shutil
import subprocess
import tarfile
import tempfile
import uuid
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import distillgates
from distillgates.io import atomic_write_bytes, sha256_bytes, sha256_file

PACKAGE_DIR = Path(distillgates.__file__).resolve().parent  # .../src/distillgates
LARGE_ARTIFACT_BYTES = 50 * 2**20  # GitHub warns at 50 MiB per file (and refuses 100 MiB)


class StaleReference(AssertionError):
    """A blessed speed reference cannot be re-run (artifact missing or changed, commit unknown)."""


class LargeArtifactWarning(UserWarning):
    """A large reference artifact was stored inside a git work tree."""


def is_url(location: str | Path) -> bool:
    """Whether ``location`` is an fsspec URL (``protocol://...``) rather than a local path."""
    return "://" in str(location)


def _git(repo: Path, *args: str, check: bool = True) -> subprocess.CompletedProcess[bytes]:
    result = subprocess.run(["git", "-C", str(repo), *args], capture_output=True, timeout=120)
    if check and result.returncode != 0:
        raise StaleReference(f"git {' '.join(args)} in {repo} failed: {result.stderr.decode(errors='replace').strip()}")
    return result


def _tree_archive(folder: Path, out: Path) -> None:
    """A deterministic tar of ``folder`` (sorted names, no owners or times) written to ``out``: equal trees, equal
    bytes."""
    with tarfile.open(out, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for path in sorted([folder, *folder.rglob("*")]):
            info = tar.gettarinfo(str(path), arcname=str(Path(folder.name) / path.relative_to(folder)))
            info.uid = info.gid = 0
            info.uname = info.gname = ""
            info.mtime = 0
            if path.is_file():
                with path.open("rb") as f:
                    tar.addfile(info, f)
            else:
                tar.addfile(info)


def warn_if_large_in_repo(path: Path, name: str) -> None:
    """Warn (:class:`LargeArtifactWarning`) when ``path`` is at least :data:`LARGE_ARTIFACT_BYTES` and lies in a git
    work tree, not ignored: committed, every clone of the repository would carry it."""
    size = path.stat().st_size
    if size < LARGE_ARTIFACT_BYTES:
        return
    inside = _git(path.parent, "rev-parse", "--show-toplevel", check=False)
    if inside.returncode != 0 or _git(path.parent, "check-ignore", "-q", str(path), check=False).returncode == 0:
        return
    warnings.warn(LargeArtifactWarning(
        f"{path}: speed reference artifact {name!r} is {size / 2**20:.0f} MiB inside the git work tree "
        f"{inside.stdout.decode().strip()} (over {LARGE_ARTIFACT_BYTES // 2**20} MiB): committed, every clone carries "
        "it. Keep the reference store outside git (the baselines keep only its digest): `references: <folder or "
        "fsspec URL>` in distillgates.yaml, --reference-store or DISTILLGATES_REFERENCE_STORE; see docs/gates.md "
        "'Where the speed references live'"), stacklevel=2)


class ReferenceStore:
    """Content-addressed objects under ``<location>/objects/<sha256>``; ``location`` a folder or an fsspec URL."""

    def __init__(self, location: str | Path) -> None:
        self.location = str(location)
        self.root = Path(location) if not is_url(location) else None  # a local folder
        if self.root is None:
            import fsspec

            self.fs, self._base = fsspec.core.url_to_fs(self.location)

    def object_path(self, sha256: str) -> Path:
        """The object's file in a local store."""
        assert self.root is not None, "a URL store has no local object path"
        return self.root / "objects" / sha256

    def _url(self, sha256: str) -> str:
        """The object's path on the store's filesystem (a URL store)."""
        return f"{self._base.rstrip('/')}/objects/{sha256}"

    def _where(self, sha256: str) -> str:
        """The object's location in messages."""
        if self.root is not None:
            return str(self.object_path(sha256))
        return f"{self.location.rstrip('/')}/objects/{sha256}"

    def _store_file(self, source: Path, sha: str) -> None:
        """Copy ``source`` (content ``sha``) in as ``objects/<sha>`` unless it is there, atomically."""
        if self.root is not None:
            target = self.object_path(sha)
            if not target.is_file():
                target.parent.mkdir(parents=True, exist_ok=True)
                tmp = target.with_name(f".{sha}.{uuid.uuid4().hex}.tmp")  # created with the umask's mode
                try:
                    shutil.copyfile(source, tmp)
                    os.replace(tmp, target)
                finally:
                    tmp.unlink(missing_ok=True)
            warn_if_large_in_repo(target, source.name)
        elif not self.fs.exists(self._url(sha)):
            remote_tmp = f"{self._url(sha)}.{uuid.uuid4().hex}.tmp"
            self.fs.makedirs(remote_tmp.rsplit("/", 1)[0], exist_ok=True)
            self.fs.put_file(str(source), remote_tmp)
            self.fs.mv(remote_tmp, self._url(sha))

    def put_bytes(self, data: bytes) -> str:
        sha = sha256_bytes(data)
        if self.root is not None:
            if not self.object_path(sha).is_file():
                atomic_write_bytes(self.object_path(sha), data)
        elif not self.fs.exists(self._url(sha)):
            tmp = f"{self._url(sha)}.{uuid.uuid4().hex}.tmp"
            self.fs.makedirs(tmp.rsplit("/", 1)[0], exist_ok=True)
            self.fs.pipe_file(tmp, data)
            self.fs.mv(tmp, self._url(sha))
        return sha

    def put(self, path: Path) -> dict[str, Any]:
        """Store a file, or a directory as a deterministic tar; ``{"sha256", "name", "kind"}`` (read in chunks: a
        checkpoint is never held in memory whole)."""
        if path.is_dir():
            with tempfile.TemporaryDirectory() as folder:
                archive = Path(folder) / f"{path.name}.tar"
                _tree_archive(path, archive)
                sha = sha256_file(archive)
                self._store_file(archive, sha)
            return {"sha256": sha, "name": path.name, "kind": "tree"}
        sha = sha256_file(path)
        self._store_file(path, sha)
        return {"sha256": sha, "name": path.name, "kind": "file"}

    def _fetch(self, sha: str, into: Path, name: str, rebless: str) -> Path:
        """The object's bytes on this machine (a local store: in place; a URL: downloaded under ``into``)."""
        if self.root is not None:
            path = self.object_path(sha)
            if not path.is_file():
                raise StaleReference(f"blessed speed reference artifact {name!r} is missing: no {path} (was the "
                                     f"reference store {self.root} committed / fetched?); re-bless: {rebless}")
            return path
        if not self.fs.exists(self._url(sha)):
            raise StaleReference(f"blessed speed reference artifact {name!r} is missing: no {self._where(sha)} in "
                                 f"the reference store {self.location}; re-bless: {rebless}")
        local = into / ".objects" / sha
        local.parent.mkdir(parents=True, exist_ok=True)
        self.fs.get_file(self._url(sha), str(local))
        return local

    def get(self, artifact: dict[str, Any], into: Path, rebless: str) -> Path:
        """The stored ``artifact`` (as recorded by :meth:`put`), fetched by its digest and hash verified, under
        ``into``: a file as a link named as it was (with its ``.sha256`` sidecar), a tree extracted.

        Raises:
            StaleReference: the object is missing or its content is not its digest (names ``rebless``).
        """
        sha = str(artifact.get("sha256"))
        path = self._fetch(sha, into, str(artifact.get("name")), rebless)
        found = sha256_file(path)
        if found != sha:
            raise StaleReference(f"blessed speed reference artifact {self._where(sha)} has changed: sha256 {found}, "
                                 f"blessed {sha}; re-bless: {rebless}")
        into.mkdir(parents=True, exist_ok=True)
        if artifact.get("kind") == "tree":
            with tarfile.open(path) as tar:
                tar.extractall(into, filter="data")
            return into / str(artifact["name"])
        # the file under its own name, with the sha256 sidecar that checkpoint loading verifies (distillgates.io)
        named = into / str(artifact["name"])
        named.unlink(missing_ok=True)
        named.symlink_to(path.resolve())
        Path(f"{named}.sha256").write_text(sha + "\n")
        return named


@dataclass(frozen=True)
class CodeIdentity:
    """The code a speed reference was measured with: a commit, plus a patch object for uncommitted changes."""

    commit: str | None  # None: not a git checkout (an installed package: see ``installed``)
    patch_sha256: str | None = None
    package: str = "src/distillgates"  # the package's path inside the repository
    installed: dict[str, str] | None = None  # {"version", "sha256"} of an installed (untracked) package

    def to_json(self) -> dict[str, Any]:
        record: dict[str, Any] = {"commit": self.commit, "patch_sha256": self.patch_sha256, "package": self.package}
        if self.installed:
            record["installed"] = self.installed
        return record


def installed_identity(package_dir: Path = PACKAGE_DIR) -> dict[str, str]:
    """Version and content digest (every ``.py`` file, by relative path) of the package in ``package_dir``."""
    digest = "".join(f"{path.relative_to(package_dir).as_posix()}:{sha256_file(path)}\n"
                     for path in sorted(package_dir.rglob("*.py")))
    return {"version": distillgates.__version__, "sha256": sha256_bytes(digest.encode())}


def code_identity(store: ReferenceStore, package_dir: Path = PACKAGE_DIR) -> CodeIdentity:
    """The identity of the code in ``package_dir``; uncommitted changes are stored as a patch in ``store``."""
    inside = _git(package_dir, "rev-parse", "--show-toplevel", check=False)
    # a virtualenv inside a project's repository is in its work tree but untracked (ignored): an installed package
    if inside.returncode != 0 or _git(package_dir, "ls-files", "--error-unmatch", "__init__.py",
                                      check=False).returncode != 0:
        return CodeIdentity(None, installed=installed_identity(package_dir))
    repo = Path(inside.stdout.decode().strip())
    package = package_dir.resolve().relative_to(repo.resolve()).as_posix()
    commit = _git(repo, "rev-parse", "HEAD").stdout.decode().strip()
    patch = _git(repo, "diff", "--binary", "HEAD", "--", package).stdout
    untracked = _git(repo, "ls-files", "--others", "--exclude-standard", "-z", "--", package).stdout
    for name in filter(None, untracked.decode().split("\0")):
        # --no-index exits 1 when the files differ (always, against /dev/null)
        patch += _git(repo, "diff", "--binary", "--no-index", "--", "/dev/null", name, check=False).stdout
    return CodeIdentity(commit, store.put_bytes(patch) if patch else None, package)


def checkout_code(identity: dict[str, Any], store: ReferenceStore, into: Path, rebless: str,
                  repo_dir: Path = PACKAGE_DIR) -> Path:
    """Extract the blessed ``distillgates`` (commit + patch) under ``into``; the ``src`` folder to import from.

    Raises:
        StaleReference: no commit recorded, the commit is not in this repository (a shallow clone:
            fetch with full history), or the patch is missing or does not apply.
    """
    commit, package = identity.get("commit"), str(identity.get("package") or "src/distillgates")
    if not commit and identity.get("installed"):
        blessed, current = identity["installed"], installed_identity(repo_dir)
        if blessed != current:
            raise StaleReference(f"the speed reference was blessed with distillgates {blessed.get('version')} (source "
                                 f"sha256 {str(blessed.get('sha256'))[:12]}), installed is {current['version']} "
                                 f"(sha256 {current['sha256'][:12]}): install the blessed version, or re-bless: "
                                 f"{rebless}")
        return repo_dir.parent  # the same code is installed: the reference arm imports it
    if not commit:
        raise StaleReference("the speed reference records no git commit and no installed package, so its "
                             f"code cannot be re-run; re-bless: {rebless}")
    inside = _git(repo_dir, "rev-parse", "--show-toplevel", check=False)
    if inside.returncode != 0:
        raise StaleReference(f"cannot re-run the blessed code (commit {commit}): distillgates is not imported from a "
                             f"git checkout ({repo_dir}); run from one, or re-bless: {rebless}")
    repo = Path(inside.stdout.decode().strip())
    if _git(repo, "cat-file", "-e", f"{commit}^{{commit}}", check=False).returncode != 0:
        raise StaleReference(f"the blessed commit {commit} is not in {repo} (a shallow clone? fetch the full history, "
                             f"e.g. actions/checkout with fetch-depth: 0); or re-bless: {rebless}")
    into.mkdir(parents=True, exist_ok=True)
    archive = _git(repo, "archive", "--format=tar", commit, "--", package).stdout
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        tar.extractall(into, filter="data")
    patch_sha = identity.get("patch_sha256")
    if patch_sha:
        patch = store.get({"sha256": patch_sha, "name": "code patch", "kind": "file"}, into, rebless)
        # GIT_CEILING_DIRECTORIES: apply to the extracted tree even if ``into`` lies inside some repository
        applied = subprocess.run(["git", "apply", "--binary", str(patch.resolve())], cwd=into, capture_output=True,
                                 env={**os.environ, "GIT_CEILING_DIRECTORIES": str(into.resolve().parent)})
        if applied.returncode != 0:
            raise StaleReference(f"the blessed code patch {patch} does not apply to commit {commit}: "
                                 f"{applied.stderr.decode(errors='replace').strip()}; re-bless: {rebless}")
    source = into / Path(package).parent
    if not (source / "distillgates" / "__init__.py").is_file():
        raise StaleReference(f"commit {commit} has no {package}/__init__.py; re-bless: {rebless}")
    return source
