"""Fingerprints that tie a report to exactly what produced it.

Every report carries six: the eval set, the tool registry, the tokenizer, the prompt
wrapper, the runner (kind + decoding settings + eval code version) and the model. A gate that
compares two reports (sharded vs unsharded, student vs baseline) is only meaningful when these
match, so a missing or null one is a hard error on write and on read, never a silent pass.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from distillgates.codeversion import modules_code
from distillgates.config import sha256_json
from distillgates.io import sha256_file

FINGERPRINT_KEYS = (
    "dataset_sha256",
    "tool_registry_sha256",
    "tokenizer_fingerprint",
    "prompt_wrapper_sha256",
    "runner_fingerprint",
    "model_fingerprint",
)


class FingerprintError(ValueError):
    """A fingerprint is missing, null or empty."""


def items_sha256(items: Iterable[Mapping[str, Any]]) -> str:
    """sha256 of the eval items in id order (independent of file layout, shard and order)."""
    ordered = sorted(items, key=lambda item: str(item["id"]))
    return sha256_json(ordered)


def runner_fingerprint(kind: str, decoding: Mapping[str, Any]) -> str:
    """sha256 of runner kind, decoding settings and the code of the runner loop and the scorer (what makes
    and what scores the outputs; :func:`distillgates.codeversion.modules_code`, docstrings aside)."""
    code = modules_code("distillgates.eval.runners", "distillgates.eval.scorer")
    return sha256_json({"kind": kind, "decoding": dict(decoding), "code": code})


def directory_fingerprint(path: str | Path, patterns: tuple[str, ...] = ("*.safetensors", "*.bin", "*.json")) -> str:
    """sha256 over the weight/config files of a model directory (name + content, sorted)."""
    path = Path(path)
    h = hashlib.sha256()
    files = sorted({p for pattern in patterns for p in path.glob(pattern) if p.is_file()})
    if not files:
        raise FingerprintError(f"{path}: no model files ({', '.join(patterns)}) to fingerprint")
    for file in files:
        h.update(file.name.encode())
        h.update(sha256_file(file).encode())
    return h.hexdigest()


def check_fingerprints(fingerprints: Mapping[str, Any] | None, where: str) -> dict[str, str]:
    """Return the six fingerprints, or raise naming ``where`` and every missing/null key."""
    if not isinstance(fingerprints, Mapping):
        raise FingerprintError(f"{where}: fingerprints missing (expected a mapping with {', '.join(FINGERPRINT_KEYS)})")
    bad = [k for k in FINGERPRINT_KEYS if not isinstance(fingerprints.get(k), str) or not fingerprints.get(k)]
    if bad:
        found = {k: fingerprints.get(k) for k in bad}
        raise FingerprintError(f"{where}: null or missing fingerprint(s) {', '.join(bad)} (found {found})")
    return {k: str(fingerprints[k]) for k in FINGERPRINT_KEYS}
