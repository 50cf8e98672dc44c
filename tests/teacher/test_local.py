"""Local HF teacher: logits, top-k, generation (single and batched), chat rendering."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from distillgates.data.chat import render_messages, render_prompt


def test_render_messages_matches_the_dataset_prompt(toy_items):
    for item in toy_items:
        assert render_messages(item["messages"]) == render_prompt(item)


def test_logits_and_topk_logprobs(tiny_teacher, toy_items):
    ids = torch.tensor([tiny_teacher.encode(render_prompt(toy_items[0]))[:20]])
    logits = tiny_teacher.logits(ids)
    assert logits.shape == (1, 20, len(tiny_teacher.tokenizer))
    values, top = tiny_teacher.topk_logprobs(ids, k=5)
    expected_values, expected_ids = F.log_softmax(logits, dim=-1).topk(5, dim=-1)
    torch.testing.assert_close(values, expected_values)
    assert torch.equal(top, expected_ids)


def test_greedy_generation_records_the_teacher_forced_topk(tiny_teacher, toy_items):
    prompt = tiny_teacher.encode(render_prompt(toy_items[0]))
    gen = tiny_teacher.generate(prompt, max_new_tokens=8, top_k=3)
    assert gen.finish_reason == "length" and len(gen.token_ids) == 8
    # Teacher forcing over prompt + generation gives the same distributions at each generated step.
    values, top = tiny_teacher.topk_logprobs(torch.tensor([prompt + gen.token_ids]), k=3)
    steps = slice(len(prompt) - 1, len(prompt) - 1 + 8)
    assert top[0, steps].tolist() == gen.topk_ids
    torch.testing.assert_close(values[0, steps], torch.tensor(gen.topk_logprobs), atol=1e-4, rtol=1e-4)
    assert gen.token_ids == [row[0] for row in gen.topk_ids]  # greedy = argmax
    assert gen.text == tiny_teacher.tokenizer.decode(gen.token_ids)


def test_stop_id_ends_generation_and_keeps_its_distribution(tiny_teacher, toy_items):
    prompt = tiny_teacher.encode(render_prompt(toy_items[1]))
    free = tiny_teacher.generate(prompt, max_new_tokens=6, top_k=3)
    stop_id = free.token_ids[2]
    first = free.token_ids.index(stop_id)
    gen = tiny_teacher.generate(prompt, max_new_tokens=6, stop_ids=[stop_id], top_k=3)
    assert gen.finish_reason == "stop"
    assert gen.token_ids == free.token_ids[:first]
    assert gen.stop_topk_ids == free.topk_ids[first]


def test_batched_generation_equals_one_by_one(tiny_teacher, toy_items):
    prompts = [tiny_teacher.encode(render_prompt(it)) for it in toy_items[:3]]
    assert len({len(p) for p in prompts}) > 1  # left padding is exercised
    batched = tiny_teacher.generate_batch(prompts, max_new_tokens=6, top_k=3)
    for prompt, gen in zip(prompts, batched):
        single = tiny_teacher.generate(prompt, max_new_tokens=6, top_k=3)
        assert gen.token_ids == single.token_ids
        torch.testing.assert_close(
            torch.tensor(gen.topk_logprobs), torch.tensor(single.topk_logprobs), atol=1e-4, rtol=0
        )


def test_sampling_is_seeded(tiny_teacher, toy_items):
    prompt = tiny_teacher.encode(render_prompt(toy_items[0]))
    a = tiny_teacher.generate(prompt, max_new_tokens=8, temperature=1.5, seed=1)
    b = tiny_teacher.generate(prompt, max_new_tokens=8, temperature=1.5, seed=1)
    assert a.token_ids == b.token_ids
    assert len(a.token_logprobs) == 8


def test_complete_returns_a_deterministic_request_id(tiny_teacher, toy_items):
    messages = toy_items[0]["messages"]
    a = tiny_teacher.complete(messages, max_new_tokens=4, top_k=2)
    b = tiny_teacher.complete(messages, max_new_tokens=4, top_k=2)
    assert a == b and a.request_id.startswith("local-")
    assert a.prompt_tokens == len(tiny_teacher.encode(render_prompt(toy_items[0])))
