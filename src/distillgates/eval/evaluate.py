"""Entry points the pipeline and the CLI call: build a runner, evaluate, shard, fingerprint.

``evaluate(runner_or_engine, items, tokenizer)`` runs every item and scores it. A *spec*
(plain JSON: dataset, tokenizer, model, runner kind, decoding budget) describes a run so the
very same run can be repeated in N shard processes (:mod:`distillgates.eval.shard_worker`)
and compared with the unsharded run (:func:`sharded_determinism`).
"""

from __future__ import annotations

import json
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal, overload

from distillgates.config import PrivacyConfig
from distillgates.data.chat import chat_format, prompt_wrapper_sha256
from distillgates.data.registry import tool_registry_sha256
from distillgates.eval.broker import FixturePolicy
from distillgates.eval.fingerprints import check_fingerprints, items_sha256
from distillgates.eval.runners import EngineRunner, HFRunner, Runner, TeacherRunner, run_items, runner_fingerprint_of
from distillgates.eval.scorer import ItemScore, score_items, summarize
from distillgates.eval.sharding import (
    determinism_check,
    launch_shards,
    read_outputs,
    shard_items,
)
from distillgates.tokenizer import tokenizer_fingerprint


def as_runner(
    engine_or_runner: Any, tokenizer: Any, model_fingerprint: str | None = None, max_new_tokens: int = 96,
    constrained: bool = False, batch_size: int = 1,
) -> Runner:
    """A runner as is; a runtime engine wrapped in a greedy :class:`EngineRunner` (``constrained``:
    tool calls under constrained JSON decoding; ``batch_size``: items decoded together, the engine
    needs that many cache rows)."""
    if hasattr(engine_or_runner, "session"):
        if batch_size != getattr(engine_or_runner, "batch_size", 1):
            raise ValueError(f"batch_size {batch_size} needs a runtime engine (or an EngineRunner built with it); "
                             f"got a {type(engine_or_runner).__name__}")  # fmt: skip
        if constrained and not getattr(engine_or_runner, "constrained", False):
            raise ValueError("constrained tool-call decoding needs a runtime engine (or an EngineRunner built "
                             f"with constrained=True); got a {type(engine_or_runner).__name__}")
        return engine_or_runner
    if hasattr(engine_or_runner, "continue_generate") or hasattr(engine_or_runner, "generate"):
        if model_fingerprint is None:
            from distillgates.model import model_fingerprint as fingerprint_of

            model_fingerprint = fingerprint_of(engine_or_runner.model)
        return EngineRunner(engine_or_runner, tokenizer, model_fingerprint, max_new_tokens, constrained,
                            batch_size=batch_size)  # fmt: skip
    raise TypeError(f"expected a runner or a runtime engine, got {type(engine_or_runner).__name__}")


def item_lengths(items: Sequence[Mapping[str, Any]], tokenizer: Any) -> dict[str, int]:
    """Token length of each item's reference conversation (its enumerated-shape bucket)."""
    fmt = chat_format(tokenizer)
    return {str(i["id"]): len(fmt.encode(fmt.conversation(i))) for i in items}


def check_eval_budget(items: Sequence[Mapping[str, Any]], tokenizer: Any, max_new_tokens: int, max_calls: int) -> None:
    """Refuse an eval budget that cuts a reference: an item whose reference has a turn longer than ``max_new_tokens``
    tokens (its stop token included, in ``tokenizer``'s chat format) or more than ``max_calls`` calls scores as a
    failure whatever the model does, which understates every model's figures alike.

    Raises:
        ValueError: naming the setting, how many items it cuts, the longest and its item.
    """
    from distillgates.eval.runners import reference_output

    if not items:
        return
    refs = [(reference_output(item, tokenizer), str(item["id"])) for item in items]
    turns = [(max(t["tokens"] for t in out["turns"] if t["role"] == "assistant"), item_id) for out, item_id in refs]
    calls = [(len(out["calls"]), item_id) for out, item_id in refs]
    for field, limit, needs, unit in (
        ("eval.max_new_tokens", max_new_tokens, turns, "tokens in a turn (this tokenizer, its stop token included)"),
        ("eval.max_calls", max_calls, calls, "calls"),
    ):
        longest, item_id = max(needs)
        if longest > limit:
            raise ValueError(f"{field} {limit} cuts the reference of {sum(n > limit for n, _ in needs)} of "
                             f"{len(items)} eval items, which then fail whatever the model does (the longest: "
                             f"{item_id}, {longest} {unit}): set {field} to at least {longest}")


