"""Every fingerprint a dataset header or report carries, importable from one place."""

from __future__ import annotations

from pathlib import Path

from distillgates.data.chat import prompt_wrapper_sha256
from distillgates.data.registry import tool_registry_sha256
from distillgates.io import sha256_file
from distillgates.tokenizer import tokenizer_fingerprint


def dataset_sha256(path: str | Path) -> str:
    """sha256 of the dataset file bytes (header included, so it changes with any fingerprint)."""
    return sha256_file(path)


__all__ = ["dataset_sha256", "prompt_wrapper_sha256", "tokenizer_fingerprint", "tool_registry_sha256"]
