"""SHA-256 keyed response cache for teacher turns.

Key = sha256(canonical JSON of ``{"model": model_id, "request": payload, "student_tokenizer":
fingerprint}``), so a different model, prompt or sampling setting never hits, nor a student
tokenizer or chat format the cached turn was not written for (its ids and text are the student's).
One JSON file per entry under ``<dir>/ab/<key>.json``, written atomically (:mod:`distillgates.io`);
the directory carries a ``VERSION`` file and a cache from another layout version is refused rather
than silently misread. Entries hold the parsed :class:`TurnResult` only: requests carry no
credentials, so neither does the cache.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from distillgates.config import sha256_json
from distillgates.io import atomic_write_json, atomic_write_text
from distillgates.teacher.base import TurnResult

CACHE_VERSION = 1


class CacheError(ValueError):
    """The cache directory or one of its entries is unusable."""


def cache_key(model_id: str, payload: dict[str, Any], student_tokenizer: str) -> str:
    return sha256_json({"model": model_id, "request": payload, "student_tokenizer": student_tokenizer})


class ResponseCache:
    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)
        version_file = self.root / "VERSION"
        if version_file.exists():
            found = version_file.read_text().strip()
            if found != str(CACHE_VERSION):
                raise CacheError(
                    f"{version_file}: cache version {found!r}, this code reads version {CACHE_VERSION}; "
                    f"use a fresh cache directory or delete {self.root}"
                )
        else:
            atomic_write_text(version_file, f"{CACHE_VERSION}\n")
        self.hits = 0
        self.misses = 0

    def _path(self, key: str) -> Path:
        return self.root / key[:2] / f"{key}.json"

    def get(self, key: str) -> TurnResult | None:
        path = self._path(key)
        if not path.exists():
            self.misses += 1
            return None
        try:
            entry = json.loads(path.read_text())
            if entry.get("version") != CACHE_VERSION or entry.get("key") != key:
                raise CacheError(f"{path}: entry version/key mismatch")
            result = TurnResult.from_dict(entry["result"])
        except (json.JSONDecodeError, KeyError, TypeError) as err:
            raise CacheError(f"{path}: unreadable cache entry ({type(err).__name__}: {err}); delete it") from err
        self.hits += 1
        return result

    def put(self, key: str, result: TurnResult) -> None:
        atomic_write_json(self._path(key), {"version": CACHE_VERSION, "key": key, "result": result.to_dict()})