@overload
def evaluate(
    engine_or_runner: Any,
    items: Sequence[Mapping[str, Any]],
    tokenizer: Any,
    *,
    lengths: Sequence[int] | None = ...,
    max_calls: int = ...,
    max_new_tokens: int = ...,
    return_outputs: Literal[False] = ...,
    dataset_sha256: str | None = ...,
    progress: bool = ...,
    constrained: bool = ...,
    policy: FixturePolicy | None = ...,
    privacy: PrivacyConfig | None = ...,
    batch_size: int = ...,
) -> dict[str, Any]: ...


@overload
def evaluate(
    engine_or_runner: Any,
    items: Sequence[Mapping[str, Any]],
    tokenizer: Any,
    *,
    lengths: Sequence[int] | None = ...,
    max_calls: int = ...,
    max_new_tokens: int = ...,
    return_outputs: Literal[True],
    dataset_sha256: str | None = ...,
    progress: bool = ...,
    constrained: bool = ...,
    policy: FixturePolicy | None = ...,
    privacy: PrivacyConfig | None = ...,
    batch_size: int = ...,
) -> tuple[dict[str, Any], list[dict[str, Any]], list[ItemScore]]: ...


def evaluate(
    engine_or_runner: Any,
    items: Sequence[Mapping[str, Any]],
    tokenizer: Any,
    *,
    lengths: Sequence[int] | None = None,
    max_calls: int = 4,
    max_new_tokens: int = 96,
    return_outputs: bool = False,
    dataset_sha256: str | None = None,
    progress: bool = False,
    constrained: bool = False,
    policy: FixturePolicy | None = None,
    privacy: PrivacyConfig | None = None,
    batch_size: int = 1,
) -> dict[str, Any] | tuple[dict[str, Any], list[dict[str, Any]], list[ItemScore]]:
    """Run and score ``items``; returns METRICS (with slices and ``fingerprints``).

    Args:
        engine_or_runner: a runner (:class:`EngineRunner`, :class:`HFRunner`, :class:`TeacherRunner`)
            or a runtime engine (wrapped greedily with ``max_new_tokens`` per turn).
        items: eval items.
        tokenizer: the project tokenizer (shape slices and the tokenizer fingerprint).
        lengths: enumerated shapes (``cfg.shapes.lengths``) for the shape slice.
        max_calls: tool calls allowed per item.
        return_outputs: also return the per-item outputs and their scores
            (:class:`~distillgates.eval.scorer.ItemScore`).
        dataset_sha256: the eval file's sha256 (``distillgates.data.fingerprints.dataset_sha256``);
            default: sha256 of the items.
        constrained: an engine decodes tool calls under constrained JSON decoding (not for runners).
        policy: how the broker answers a call without a fixture (default: an error result).
        privacy: the scorer's PII patterns and allow-list (default: :class:`PrivacyConfig`).
        batch_size: an engine decodes this many items together (:func:`~distillgates.eval.runners.run_items_batched`;
            it needs that many cache rows, ``TorchEngine(model, max_batch_size=...)``).
    """
    runner = as_runner(engine_or_runner, tokenizer, max_new_tokens=max_new_tokens, constrained=constrained,
                       batch_size=batch_size)  # fmt: skip
    outputs = run_items(runner, items, max_calls=max_calls, progress=progress, policy=policy)
    scores = score_items(items, outputs, item_lengths(items, tokenizer) if lengths else None, lengths, privacy)
    metrics = summarize(scores)
    metrics["fingerprints"] = collect_fingerprints(runner, items, tokenizer, dataset_sha256)
    return (metrics, outputs, scores) if return_outputs else metrics


