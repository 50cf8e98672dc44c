"""Prompt-cache gates: a cached system prompt cuts TTFT, and the cache hits."""

from __future__ import annotations

import statistics

import pytest


@pytest.mark.prompt_cache
def test_ttft_reduction(gate, report, thresholds):
    cold = report.get("gate_inputs.prompt_cache.ttft_cold_ms")
    hit = report.get("gate_inputs.prompt_cache.ttft_hit_ms")
    gate.at_least("prompt_cache.samples", min(len(cold), len(hit)), 1, "TTFT samples with and without the cache")
    reduction = 1.0 - statistics.median(hit) / statistics.median(cold)
    gate.at_least("prompt_cache.ttft_reduction", reduction, thresholds.prompt_cache_ttft_reduction_min,
                  f"1 - median TTFT with cached prefix / cold ({statistics.median(hit):.3g} / "
                  f"{statistics.median(cold):.3g} ms)")


@pytest.mark.prompt_cache
def test_hit_rate(gate, report, thresholds):
    gate.at_least("prompt_cache.hit_rate", report.get("gate_inputs.prompt_cache.hit_rate"),
                  thresholds.prompt_cache_hit_rate_min, "share of requests whose shared prefix was cached")
