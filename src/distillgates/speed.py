"""Speed harness: TTFT (tokenizer + first step), steady-state TPS, TTFA, KV bytes, peak memory.

Definitions (DESIGN.md "Speed metrics"), per prompt at batch 1 after warm-up:
- ``tokenizer_ms``: text -> ids. ``first_step_ms``: prefill + sampling of the first token (the
  generator's first ``next``). ``ttft_ms`` = their sum.
- ``tps``: (tokens - 1) / (time of the last token - time of the first token): steady-state
  decode, the first token excluded. Prompts that emit fewer than 2 tokens give no TPS sample.
- ``ttfa_tokens`` / ``ttfa_ms``: tokens (and ms since the text arrived) until the first complete,
  tool-call JSON valid against the prompt's tools (``distillgates.data.tools``; the toy registry unless
  given per prompt). Computed after the run from the
  per-token timestamps, so the check does not slow the timed decode loop. Absent when no call.
- Percentiles p50/p90/p95 over prompts x repeats; the raw samples are kept for the gates'
  significance tests. ``warmup`` generations run first, untimed: the first decode of a process
  compiles (the fused decoder's one-row step for models over 16 MiB: a minute or more at SmolLM2-135M on 2 cores).
- ``per_shape``: TTFT and TPS per enumerated prefill shape, with a prompt that takes that shape
  (:func:`measure_shapes`), decoded without stopping.
- ``peak_memory_bytes``: the measuring process's peak resident set size
  (:func:`distillgates.hardware.peak_rss_bytes`: Linux ``VmHWM``, which starts at the process's ``exec``;
  ``ru_maxrss`` elsewhere), model and framework included. The
  pipeline measures in a speed worker process of its own (:func:`distillgates.gates.speed_ab.report_speed`),
  so this is the engine's process (model, tokenizer, engine), not the pipeline's.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Mapping, Sequence
from importlib import resources
from pathlib import Path
from typing import Any

import jsonschema
import numpy as np
import torch

from distillgates.config import ModelConfig, SpeedConfig
from distillgates.data.chat import ChatFormat, chat_format, toy_chat_format
from distillgates.data.tools import validate_call
from distillgates.hardware import peak_rss_bytes, torch_threads
from distillgates.io import atomic_write_json
from distillgates.runtime.base import EngineBase
from distillgates.runtime.prompt_cache import PromptCache, PromptCachedEngine
from distillgates.runtime.speculative import SpeculativeDecoder
from distillgates.runtime.torch_engine import TorchEngine

SCHEMA_VERSION = 1


def percentiles(samples: Sequence[float]) -> dict[str, Any]:
    """``{"p50", "p90", "p95", "samples"}``; percentiles are None without samples."""
    values = [float(s) for s in samples]
    if not values:
        return {"p50": None, "p90": None, "p95": None, "samples": []}
    p50, p90, p95 = np.percentile(values, [50, 90, 95]).tolist()
    return {"p50": p50, "p90": p90, "p95": p95, "samples": values}


def kv_bytes(cfg: ModelConfig, seq_len: int, bytes_per_elem: int) -> dict[str, int]:
    """K and V of every layer for ``seq_len`` positions at batch 1."""
    return {
        "layers": cfg.n_layers, "kv_heads": cfg.n_kv_heads, "head_dim": int(cfg.head_dim or 0), "seq_len": seq_len,
        "bytes_per_elem": bytes_per_elem, "bytes": cfg.kv_cache_bytes(seq_len, bytes_per_elem),
    }  # fmt: skip


def first_valid_call(texts: Sequence[str], tools: Sequence[Mapping[str, Any]] | None = None,
                     fmt: ChatFormat | None = None) -> int | None:  # fmt: skip
    """Index of the first cumulative text whose first tool call (parsed in chat format ``fmt``, default
    the toy's) is complete and valid against ``tools`` (default: the toy registry)."""
    fmt = fmt or toy_chat_format()
    for i, text in enumerate(texts):
        calls = fmt.parse_turn(text).calls
        if calls and calls[0] is not None and not validate_call(calls[0], tools):
            return i
    return None


def _one_run(
    engine: EngineBase | SpeculativeDecoder, tokenizer: Any, prompt: str, max_new_tokens: int, stop_ids: Sequence[int],
    tools: Sequence[Mapping[str, Any]] | None = None,
) -> dict:  # fmt: skip
    start = time.perf_counter()
    ids = tokenizer.encode(prompt, add_special_tokens=False)
    encoded = time.perf_counter()
    stamps: list[float] = []
    tokens: list[int] = []
    for token in engine.generate(ids, max_new_tokens=max_new_tokens, stop_ids=stop_ids):
        stamps.append(time.perf_counter())
        tokens.append(token)
    sample: dict[str, Any] = {
        "tokenizer_ms": (encoded - start) * 1e3,
        "first_step_ms": (stamps[0] - encoded) * 1e3,
        "ttft_ms": (stamps[0] - start) * 1e3,
        "tps": (len(tokens) - 1) / (stamps[-1] - stamps[0]) if len(tokens) > 1 and stamps[-1] > stamps[0] else None,
    }
    texts = [tokenizer.decode(tokens[: i + 1], skip_special_tokens=False) for i in range(len(tokens))]
    hit = first_valid_call(texts, tools, chat_format(tokenizer))
    if hit is not None:
        sample["ttfa_tokens"] = hit + 1
        sample["ttfa_ms"] = (stamps[hit] - start) * 1e3
    return sample


def measure_shapes(
    engine: EngineBase, prompt_ids: Sequence[int], lengths: Sequence[int], *, max_seq_len: int, max_new_tokens: int,
    repeats: int,
) -> dict[str, dict[str, Any]]:
    """Speed per enumerated prefill shape: for each length ``L`` (ascending), a prompt that takes shape ``L`` (the
    prompt's tokens tiled to ``max(L_prev + 1, L - max_new_tokens)`` tokens, ``L_prev`` the shape below), then
    ``max_new_tokens`` greedy tokens (fewer where the cache ends) without stopping. One untimed run per shape,
    then ``repeats`` timed ones. ``ttft_ms`` is prefill + the first token (ids given: no tokenizer time)."""
    if not prompt_ids:
        raise ValueError("measure_shapes needs a non-empty prompt")
    out: dict[str, dict[str, Any]] = {}
    previous = 0
    for length in lengths:
        n = max(previous + 1, length - max_new_tokens)
        new = min(max_new_tokens, max_seq_len - n)
        if new < 1:
            raise ValueError(f"shape {length}: a {n}-token prompt leaves no room in the {max_seq_len}-token cache")
        ids = (list(prompt_ids) * (n // len(prompt_ids) + 1))[:n]
        ttft: list[float] = []
        tps: list[float] = []
        for i in range(repeats + 1):
            start = time.perf_counter()
            stamps = [time.perf_counter() for _ in engine.generate(ids, max_new_tokens=new)]
            if i:  # the first run is the warm-up
                ttft.append((stamps[0] - start) * 1e3)
                if len(stamps) > 1 and stamps[-1] > stamps[0]:
                    tps.append((len(stamps) - 1) / (stamps[-1] - stamps[0]))
        out[str(length)] = {"prompt_tokens": n, "new_tokens": new, "ttft_ms": percentiles(ttft),
                            "tps": percentiles(tps)}  # fmt: skip
        previous = length
    return out


def measure_speed(
    engine: EngineBase | SpeculativeDecoder,
    tokenizer: Any,
    prompts: Sequence[str],
    cfg: SpeedConfig,
    *,
    model_config: ModelConfig,
    backend: str = "torch",
    export: bool = False,
    hardware_profile_key: str = "unknown",
    stop_ids: Sequence[int] = (),
    kv_bytes_per_elem: int | None = None,
    tools: Sequence[Sequence[Mapping[str, Any]]] | None = None,
    shapes: Sequence[int] = (),
) -> dict[str, Any]:
    """The SPEED section (contract.md): warm-up, then every prompt x ``cfg.repeats`` at batch 1; with ``shapes``
    (the enumerated prefill lengths) also ``per_shape`` (:func:`measure_shapes`, on the first prompt's tokens).

    Args:
        engine: any engine (``TorchEngine``, ``CoreMLEngine``, wrappers) or a ``SpeculativeDecoder``.
        tokenizer: a ``PreTrainedTokenizerFast`` (``encode``/``decode``).
        prompts: rendered prompt texts; the first ``cfg.n_prompts`` are used.
        model_config: the model's config (KV bytes at ``max_seq_len``: the static cache's size).
        kv_bytes_per_elem: cache element size (default: 4 for fp32 torch weights, 2 for an exported model's fp16).
        tools: each prompt's tools (TTFA counts calls valid against them); default: the toy registry.
    """
    if backend not in ("torch", "coreml", "coreai"):
        raise ValueError(f"backend must be 'torch', 'coreml' or 'coreai', got {backend!r}")
    chosen = list(prompts[: cfg.n_prompts])
    if not chosen:
        raise ValueError("measure_speed needs at least one prompt")
    chosen_tools = list(tools[: cfg.n_prompts]) if tools is not None else [None] * len(chosen)
    if len(chosen_tools) != len(chosen):
        raise ValueError(f"tools: {len(chosen_tools)} tool lists for {len(chosen)} prompts")
    for i in range(cfg.warmup):
        _one_run(engine, tokenizer, chosen[i % len(chosen)], cfg.max_new_tokens, stop_ids)
    runs = [
        _one_run(engine, tokenizer, prompt, cfg.max_new_tokens, stop_ids, prompt_tools)
        for _ in range(cfg.repeats)
        for prompt, prompt_tools in zip(chosen, chosen_tools)
    ]

    def collect(key: str) -> dict[str, Any]:
        return percentiles([r[key] for r in runs if r.get(key) is not None])

    per_shape = {}
    if shapes:
        if isinstance(engine, SpeculativeDecoder):
            raise ValueError("per-shape speed is measured on the engine alone, not with speculative decoding")
        per_shape = measure_shapes(engine, tokenizer.encode(chosen[0], add_special_tokens=False), shapes,
                                   max_seq_len=model_config.max_seq_len, max_new_tokens=cfg.max_new_tokens,
                                   repeats=cfg.repeats)
    if kv_bytes_per_elem is None:
        kv_bytes_per_elem = 2 if backend != "torch" else _cache_elem_size(engine)
    return {
        "backend": backend,
        "export": export,
        "hardware_profile_key": hardware_profile_key,
        "n_prompts": len(chosen),
        "repeats": cfg.repeats,
        "max_new_tokens": cfg.max_new_tokens,
        "ttft_ms": collect("ttft_ms"),
        "tokenizer_ms": collect("tokenizer_ms"),
        "first_step_ms": collect("first_step_ms"),
        "tps": collect("tps"),
        "ttfa_tokens": collect("ttfa_tokens"),
        "ttfa_ms": collect("ttfa_ms"),
        "kv_bytes": kv_bytes(model_config, model_config.max_seq_len, kv_bytes_per_elem),
        "warmup": cfg.warmup,
        "threads": torch.get_num_threads(),
        "peak_memory_bytes": peak_rss_bytes(),
        "peak_memory_source": "peak resident set of the measuring process (distillgates.hardware.peak_rss_bytes: "
                              "Linux VmHWM, ru_maxrss elsewhere)",
        **({"per_shape": per_shape} if per_shape else {}),
    }


def measure_paired(
    engines: Mapping[str, EngineBase | SpeculativeDecoder], tokenizer: Any, prompts: Sequence[str], *,
    max_new_tokens: int, stop_ids: Sequence[int] = (),
) -> dict[str, dict[str, list[float]]]:  # fmt: skip
    """TTFT and TPS samples of two engines on the same prompts, each prompt decoded by both back to back, each engine
    first on every other prompt (AB BA AB ...: each follows each as often, so a slow stretch of the machine, and the
    caches the previous generation left, fall on both alike), after one untimed generation of each (the first
    decode of a process compiles). ``{name: {"ttft_ms": [...], "tps": [...]}}``: one TTFT sample per prompt; a
    generation of fewer than two tokens has no TPS sample."""
    names = list(engines)
    if len(names) != 2 or not prompts:
        raise ValueError(f"measure_paired needs two engines and a prompt, got {names} and {len(prompts)} prompts")
    for name in names:
        _one_run(engines[name], tokenizer, prompts[0], max_new_tokens, stop_ids)
    out: dict[str, dict[str, list[float]]] = {name: {"ttft_ms": [], "tps": []} for name in names}
    for i, prompt in enumerate(prompts):
        for name in (names if i % 2 == 0 else names[::-1]):
            run = _one_run(engines[name], tokenizer, prompt, max_new_tokens, stop_ids)
            out[name]["ttft_ms"].append(run["ttft_ms"])
            if run["tps"] is not None:
                out[name]["tps"].append(run["tps"])
    return out


def _cache_elem_size(engine: EngineBase | SpeculativeDecoder) -> int:
    inner = getattr(engine, "engine", engine)  # PromptCachedEngine wraps a TorchEngine
    if isinstance(inner, TorchEngine):
        cache = inner.model.layers[0].attn.kv_cache
        assert cache is not None  # TorchEngine sets up the caches
        return cache.k_cache.element_size()
    return 4


def measure_prompt_cache(
    engine: TorchEngine,
    prompts: Sequence[Sequence[int]],
    prefix_len: Callable[[Sequence[int]], int],
    *,
    repeats: int = 3,
    max_bytes: int = 256 * 2**20,
) -> dict[str, Any]:
    """gate_inputs.prompt_cache: TTFT (prefill + first token) cold vs on a cache hit, and the hit rate.

    Every distinct prefix is inserted once before timing (a server warms its system prompts), so
    ``hit_rate`` counts the timed requests only: below 1 means eviction or prefix mismatch.
    Cold and hit alternate per prompt, on one torch thread: a batch-1 prefill of a small model is
    dispatch-bound, and a second OpenMP thread added sync noise that hid the cache's effect (toy
    student, 2 cores, 6 trials each: reduction 0.28-0.41 with 2 threads, 0.45-0.47 with 1).
    """
    cache = PromptCache(max_bytes)
    cached = PromptCachedEngine(engine, cache, prefix_len)
    cold: list[float] = []
    hit: list[float] = []
    with torch_threads(1):
        for prompt in prompts:  # warm-up: fills the cache and warms both paths
            engine.prefill(prompt)
            cached.prefill(prompt)
        cache.stats.hits = cache.stats.misses = 0
        for _ in range(repeats):
            for prompt in prompts:
                t0 = time.perf_counter()
                int(torch.argmax(engine.prefill(prompt)))
                t1 = time.perf_counter()
                int(torch.argmax(cached.prefill(prompt)))
                t2 = time.perf_counter()
                cold.append((t1 - t0) * 1e3)
                hit.append((t2 - t1) * 1e3)
    return {
        "ttft_cold_ms": cold,
        "ttft_hit_ms": hit,
        "hit_rate": cache.stats.hit_rate,
        "ttft_reduction_p50": 1.0 - float(np.median(hit)) / float(np.median(cold)),
        "entries": len(cache.entries),
        "cache_bytes": cache.nbytes,
    }


def measure_speculative(
    worker: TorchEngine,
    drafter: TorchEngine,
    prompts: Sequence[Sequence[int]],
    *,
    max_new_tokens: int,
    stop_ids: Sequence[int] = (),
    k: int = 4,
) -> dict[str, Any]:
    """gate_inputs.speculative without the speedup: identical greedy output and the acceptance statistics.

    Nothing here is timed: the speedup is measured in speed worker processes, each decoding every prompt plainly
    and speculatively back to back (:func:`distillgates.gates.speed_ab.speculative_speedup`), never in this process.
    """
    decoder = SpeculativeDecoder(worker, drafter, k=k)
    identical = True
    stats = decoder.stats
    per_item: list[float] = []  # each prompt's rollbacks / worker steps (prompts the drafter never drafted for: none)
    for prompt in prompts:
        reference = list(worker.generate(prompt, max_new_tokens=max_new_tokens, stop_ids=stop_ids))
        steps, rollbacks = stats.worker_steps, stats.rollbacks
        identical &= list(decoder.generate(prompt, max_new_tokens=max_new_tokens, stop_ids=stop_ids)) == reference
        if stats.worker_steps > steps:
            per_item.append((stats.rollbacks - rollbacks) / (stats.worker_steps - steps))
    return {
        "identical": identical,
        "acceptance_rate": stats.acceptance_rate,
        "tokens_per_worker_step": stats.tokens_per_worker_step,
        "rollback_rate": stats.rollback_rate,
        "rollback_rate_per_item": per_item,
        "final_k": decoder.k,
    }


# --------------------------------------------------------------------------------------
# Report


def load_schema() -> dict[str, Any]:
    text = resources.files("distillgates.schemas").joinpath("speed_report.schema.json").read_text()
    return json.loads(text)


def validate_report(report: dict[str, Any]) -> None:
    """Raise ``jsonschema.ValidationError`` naming the failing field."""
    jsonschema.validate(report, load_schema())


def speed_report(
    hardware: dict[str, Any],
    speed: dict[str, Any],
    prompt_cache: dict[str, Any] | None = None,
    speculative: dict[str, Any] | None = None,
) -> dict[str, Any]:
    report = {"schema_version": SCHEMA_VERSION, "hardware": hardware, "speed": speed}
    if prompt_cache is not None:
        report["prompt_cache"] = prompt_cache
    if speculative is not None:
        report["speculative"] = speculative
    validate_report(report)
    return report


def write_report(path: str | Path, report: dict[str, Any]) -> None:
    validate_report(report)
    atomic_write_json(path, report)