def collect_fingerprints(
    runner: Runner, items: Sequence[Mapping[str, Any]], tokenizer: Any, dataset_sha256: str | None = None
) -> dict[str, str]:
    """The six report fingerprints; ``dataset_sha256`` defaults to the sha256 of the items."""
    return check_fingerprints(
        {
            "dataset_sha256": dataset_sha256 or items_sha256(items),
            "tool_registry_sha256": tool_registry_sha256(),
            "tokenizer_fingerprint": tokenizer_fingerprint(tokenizer),
            "prompt_wrapper_sha256": prompt_wrapper_sha256(),
            "runner_fingerprint": runner_fingerprint_of(runner),
            "model_fingerprint": runner.model_fingerprint,
        },
        f"{runner.kind} runner",
    )


# --------------------------------------------------------------------------------------
# Specs: a run described as data, repeatable in any process


def build_runner(spec: Mapping[str, Any], tokenizer: Any) -> Runner:
    """Runner from a spec: ``runner`` is ``engine`` (distillgates checkpoint), ``hf`` or ``openai``."""
    kind, budget = spec.get("runner", "engine"), int(spec.get("max_new_tokens", 96))
    if kind == "engine":
        from distillgates.model import load_model, model_fingerprint
        from distillgates.runtime.torch_engine import TorchEngine

        model = load_model(spec["model"])
        constrained, batch_size = bool(spec.get("constrained_tool_calls", False)), int(spec.get("batch_size", 1))
        engine = TorchEngine(model, max_batch_size=batch_size)
        return EngineRunner(engine, tokenizer, model_fingerprint(model), budget, constrained, batch_size=batch_size)
    if kind == "hf":
        return HFRunner.from_pretrained(spec["model"], tokenizer, budget)
    if kind == "openai":
        from distillgates.config import APIConfig, from_dict
        from distillgates.teacher.http import HTTPTeacher

        cfg = from_dict(APIConfig, spec["teacher"], source="spec", path="teacher")
        return TeacherRunner(HTTPTeacher(cfg, tokenizer), budget)
    raise ValueError(f"spec.runner: expected engine/hf/openai, got {kind!r}")


def load_spec_items(spec: Mapping[str, Any]) -> tuple[list[dict[str, Any]], Any, str]:
    """(items, tokenizer, dataset_sha256) of a spec; the dataset header must match the tokenizer."""
    from distillgates.data.dataset import read_dataset
    from distillgates.data.fingerprints import dataset_sha256
    from distillgates.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(spec["tokenizer"])
    _, items = read_dataset(spec["dataset"], tokenizer_fingerprint(tokenizer))
    limit = spec.get("limit")
    return (items[: int(limit)] if limit else items), tokenizer, dataset_sha256(spec["dataset"])


def run_spec(spec: Mapping[str, Any], rank: int = 0, world_size: int = 1) -> list[dict[str, Any]]:
    """Outputs of this rank's shard of the spec's items."""
    items, tokenizer, _ = load_spec_items(spec)
    runner = build_runner(spec, tokenizer)
    policy = FixturePolicy(spec.get("missing_fixture", "error"), dict(spec.get("mock_result", {"status": "ok"})))
    return run_items(runner, shard_items(items, rank, world_size), max_calls=int(spec.get("max_calls", 4)),
                     policy=policy)


def sharded_determinism(
    spec: Mapping[str, Any], world_size: int, work_dir: str | Path | None = None,
    unsharded: Sequence[Mapping[str, Any]] | None = None,
) -> dict[str, Any]:  # fmt: skip
    """Run the spec in ``world_size`` worker processes and compare per item with the unsharded outputs.

    ``unsharded``: the outputs of the run being reported (evaluated once, on ``spec["threads"]`` threads,
    the workers' count); None runs the spec unsharded here first.
    """
    from distillgates.hardware import torch_threads

    items, _, _ = load_spec_items(spec)
    if unsharded is None:
        with torch_threads(int(spec.get("threads", 1))):  # same kernels (reduction order) as the ranks
            unsharded = run_spec(spec)
    with tempfile.TemporaryDirectory(dir=work_dir) as tmp:
        spec_path = Path(tmp) / "spec.json"
        spec_path.write_text(json.dumps(dict(spec)))
        shards = [read_outputs(path) for path in sorted(map(str, launch_shards(spec_path, tmp, world_size)))]
    sharded = [output for shard in shards for output in shard]  # duplicates kept: the check counts them
    return determinism_check([str(i["id"]) for i in items], sharded, list(unsharded), world_size,
                             [len(shard) for shard in shards])
