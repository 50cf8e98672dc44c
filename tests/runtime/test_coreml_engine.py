"""Core ML engine orchestration on Linux (stand-in backend) and real Core ML on macOS."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from distillgates.runtime.coreml_engine import CoreMLEngine, ExportedProgramStandIn, stand_in_engine
from distillgates.runtime.prompt_cache import PromptCache, PromptCachedEngine, prefix_until
from distillgates.runtime.torch_engine import TorchEngine

LENGTHS = [8, 16]


@pytest.fixture(scope="module")
def pair(make_model):
    """(model, stand-in engine): torch.export of both wrappers takes ~10 s, so build once."""
    model = make_model(0, max_seq_len=32)
    return model, stand_in_engine(model, LENGTHS)


@pytest.mark.integration  # torch.export of both wrappers (~4 s)
def test_stand_in_is_what_the_engine_runs(pair):
    _, engine = pair
    assert isinstance(engine.prefill_runner, ExportedProgramStandIn)
    state = engine.decode_runner.new_state()
    assert sorted(state) == sorted(f"{k}_cache_{i}" for i in range(2) for k in "kv")
    assert all(a.dtype == np.float16 and a.shape == (1, 2, 32, 8) for a in state.values())


@pytest.mark.integration
@pytest.mark.parametrize("prompt_len", [3, 8, 13])  # pads to 8, exactly 8, pads to 16
def test_greedy_tokens_match_torch_engine(pair, prompt_len):
    model, engine = pair
    prompt = [(7 * i + 3) % 48 for i in range(prompt_len)]
    torch_engine = TorchEngine(model)
    expected = list(torch_engine.generate(prompt, max_new_tokens=12))
    assert list(engine.generate(prompt, max_new_tokens=12)) == expected
    assert engine.position == prompt_len + 11
    # fp16 KV state: logits agree to fp16 precision, not bit for bit
    torch.testing.assert_close(engine.prefill(prompt), torch_engine.prefill(prompt), atol=5e-3, rtol=5e-3)


@pytest.mark.integration
def test_continue_generate_and_rollback(pair):
    model, engine = pair
    prompt, tool_result = [1, 2, 3, 4], [9, 10, 11]
    torch_engine = TorchEngine(model)
    expected_first = list(torch_engine.generate(prompt, max_new_tokens=5))
    expected_second = list(torch_engine.continue_generate(tool_result, max_new_tokens=5))
    assert list(engine.generate(prompt, max_new_tokens=5)) == expected_first
    assert list(engine.continue_generate(tool_result, max_new_tokens=5)) == expected_second
    engine.rollback(len(prompt) + 2)
    assert list(engine.continue_generate([expected_first[2]], max_new_tokens=2)) == expected_first[3:5]


@pytest.mark.integration
def test_prompt_cache_over_coreml_state(pair):
    model, engine = pair
    system = [1, 5, 6, 7, 2]
    cached = PromptCachedEngine(engine, PromptCache(10**7), prefix_until(2))
    torch_engine = TorchEngine(model)
    for user in ([20, 21], [30, 31, 32]):
        expected = list(torch_engine.generate(system + user, max_new_tokens=8))
        assert list(cached.generate(system + user, max_new_tokens=8)) == expected
    assert cached.cache.stats.hits == 1


@pytest.mark.integration
def test_prompt_longer_than_enumerated_shapes_is_refused(pair):
    _, engine = pair
    with pytest.raises(ValueError, match="largest enumerated length 16"):
        engine.prefill(list(range(17)))


def test_contract_fields_are_required():
    with pytest.raises(ValueError, match="enumerated_lengths"):
        CoreMLEngine(None, None, {"kv": {}, "model_config": {}})  # type: ignore[arg-type]


@pytest.mark.integration
@pytest.mark.requires_macos
def test_coreml_greedy_identical_to_torch_engine(make_model, tmp_path):
    """Real Core ML: export a tiny model, load both packages, compare greedy tokens."""
    from distillgates.config import ExportConfig
    from distillgates.export.api import export_transformer

    model = make_model(0, max_seq_len=32)
    result = export_transformer(model, ExportConfig(quantize="none"), LENGTHS, tmp_path, tokenizer_fingerprint="t")
    engine = CoreMLEngine.from_export_dir(result.out_dir)
    for prompt in ([1, 2, 3], list(range(3, 15))):
        expected = list(TorchEngine(model).generate(prompt, max_new_tokens=10))
        assert list(engine.generate(prompt, max_new_tokens=10)) == expected
