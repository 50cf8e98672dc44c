from __future__ import annotations

import random

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from distillgates.runtime.speculative import SpeculativeDecoder
from distillgates.runtime.torch_engine import TorchEngine

_ENGINES: dict[tuple[int, int], tuple[TorchEngine, TorchEngine]] = {}


# float64: the worker's one-forward verification and its one-token decode agree to ~1e-16, so
# no near-tie can flip an argmax and "identical" is testable exactly.
@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    worker_seed=st.integers(0, 5),
    drafter_seed=st.integers(0, 5),
    prompt=st.lists(st.integers(0, 47), min_size=1, max_size=12),
    k=st.integers(1, 6),
    adaptive=st.booleans(),
    max_new_tokens=st.integers(1, 30),
)
def test_greedy_output_identical_to_worker_alone(
    make_model, worker_seed, drafter_seed, prompt, k, adaptive, max_new_tokens
):
    key = (worker_seed, drafter_seed)
    if key not in _ENGINES:  # building engines dominates the run time: reuse them across examples
        _ENGINES[key] = (
            TorchEngine(make_model(worker_seed, dtype=torch.float64)),
            TorchEngine(make_model(100 + drafter_seed, d_model=16, n_layers=1, dtype=torch.float64)),
        )
    worker, drafter = _ENGINES[key]
    expected = list(worker.generate(prompt, max_new_tokens=max_new_tokens))
    decoder = SpeculativeDecoder(worker, drafter, k=k, adaptive=adaptive, k_max=6)
    assert list(decoder.generate(prompt, max_new_tokens=max_new_tokens)) == expected
    stats = decoder.stats
    assert 0 <= stats.accepted <= stats.proposed
    assert stats.emitted == stats.accepted + stats.worker_steps


def test_perfect_drafter_accepts_everything_and_grows_k(make_model):
    worker = TorchEngine(make_model(1, dtype=torch.float64))
    twin = TorchEngine(make_model(1, dtype=torch.float64))  # same weights: every draft is right
    # a twin costs as much as the worker, so only a cheap draft step (fixed, not timed) makes long drafts pay
    decoder = SpeculativeDecoder(worker, twin, k=2, k_max=5, draft_cost=0.1)
    out = list(decoder.generate([1, 2, 3], max_new_tokens=30))
    assert out == list(TorchEngine(make_model(1, dtype=torch.float64)).generate([1, 2, 3], max_new_tokens=30))
    assert decoder.stats.acceptance_rate == 1.0 and decoder.stats.rollback_rate == 0.0
    assert decoder.k == 5 and decoder.stats.tokens_per_worker_step > 3


def test_bad_drafter_shrinks_k_and_rolls_back(make_model):
    worker = TorchEngine(make_model(2, dtype=torch.float64))
    drafter = TorchEngine(make_model(3, d_model=16, dtype=torch.float64))
    decoder = SpeculativeDecoder(worker, drafter, k=4)
    expected = list(worker.generate([5, 6], max_new_tokens=25))
    assert list(decoder.generate([5, 6], max_new_tokens=25)) == expected
    assert decoder.stats.acceptance_rate < 0.5 and decoder.stats.rollback_rate > 0.5
    assert decoder.k == 1


@pytest.mark.parametrize(("acceptance", "draft_cost", "best_k"), [(0.8, 0.65, 1), (0.9, 0.65, 2), (0.9, 0.1, 10)])
def test_adaptive_k_maximises_expected_tokens_per_cost(make_model, acceptance, draft_cost, best_k):
    """Cycles whose drafts are each accepted with probability ``acceptance`` settle k where
    ``E(k) / (k * draft_cost + 1)`` peaks (Leviathan et al. eq. 1), not at the longest all-accepted run."""
    engine = TorchEngine(make_model(0))
    decoder = SpeculativeDecoder(engine, engine, k=4, draft_cost=draft_cost)
    ks = range(1, decoder.k_max + 1)
    gain = {k: (1 - acceptance ** (k + 1)) / (1 - acceptance) / (k * draft_cost + 1) for k in ks}
    assert max(gain, key=gain.get) == best_k
    rng = random.Random(0)
    chosen = []
    for _ in range(2000):
        k = decoder.k
        accepted = 0
        while accepted < k and rng.random() < acceptance:
            accepted += 1
        decoder._adapt(accepted, k, step_s=None, verify_s=1.0)
        chosen.append(decoder.k)
    # the running acceptance estimate wobbles; the k it picks stays near the peak
    assert sum(gain[k] for k in chosen) / len(chosen) > 0.97 * gain[best_k]


def test_stop_id_and_cache_edge(make_model):
    worker = TorchEngine(make_model(4, dtype=torch.float64, max_seq_len=24))
    drafter = TorchEngine(make_model(4, dtype=torch.float64, max_seq_len=24))
    free = list(worker.generate([1, 2], max_new_tokens=22))  # fills the cache up to its last slot
    assert list(SpeculativeDecoder(worker, drafter, k=6).generate([1, 2], max_new_tokens=22)) == free
    stop = free[6]
    expected = free[: free.index(stop) + 1]
    decoder = SpeculativeDecoder(worker, drafter, k=3)
    assert list(decoder.generate([1, 2], max_new_tokens=22, stop_ids=[stop])) == expected


def test_drafting_stops_at_a_stop_id(make_model):
    """Nothing after a stop id is ever emitted, so the drafter proposes nothing after one."""
    worker = TorchEngine(make_model(5, dtype=torch.float64))
    twin = TorchEngine(make_model(5, dtype=torch.float64))
    free = list(worker.generate([3, 4], max_new_tokens=20))
    stop = free[6]
    expected = free[: free.index(stop) + 1]
    decoder = SpeculativeDecoder(worker, twin, k=12, adaptive=False)
    assert list(decoder.generate([3, 4], max_new_tokens=20, stop_ids=[stop])) == expected
    assert decoder.stats.proposed == decoder.stats.accepted == len(expected) - 1  # the first token is the prefill's


def test_rejects_mismatched_vocab_and_bad_k(make_model):
    worker = TorchEngine(make_model(0))
    with pytest.raises(ValueError, match="vocab"):
        SpeculativeDecoder(worker, TorchEngine(make_model(0, vocab_size=40)))
    with pytest.raises(ValueError, match="k_min"):
        SpeculativeDecoder(worker, TorchEngine(make_model(1)), k=9, k_max=8)
    with pytest.raises(ValueError, match="draft_cost"):
        SpeculativeDecoder(worker, TorchEngine(make_model(1)), draft_cost=0.0)
