"""Core ML engine orchestration on Linux (stand-in backend) and real Core ML on macOS."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from distillgates.export.lint import ANE_MAX_DIM
from distillgates.runtime.coreml_engine import CoreMLEngine, ExportedProgramStandIn, join_logits, stand_in_engine
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
    assert sorted(engine.prefill_runners) == LENGTHS
    assert all(isinstance(r, ExportedProgramStandIn) for r in engine.prefill_runners.values())
    state = engine.decode_runner.new_state()
    assert sorted(state) == sorted(f"{k}_cache_{i}" for i in range(2) for k in "kv")
    assert all(a.dtype == np.float16 and a.shape == (1, 2, 32, 8) for a in state.values())


@pytest.mark.integration
@pytest.mark.parametrize("prompt_len", [3, 8, 13, 21])  # pads to 8, exactly 8, pads to 16, 16 then 5 decode steps
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


def _with_shared_state(engine: CoreMLEngine, shared: bool) -> CoreMLEngine:
    contract = {**engine.contract, "kv": {**engine.contract["kv"], "shared_state": shared}}
    return CoreMLEngine(engine.prefill_runners, engine.decode_runner, contract)


@pytest.mark.integration
def test_shared_state_prefill_writes_the_decode_state_without_a_copy(pair, monkeypatch):
    """kv.shared_state: the prefill function runs on the decode state itself (one MLState), nothing is copied;
    without it the prompt's KV is copied over, with the same tokens either way."""
    model, engine = pair
    prompt = [(5 * i + 1) % 48 for i in range(11)]
    expected = list(TorchEngine(model).generate(prompt, max_new_tokens=8))
    copies: list[str] = []
    for runner in {id(r): r for r in [*engine.prefill_runners.values(), engine.decode_runner]}.values():
        monkeypatch.setattr(runner, "write_state", lambda state, name, value: copies.append(name))
        monkeypatch.setattr(runner, "read_state", lambda state, name: copies.append(name))
    shared = _with_shared_state(engine, True)
    assert list(shared.generate(prompt, max_new_tokens=8)) == expected and copies == []
    assert np.abs(shared.state["k_cache_0"][0, :, : len(prompt)]).max() > 0  # the prompt's keys, in the decode state
    monkeypatch.undo()
    assert list(_with_shared_state(engine, False).generate(prompt, max_new_tokens=8)) == expected


@pytest.mark.integration
def test_a_prompt_beyond_the_kv_state_is_refused_before_anything_runs(pair):
    _, engine = pair
    list(engine.generate([1, 2, 3], max_new_tokens=2))
    with pytest.raises(ValueError, match="prompt of 33 tokens exceeds max_seq_len 32"):
        engine.prefill(list(range(33)))
    assert engine.tokens[:3] == [1, 2, 3]  # the state was not touched


def test_contract_fields_are_required():
    with pytest.raises(ValueError, match="enumerated_lengths"):
        CoreMLEngine(None, None, {"kv": {}, "model_config": {}, "packages": {}})  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="packages"):
        CoreMLEngine({}, None, {"enumerated_lengths": [8], "kv": {}, "model_config": {}})  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"prefill runners for lengths \[\], contract.json enumerates \[8\]"):
        CoreMLEngine({}, None, {"enumerated_lengths": [8], "kv": {}, "model_config": {}, "packages": {}})  # type: ignore[arg-type]
    contract = {"enumerated_lengths": [8], "kv": {"state_names": []}, "model_config": {"max_seq_len": 8},
                "packages": {"model": {"functions": {"decode": {"outputs": []}}}}}  # fmt: skip
    with pytest.raises(ValueError, match="no package lists the function 'prefill_8'"):
        CoreMLEngine({8: None}, None, contract)  # type: ignore[dict-item,arg-type]


def test_join_logits_concatenates_chunks_in_contract_order():
    outputs = {"logits_1": np.array([[3.0, 4.0]], dtype=np.float16), "logits_0": np.array([[1.0, 2.0, 2.5]])}
    joined = join_logits(outputs, ["logits_0", "logits_1"])
    assert joined.dtype == torch.float32 and joined.tolist() == [1.0, 2.0, 2.5, 3.0, 4.0]
    assert join_logits({"logits": np.array([[5.0, 6.0]])}, ["logits"]).tolist() == [5.0, 6.0]
    with pytest.raises(ValueError, match=r"no outputs \['logits_1'\].*contract.json lists"):
        join_logits({"logits_0": np.zeros((1, 2))}, ["logits_0", "logits_1"])


@pytest.mark.integration  # torch.export of both wrappers with a 16400-row head (~10 s)
def test_split_lm_head_engine_matches_torch_engine(make_model):
    """A vocabulary above the ANE limit: the programs return head chunks, the engine joins them."""
    model = make_model(0, vocab_size=ANE_MAX_DIM + 16, max_seq_len=32)
    engine = stand_in_engine(model, LENGTHS)
    assert engine.logits_names == {8: ["logits_0", "logits_1"], 16: ["logits_0", "logits_1"],
                                   "decode": ["logits_0", "logits_1"]}  # fmt: skip
    torch_engine = TorchEngine(model)
    prompt = [5, 9000, 16390, 3, 12000]
    assert list(engine.generate(prompt, max_new_tokens=6)) == list(torch_engine.generate(prompt, max_new_tokens=6))
    torch.testing.assert_close(engine.prefill(prompt), torch_engine.prefill(prompt), atol=5e-3, rtol=5e-3)


@pytest.mark.integration
@pytest.mark.requires_macos
@pytest.mark.parametrize("vocab_size", [48, ANE_MAX_DIM + 16], ids=["one-head", "split-head"])
def test_coreml_greedy_identical_to_torch_engine(make_model, tmp_path, vocab_size):
    """Real Core ML: export a tiny model, load each function of the multifunction package, compare greedy tokens
    (a vocabulary above the ANE limit: the functions output head chunks that the engine concatenates), with
    one shared MLState (the contract says the functions share it) and with the state copied."""
    from distillgates.config import ExportConfig
    from distillgates.export.api import export_transformer

    model = make_model(0, vocab_size=vocab_size, max_seq_len=32)
    result = export_transformer(model, ExportConfig(quantize="none"), LENGTHS, tmp_path, tokenizer_fingerprint="t")
    engine = CoreMLEngine.from_export_dir(result.out_dir)
    assert engine.shared_state and result.contract["kv"]["shared_state"]
    for prompt in ([1, 2, 3], list(range(3, 15))):
        expected = list(TorchEngine(model).generate(prompt, max_new_tokens=10))
        assert list(engine.generate(prompt, max_new_tokens=10)) == expected
        assert list(_with_shared_state(engine, False).generate(prompt, max_new_tokens=10)) == expected
