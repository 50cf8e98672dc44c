from __future__ import annotations

import pytest
import torch

from distillgates.runtime.base import Engine, sample_token
from distillgates.runtime.torch_engine import TorchEngine


def reference_greedy(model, prompt: list[int], n: int) -> list[int]:
    """Greedy decoding by re-running the full sequence without any cache."""
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(model(torch.tensor([ids]))[0, -1].argmax()))
    return ids[len(prompt) :]


def test_engine_satisfies_protocol(make_model):
    assert isinstance(TorchEngine(make_model(0)), Engine)


def test_greedy_matches_uncached_forward(make_model):
    model = make_model(0, dtype=torch.float64)
    engine = TorchEngine(model)
    prompt = [3, 1, 4, 1, 5]
    out = list(engine.generate(prompt, max_new_tokens=20))
    assert out == reference_greedy(model, prompt, 20)
    assert len(set(out)) > 1  # the test model does not just repeat a token
    # the last token is pending: not in the KV state yet
    assert engine.position == len(prompt) + 19 and engine.pending == out[-1]


def test_prefill_and_decode_logits_match_forward(make_model):
    model = make_model(1)
    engine = TorchEngine(model)
    ids = [5, 6, 7, 8]
    full = model(torch.tensor([[*ids, 9]]))[0]  # (T, V)
    torch.testing.assert_close(engine.prefill(ids), full[3], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(engine.decode_step(9), full[4], atol=1e-5, rtol=1e-5)


def test_second_prefill_resets_state(make_model):
    engine = TorchEngine(make_model(2, dtype=torch.float64))
    first = list(engine.generate([1, 2, 3], max_new_tokens=8))
    list(engine.generate([9, 9, 9, 9, 9, 9, 9], max_new_tokens=8))
    assert list(engine.generate([1, 2, 3], max_new_tokens=8)) == first


def test_continue_generate_equals_one_shot_prompt(make_model):
    """Multi-turn: extending the KV state gives what a fresh prefill of the whole history gives."""
    engine = TorchEngine(make_model(3, dtype=torch.float64))
    prompt, tool_result = [1, 2, 3, 4], [7, 8, 9]
    first = list(engine.generate(prompt, max_new_tokens=5))
    second = list(engine.continue_generate(tool_result, max_new_tokens=6))
    history = prompt + first + tool_result
    assert engine.tokens == history + second[:-1]
    fresh = TorchEngine(make_model(3, dtype=torch.float64))
    assert list(fresh.generate(history, max_new_tokens=6)) == second


def test_stop_id_is_yielded_and_ends_stream(make_model):
    engine = TorchEngine(make_model(4, dtype=torch.float64))
    free = list(engine.generate([1, 2, 3], max_new_tokens=12))
    stop = free[5]
    stopped = list(engine.generate([1, 2, 3], max_new_tokens=12, stop_ids=[stop]))
    assert stopped == free[: free.index(stop) + 1]


def test_decode_step_rejects_other_token_while_one_is_pending(make_model):
    engine = TorchEngine(make_model(5))
    out = list(engine.generate([1, 2], max_new_tokens=3))
    with pytest.raises(ValueError, match="pending"):
        engine.decode_step((out[-1] + 1) % 48)
    engine.decode_step(out[-1])  # writing the pending token itself is the normal path


def test_rollback_then_regenerate(make_model):
    engine = TorchEngine(make_model(6, dtype=torch.float64))
    prompt = [4, 5, 6]
    out = list(engine.generate(prompt, max_new_tokens=10))
    engine.rollback(len(prompt) + 2)  # keep prompt + first 2 generated tokens
    tail = list(engine.continue_generate([out[2]], max_new_tokens=7))
    assert tail == out[3:10]


def test_sequence_longer_than_cache_is_refused(make_model):
    engine = TorchEngine(make_model(0, max_seq_len=16))
    with pytest.raises(ValueError, match="max_seq_len"):
        engine.prefill(list(range(17)))
    engine.prefill(list(range(15)))
    engine.decode_step(1)
    with pytest.raises(ValueError, match="max_seq_len"):
        engine.decode_step(2)


def test_sampling_is_seeded_and_top_p_narrows(make_model):
    engine = TorchEngine(make_model(7))
    a = list(engine.generate([1, 2, 3], max_new_tokens=15, temperature=1.5, seed=11))
    b = list(engine.generate([1, 2, 3], max_new_tokens=15, temperature=1.5, seed=11))
    c = list(engine.generate([1, 2, 3], max_new_tokens=15, temperature=1.5, seed=12))
    assert a == b and a != c
    # a nucleus smaller than any single token's mass keeps only the argmax: greedy
    greedy = list(engine.generate([1, 2, 3], max_new_tokens=15))
    assert list(engine.generate([1, 2, 3], max_new_tokens=15, temperature=1.0, top_p=1e-6, seed=3)) == greedy


def test_top_p_keeps_exactly_the_nucleus():
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    gen = torch.Generator().manual_seed(0)
    drawn = {sample_token(logits, 1.0, 0.7, gen) for _ in range(300)}
    assert drawn == {0, 1}  # 0.5 < 0.7 needs the second token; the third is outside
    with pytest.raises(ValueError):
        sample_token(logits, -1.0, 1.0, gen)


def test_logits_processor_sees_generated_ids_and_masks(make_model):
    engine = TorchEngine(make_model(8))
    seen: list[list[int]] = []

    def only_even(generated: list[int], logits: torch.Tensor) -> torch.Tensor:
        seen.append(list(generated))
        masked = torch.full_like(logits, float("-inf"))
        masked[::2] = logits[::2]
        return masked

    out = list(engine.generate([1, 2, 3], max_new_tokens=6, logits_processor=only_even))
    assert all(t % 2 == 0 for t in out)
    assert seen == [out[:i] for i in range(6)]


def test_batch_matches_single_rows(make_model):
    model = make_model(9, dtype=torch.float64)
    engine = TorchEngine(model, max_batch_size=3)
    prompts = [[1, 2, 3, 4, 5], [6, 7], [8, 9, 10]]
    batch = engine.generate_batch(prompts, max_new_tokens=10)
    singles = [list(engine.generate(p, max_new_tokens=10)) for p in prompts]
    assert batch == singles
    logits = engine.prefill_batch(prompts)  # (B, V)
    for row, prompt in enumerate(prompts):
        # RoPE tables are float32: shifted positions agree to ~1e-7, not to float64 precision
        torch.testing.assert_close(logits[row], engine.prefill(prompt), atol=1e-5, rtol=1e-5)


def test_long_batch_prefill_matches_single_rows(make_model):
    """Prompts of different lengths through ``last_only`` (the last layer computes the last position only)."""
    engine = TorchEngine(make_model(11, dtype=torch.float64), max_batch_size=2)
    prompts = [list(range(1, 25)), list(range(30, 47))]
    logits = engine.prefill_batch(prompts)  # (B, V)
    for row, prompt in enumerate(prompts):
        torch.testing.assert_close(logits[row], engine.prefill(prompt), atol=1e-5, rtol=1e-5)
    assert engine.generate_batch(prompts, max_new_tokens=6) == [
        list(engine.generate(p, max_new_tokens=6)) for p in prompts
    ]


def test_batch_stop_ids_per_row(make_model):
    engine = TorchEngine(make_model(10, dtype=torch.float64), max_batch_size=2)
    prompts = [[1, 2, 3], [4, 5]]
    free = engine.generate_batch(prompts, max_new_tokens=10)
    stop = free[0][2]
    stopped = engine.generate_batch(prompts, max_new_tokens=10, stop_ids=[stop])
    for row in range(2):
        expect = free[row][: free[row].index(stop) + 1] if stop in free[row] else free[row]
        assert stopped[row] == expect
    with pytest.raises(ValueError, match="max_batch_size"):
        engine.prefill_batch([[1], [2], [3]])


@pytest.mark.integration  # torch.compile (inductor, C++ build) takes ~20 s on 2 cores
def test_compiled_decode_matches_eager(make_model):
    model = make_model(11)
    eager = list(TorchEngine(model).generate([1, 2, 3], max_new_tokens=6))
    compiled = list(TorchEngine(model, compile=True).generate([1, 2, 3], max_new_tokens=6))
    assert compiled == eager


def test_write_rows_continues_each_row_as_alone(make_model):
    """Continuous batching: rows at their own positions, chunks of different lengths, a subset of the rows per
    write, a row reused for a new conversation (its stale slots past the new positions are never attended)."""
    batched = TorchEngine(make_model(12, dtype=torch.float64), max_batch_size=3)
    single = TorchEngine(make_model(12, dtype=torch.float64))

    def alone(tokens: list[int]) -> torch.Tensor:
        return single.prefill(tokens)

    convs = {0: [5, 6, 7, 8, 9, 10, 11], 2: [1, 2]}
    logits = batched.write_rows([2, 0], [convs[2], convs[0]], [0, 0])
    torch.testing.assert_close(logits[0], alone(convs[2]))
    torch.testing.assert_close(logits[1], alone(convs[0]))
    convs[1] = list(range(20, 40))  # a long prompt in row 1 alone, rows 0 and 2 untouched
    torch.testing.assert_close(batched.write_rows([1], [convs[1]], [0])[0], alone(convs[1]))
    for step in range(4):  # one token per row, each at its own position; then a chunk in row 2 only
        new = {row: [3 + step + row] for row in convs}
        rows = sorted(convs)
        logits = batched.write_rows(rows, [new[r] for r in rows], [len(convs[r]) for r in rows])
        for i, row in enumerate(rows):
            convs[row] += new[row]
            torch.testing.assert_close(logits[i], alone(convs[row]))
    convs[2] += [7, 8, 9]
    torch.testing.assert_close(batched.write_rows([2], [[7, 8, 9]], [len(convs[2]) - 3])[0], alone(convs[2]))
    convs[0] = [4, 4]  # row 0 starts over: its old slots 2.. are stale
    torch.testing.assert_close(batched.write_rows([0, 2], [[4, 4], [1]], [0, len(convs[2])])[0], alone(convs[0]))
    with pytest.raises(ValueError, match="leave the last of"):
        batched.write_rows([0], [[1] * batched.max_seq_len], [0])
    with pytest.raises(ValueError, match="outside the engine's max_batch_size"):
        batched.write_rows([3], [[1]], [0])
