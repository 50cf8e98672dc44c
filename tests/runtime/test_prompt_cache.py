from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from distillgates.runtime.prompt_cache import PromptCache, PromptCachedEngine, prefix_until
from distillgates.runtime.torch_engine import TorchEngine

END = 2  # stands in for <|end|> closing the system prompt


def test_outputs_identical_to_no_cache_and_stats(make_model):
    model = make_model(0)
    plain = TorchEngine(make_model(0))
    cache = PromptCache(max_bytes=10**7)
    cached = PromptCachedEngine(TorchEngine(model), cache, prefix_until(END))
    system = [1, 7, 8, 9, 10, 11, END]
    prompts = [[*system, 20, 21, 22], [*system, 30, 31], system, [*system, 20, 21, 22], [5, 6, 7]]
    for prompt in prompts:
        expected = list(plain.generate(prompt, max_new_tokens=12))
        assert list(cached.generate(prompt, max_new_tokens=12)) == expected
        torch.testing.assert_close(cached.prefill(prompt), plain.prefill(prompt), atol=1e-5, rtol=1e-5)
    # run 1 misses (and stores the system prompt), every later prompt with the system prompt hits;
    # the last prompt (no <|end|>) misses and is not stored
    assert (cache.stats.hits, cache.stats.misses) == (7, 3)
    assert list(cache.entries) == [tuple(system)]


def test_hit_and_miss_paths_are_bit_identical(make_model):
    engine = TorchEngine(make_model(1))
    cached = PromptCachedEngine(engine, PromptCache(10**7), prefix_until(END))
    prompt = [1, 3, 4, END, 9, 9, 8]
    miss = cached.prefill(prompt)
    hit = cached.prefill(prompt)
    assert torch.equal(miss, hit)
    assert cached.cache.stats.hits == 1


# make_model is a pure factory, so sharing it across hypothesis examples is safe
@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    system=st.lists(st.integers(3, 47), min_size=1, max_size=20),
    users=st.lists(st.lists(st.integers(3, 47), min_size=0, max_size=8), min_size=1, max_size=4),
    seed=st.integers(0, 3),
)
def test_greedy_identical_with_and_without_cache_property(make_model, system, users, seed):
    model = make_model(seed, dtype=torch.float64)
    plain = TorchEngine(model)
    cache = PromptCache(10**7)
    prompts = [[1, *system, END, *user] for user in users]
    outputs = []
    for prompt in prompts:  # plain first: both engines share the model's cache buffers
        reference = list(plain.generate(prompt, max_new_tokens=8))
        cached = PromptCachedEngine(TorchEngine(model), cache, prefix_until(END))
        outputs.append((list(cached.generate(prompt, max_new_tokens=8)), reference))
    assert all(got == want for got, want in outputs)
    assert cache.stats.misses == 1 and cache.stats.hits == len(prompts) - 1


def test_lru_eviction_by_bytes(make_model):
    engine = TorchEngine(make_model(2))
    kv_tokens = []
    for prefix in ([1, END], [3, END], [4, END]):
        engine.prefill(prefix)
        kv_tokens.append((prefix, engine.read_kv(2), torch.zeros(48)))
    entry_bytes = sum(k.nbytes + v.nbytes for k, v in kv_tokens[0][1]) + 48 * 4
    cache = PromptCache(max_bytes=2 * entry_bytes)
    cache.insert(*kv_tokens[0])
    cache.insert(*kv_tokens[1])
    assert cache.lookup([1, END, 5]) is not None  # touch the first: the second is now LRU
    cache.insert(*kv_tokens[2])
    assert set(cache.entries) == {(1, END), (4, END)}
    assert cache.stats.evictions == 1 and cache.nbytes == 2 * entry_bytes
    assert not PromptCache(max_bytes=entry_bytes - 1).insert(*kv_tokens[0])  # never fits
    with pytest.raises(ValueError):
        PromptCache(0)


def test_longest_stored_prefix_wins(make_model):
    engine = TorchEngine(make_model(3))
    cache = PromptCache(10**7)
    for prefix in ([1, 2], [1, 2, 3, 4]):
        engine.prefill(prefix)
        cache.insert(prefix, engine.read_kv(len(prefix)), torch.zeros(48))
    assert cache.lookup([1, 2, 3, 4, 5]).tokens == (1, 2, 3, 4)
    assert cache.lookup([1, 2, 3, 5]).tokens == (1, 2)
    assert cache.lookup([2, 1]) is None
    assert cache.stats.hit_rate == pytest.approx(2 / 3)
