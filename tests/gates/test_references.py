"""Reference store (content-addressed artifacts) and the blessed code's identity and checkout."""

from __future__ import annotations

import subprocess
import warnings
from pathlib import Path

import pytest

from distillgates.gates import references
from distillgates.gates.references import (
    LargeArtifactWarning,
    ReferenceStore,
    StaleReference,
    checkout_code,
    code_identity,
)
from distillgates.io import sha256_bytes

REBLESS = "pytest gates/test_speed.py --bless -m speed"


def test_a_file_comes_back_under_its_name_with_its_checksum_sidecar(tmp_path):
    store = ReferenceStore(tmp_path / "store")
    (tmp_path / "model.pt").write_bytes(b"weights")
    artifact = store.put(tmp_path / "model.pt")
    assert artifact["kind"] == "file" and store.put(tmp_path / "model.pt") == artifact  # stored once
    path = store.get(artifact, tmp_path / "out", REBLESS)
    assert path.name == "model.pt" and path.read_bytes() == b"weights"
    assert Path(f"{path}.sha256").read_text().strip() == artifact["sha256"]


def test_a_missing_or_changed_object_is_refused_with_the_rebless_command(tmp_path):
    store = ReferenceStore(tmp_path / "store")
    (tmp_path / "model.pt").write_bytes(b"weights")
    artifact = store.put(tmp_path / "model.pt")
    store.object_path(artifact["sha256"]).write_bytes(b"retrained")
    with pytest.raises(StaleReference, match=rf"has changed: sha256 .* re-bless: {REBLESS}"):
        store.get(artifact, tmp_path / "out", REBLESS)
    store.object_path(artifact["sha256"]).unlink()
    with pytest.raises(StaleReference, match=rf"'model.pt' is missing.*re-bless: {REBLESS}"):
        store.get(artifact, tmp_path / "out", REBLESS)


def test_a_tree_is_stored_deterministically_and_extracted(tmp_path):
    tree = tmp_path / "export"
    (tree / "decode.mlpackage").mkdir(parents=True)
    (tree / "decode.mlpackage" / "weights.bin").write_bytes(b"\x00\x01")
    (tree / "contract.json").write_text("{}")
    store = ReferenceStore(tmp_path / "store")
    artifact = store.put(tree)
    (tree / "contract.json").touch()  # a new mtime: same content, same object
    assert store.put(tree) == artifact and artifact["kind"] == "tree"
    out = store.get(artifact, tmp_path / "out", REBLESS)
    assert (out / "decode.mlpackage" / "weights.bin").read_bytes() == b"\x00\x01"
    assert (out / "contract.json").read_text() == "{}"


def git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True, text=True).stdout


@pytest.fixture
def repo(tmp_path):
    root = tmp_path / "repo"
    package = root / "src" / "distillgates"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "engine.py").write_text("SPEED = 1\n")
    git(root, "init", "-q")
    git(root, "add", "-A")
    git(root, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "code")
    return root


def test_a_clean_tree_is_its_commit_and_checks_out_as_it(repo, tmp_path):
    store = ReferenceStore(tmp_path / "store")
    identity = code_identity(store, repo / "src" / "distillgates")
    assert identity.commit == git(repo, "rev-parse", "HEAD").strip() and identity.patch_sha256 is None
    (repo / "src" / "distillgates" / "engine.py").write_text("SPEED = 2\n")  # later work does not leak in
    source = checkout_code(identity.to_json(), store, tmp_path / "code", REBLESS, repo / "src" / "distillgates")
    assert (source / "distillgates" / "engine.py").read_text() == "SPEED = 1\n"


def test_uncommitted_and_untracked_changes_are_stored_as_a_patch_and_reapplied(repo, tmp_path):
    store = ReferenceStore(tmp_path / "store")
    package = repo / "src" / "distillgates"
    (package / "engine.py").write_text("SPEED = 2\n")
    (package / "worker.py").write_text("NEW = True\n")
    identity = code_identity(store, package)
    assert identity.patch_sha256 is not None
    source = checkout_code(identity.to_json(), store, tmp_path / "code", REBLESS, package)
    assert (source / "distillgates" / "engine.py").read_text() == "SPEED = 2\n"
    assert (source / "distillgates" / "worker.py").read_text() == "NEW = True\n"


def test_an_unknown_commit_or_none_is_refused_with_the_rebless_command(repo, tmp_path):
    store = ReferenceStore(tmp_path / "store")
    package = repo / "src" / "distillgates"
    with pytest.raises(StaleReference, match=rf"blessed commit 0{{40}} is not in .*fetch-depth: 0.*{REBLESS}"):
        checkout_code({"commit": "0" * 40}, store, tmp_path / "code", REBLESS, package)
    with pytest.raises(StaleReference, match="records no git commit"):
        checkout_code({"commit": None}, store, tmp_path / "code", REBLESS, package)


