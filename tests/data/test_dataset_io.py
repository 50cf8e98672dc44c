"""Dataset JSONL: header, atomic writer, validating reader with file:line:field errors."""

from __future__ import annotations

import json
import re

import pytest

from distillgates.data.dataset import DatasetError, read_dataset, write_dataset
from distillgates.data.fingerprints import dataset_sha256
from distillgates.tokenizer import tokenizer_fingerprint


@pytest.fixture()
def written(tmp_path, toy_items, toy_tokenizer):
    path = tmp_path / "train.jsonl"
    sha = write_dataset(path, toy_items[:20], tokenizer_fingerprint(toy_tokenizer), seed=0)
    return path, sha


def _rewrite(path, line_number, mutate):
    lines = path.read_text().splitlines()
    lines[line_number - 1] = mutate(lines[line_number - 1])
    path.write_text("\n".join(lines) + "\n")


def _set(field, value):
    def mutate(line):
        obj = json.loads(line)
        obj[field] = value
        return json.dumps(obj)

    return mutate


def _drop(field):
    def mutate(line):
        obj = json.loads(line)
        del obj[field]
        return json.dumps(obj)

    return mutate


def test_round_trip_and_header(written, toy_items, toy_tokenizer):
    path, sha = written
    header, items = read_dataset(path, tokenizer_fingerprint(toy_tokenizer))
    assert items == toy_items[:20]
    assert header["total"] == 20 and header["shard"] == {"index": 0, "count": 1} and header["seed"] == 0
    assert sha == dataset_sha256(path)


def test_writer_is_deterministic(tmp_path, toy_items):
    a = write_dataset(tmp_path / "a.jsonl", toy_items[:10], "f" * 64, seed=0)
    b = write_dataset(tmp_path / "b.jsonl", toy_items[:10], "f" * 64, seed=0)
    assert a == b
    assert write_dataset(tmp_path / "c.jsonl", toy_items[:10], "e" * 64, seed=0) != a


@pytest.mark.parametrize(
    ("line", "mutate", "field"),
    [
        (5, lambda line: line[:-3], "<json>"),
        (4, _drop("reference"), "reference"),
        (3, _set("tool_should_be_used", "yes"), "tool_should_be_used"),
        (6, _set("kind", ""), "kind"),
        (2, _set("messages", [{"role": "robot", "content": "x"}]), "messages[0].role"),
        (7, _set("pii", [42]), "pii[0]"),
        (8, _set("id", "toy-train-000000"), "id"),
        (1, _set("tool_registry_sha256", "0" * 64), "tool_registry_sha256"),
        (1, _set("prompt_wrapper_sha256", "0" * 64), "prompt_wrapper_sha256"),
        (1, _set("total", 3), "total"),
        (1, _drop("seed"), "seed"),
        (1, _set("dataset_version", 99), "dataset_version"),
        (2, lambda line: "[1, 2]", "<item>"),
        (2, _set("kind", 5), "kind"),
        (2, _set("locale", "xx"), "locale"),
        (2, _set("fixtures", ["get_weather"]), "fixtures[0]"),
        (2, _set("tool_should_be_used", False), "tool_should_be_used"),
        (2, _set("argument_alternatives", {"city": ["Paris"]}), "argument_alternatives"),
        (2, _set("argument_alternatives", ["Paris"]), "argument_alternatives[0]"),
        (2, _set("optional_arguments", "unit"), "optional_arguments"),
        (2, _set("optional_arguments", [5]), "optional_arguments[0]"),
        (2, _set("messages", [{"role": "user", "content": 5}]), "messages[0].content"),
        (2, _set("messages", [{"role": "system", "content": "tools"}]), "messages"),
    ],
)
def test_reader_errors_name_file_line_field(written, line, mutate, field):
    path, _ = written
    _rewrite(path, line, mutate)
    with pytest.raises(DatasetError, match=re.escape(f"{path}:{line}: {field}:")):
        read_dataset(path)


def test_bad_expected_call_is_named(written, toy_items):
    path, _ = written
    line = next(i for i, item in enumerate(toy_items[:20], start=2) if item["expected_calls"])
    bad = [{"name": "get_weather", "arguments": {"town": "Paris"}}]
    _rewrite(path, line, _set("expected_calls", bad))
    with pytest.raises(DatasetError, match=re.escape(f"{path}:{line}: expected_calls[0]:") + ".*missing_required"):
        read_dataset(path)


def test_tokenizer_fingerprint_mismatch(written):
    path, _ = written
    with pytest.raises(DatasetError, match=re.escape(f"{path}:1: tokenizer_fingerprint: mismatch")):
        read_dataset(path, tokenizer_fingerprint="0" * 64)


def test_missing_header(tmp_path, toy_items):
    path = tmp_path / "noheader.jsonl"
    path.write_text(json.dumps(toy_items[0]) + "\n")
    with pytest.raises(DatasetError, match=re.escape(f"{path}:1: __header__:")):
        read_dataset(path)
