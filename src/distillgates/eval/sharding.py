"""Sharded evaluation across real processes, and the sharded-vs-unsharded determinism check.

Items go to rank ``int(sha256(id)[:16], 16) % world_size`` — stable across processes,
machines and Python versions (never ``hash()``, which is salted per process). Each rank is a
separate process (``python -m distillgates.eval.shard_worker`` launched N times, or the same
module under ``torchrun``, which sets ``RANK``/``WORLD_SIZE``), writes its outputs to
``shard-<rank>-of-<n>.jsonl`` atomically. The check compares every item's output with the
unsharded run after normalization and reports coverage, duplicates, missing items, mismatches and
the items each shard scored as ``gate_inputs.determinism``.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from distillgates.io import atomic_write_text


def shard_of(item_id: str, world_size: int) -> int:
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    return int(hashlib.sha256(str(item_id).encode()).hexdigest()[:16], 16) % world_size


def shard_items(items: Iterable[Mapping[str, Any]], rank: int, world_size: int) -> list[Mapping[str, Any]]:
    if not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, {world_size}), got {rank}")
    return [item for item in items if shard_of(str(item["id"]), world_size) == rank]


def shard_path(out_dir: str | Path, rank: int, world_size: int) -> Path:
    return Path(out_dir) / f"shard-{rank}-of-{world_size}.jsonl"


def write_outputs(path: str | Path, outputs: Sequence[Mapping[str, Any]]) -> None:
    atomic_write_text(path, "".join(json.dumps(o, sort_keys=True, ensure_ascii=False) + "\n" for o in outputs))


def read_outputs(path: str | Path) -> list[dict[str, Any]]:
    outputs = []
    for lineno, line in enumerate(Path(path).read_text().splitlines(), 1):
        try:
            outputs.append(json.loads(line))
        except json.JSONDecodeError as err:
            raise ValueError(f"{path}:{lineno}: invalid JSON: {err.msg}") from err
    return outputs


def normalize_output(output: Mapping[str, Any]) -> str:
    """What must be equal between runs: turns, calls, answer and token counts (whitespace-collapsed)."""

    def clean(value: Any) -> Any:
        if isinstance(value, str):
            return " ".join(value.split())
        if isinstance(value, Mapping):
            return {k: clean(v) for k, v in value.items()}
        if isinstance(value, list):
            return [clean(v) for v in value]
        return value

    keep = {k: output.get(k) for k in ("id", "turns", "calls", "answer", "tokens_out", "ttfa_tokens")}
    return json.dumps(clean(keep), sort_keys=True, ensure_ascii=False)


def outputs_sha256(outputs: Iterable[Mapping[str, Any]]) -> str:
    """sha256 of a run's outputs as the determinism check compares them (order-independent)."""
    lines = sorted(normalize_output(o) for o in outputs)
    return hashlib.sha256("\n".join(lines).encode()).hexdigest()


def determinism_check(
    item_ids: Sequence[str],
    sharded: Sequence[Mapping[str, Any]],
    unsharded: Sequence[Mapping[str, Any]],
    n_shards: int,
    items_per_shard: Sequence[int] | None = None,
) -> dict[str, Any]:
    """``gate_inputs.determinism``: per-example equality of sharded vs unsharded outputs; ``items_per_shard``:
    the outputs each shard wrote (the gate counts the shards that scored anything)."""
    expected = set(map(str, item_ids))
    counts = Counter(str(o["id"]) for o in sharded)
    duplicates = sum(c - 1 for c in counts.values() if c > 1)
    missing = sorted(expected - set(counts))
    reference = {str(o["id"]): normalize_output(o) for o in unsharded}
    first: dict[str, str] = {}
    for output in sharded:
        first.setdefault(str(output["id"]), normalize_output(output))
    mismatched = sorted(i for i in expected & set(first) if reference.get(i) != first[i])
    covered = len(expected & set(counts))
    return {
        "coverage": covered / len(expected) if expected else 0.0,
        "duplicates": duplicates,
        "missing": len(missing),
        "mismatches": len(mismatched),
        "sharded_equal": not mismatched and not missing and not duplicates and covered == len(expected) > 0,
        "n_shards": n_shards,
        "items_per_shard": list(items_per_shard) if items_per_shard is not None else None,
        "mismatched_ids": mismatched[:20],
        "unsharded_sha256": outputs_sha256(unsharded),  # the reported eval's outputs (eval/outputs.jsonl)
    }


def launch_shards(spec_path: str | Path, out_dir: str | Path, world_size: int, timeout_s: float = 600) -> list[Path]:
    """Run ``world_size`` worker processes (one per rank) concurrently; raise if any fails."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    procs = []
    for rank in range(world_size):
        cmd = [sys.executable, "-m", "distillgates.eval.shard_worker", str(spec_path), str(out_dir)]
        procs.append(
            subprocess.Popen(
                cmd,
                env={**env, "RANK": str(rank), "WORLD_SIZE": str(world_size)},
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
        )
    failures = []
    for rank, proc in enumerate(procs):
        try:
            _, err = proc.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            _, err = proc.communicate()
            failures.append(f"rank {rank}: timed out after {timeout_s}s")
            continue
        if proc.returncode != 0:
            failures.append(f"rank {rank}: exit {proc.returncode}: {err.strip()[-2000:]}")
    if failures:
        raise RuntimeError("sharded eval failed:\n" + "\n".join(failures))
    return [shard_path(out_dir, rank, world_size) for rank in range(world_size)]