def test_an_installed_package_is_its_version_and_source_digest(tmp_path):
    """A wheel in a project's virtualenv (inside the project's repository, ignored): re-runnable while the same code
    is installed, refused with both versions after an upgrade."""
    project = tmp_path / "project"
    package = project / ".venv" / "site-packages" / "distillgates"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "engine.py").write_text("SPEED = 1\n")
    (project / ".gitignore").write_text(".venv/\n")
    git(project, "init", "-q")
    git(project, "add", "-A")
    git(project, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "project")
    store = ReferenceStore(tmp_path / "store")
    identity = code_identity(store, package)
    assert identity.commit is None and identity.installed is not None  # the project's commit is not the code's
    assert checkout_code(identity.to_json(), store, tmp_path / "code", REBLESS, package) == package.parent
    (package / "engine.py").write_text("SPEED = 2\n")  # another distillgates installed
    with pytest.raises(StaleReference, match=rf"blessed with distillgates .* installed is .*install the blessed "
                                             rf"version, or re-bless: {REBLESS}"):
        checkout_code(identity.to_json(), store, tmp_path / "code", REBLESS, package)


def test_a_url_store_keeps_objects_by_digest_and_refuses_a_changed_one(tmp_path):
    """An fsspec URL (memory:// here; s3://, gs://, ... alike): put, fetched back by digest, verified."""
    import fsspec

    store = ReferenceStore("memory://refs-test")
    (tmp_path / "model.pt").write_bytes(b"weights")
    artifact = store.put(tmp_path / "model.pt")
    tree = tmp_path / "export"
    (tree / "decode.mlpackage").mkdir(parents=True)
    (tree / "decode.mlpackage" / "weights.bin").write_bytes(b"\x00\x01")
    packaged = store.put(tree)
    assert store.put_bytes(b"patch") == sha256_bytes(b"patch")
    path = store.get(artifact, tmp_path / "out", REBLESS)
    assert path.name == "model.pt" and path.read_bytes() == b"weights"
    assert Path(f"{path}.sha256").read_text().strip() == artifact["sha256"]
    assert (store.get(packaged, tmp_path / "out", REBLESS) / "decode.mlpackage" / "weights.bin").read_bytes() == \
        b"\x00\x01"
    fsspec.filesystem("memory").pipe_file(f"/refs-test/objects/{artifact['sha256']}", b"retrained")
    with pytest.raises(StaleReference, match=rf"memory://refs-test/objects/{artifact['sha256']} has changed: "
                                             rf"sha256 {sha256_bytes(b'retrained')}, blessed {artifact['sha256']}"):
        store.get(artifact, tmp_path / "again", REBLESS)
    fsspec.filesystem("memory").rm(f"/refs-test/objects/{artifact['sha256']}")
    with pytest.raises(StaleReference, match=r"'model.pt' is missing: no memory://refs-test/objects/.* re-bless"):
        store.get(artifact, tmp_path / "again", REBLESS)


def test_a_large_artifact_in_the_git_work_tree_warns_naming_file_and_size(repo, tmp_path, monkeypatch):
    monkeypatch.setattr(references, "LARGE_ARTIFACT_BYTES", 2**20)  # 1 MiB stands for 50 MiB
    (tmp_path / "model.pt").write_bytes(b"\x01" * (3 * 2**20))
    in_repo = ReferenceStore(repo / "baselines" / "references")
    with pytest.warns(LargeArtifactWarning, match=r"baselines/references/objects/[0-9a-f]{64}: speed reference "
                                                  r"artifact 'model.pt' is 3 MiB inside the git work tree .*repo"):
        artifact = in_repo.put(tmp_path / "model.pt")
    (tmp_path / "small.pt").write_bytes(b"\x01" * 1000)
    (repo / ".gitignore").write_text("cache/\n")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # none of these warns
        in_repo.put(tmp_path / "small.pt")  # small
        ReferenceStore(repo / "cache" / "references").put(tmp_path / "model.pt")  # ignored by git
        ReferenceStore(tmp_path / "outside").put(tmp_path / "model.pt")  # no repository
    assert in_repo.get(artifact, tmp_path / "out", REBLESS).read_bytes() == b"\x01" * (3 * 2**20)


def test_the_store_location_is_the_option_else_the_environment_else_the_project_else_the_baselines(
        tmp_path, monkeypatch):
    from distillgates.gates.session import REFERENCE_STORE_ENV, GateOptions, GateSession
    from distillgates.project import Project

    monkeypatch.delenv(REFERENCE_STORE_ENV, raising=False)
    (tmp_path / "distillgates.yaml").write_text("baselines: blessed\n")
    assert GateSession(GateOptions(), Project.load(tmp_path)).reference_store() == str(
        tmp_path / "blessed" / "references")
    (tmp_path / "distillgates.yaml").write_text("baselines: blessed\nreferences: ../refs\n")
    assert GateSession(GateOptions(), Project.load(tmp_path)).reference_store() == str(tmp_path / "../refs")
    monkeypatch.setenv(REFERENCE_STORE_ENV, "s3://bucket/refs")
    assert GateSession(GateOptions(), Project.load(tmp_path)).reference_store() == "s3://bucket/refs"
    options = GateOptions(reference_store="/abs/refs")
    assert GateSession(options, Project.load(tmp_path)).reference_store() == "/abs/refs"
