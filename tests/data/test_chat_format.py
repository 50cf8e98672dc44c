"""Prompt wrapper: rendering, parsing and the shared system-prompt prefix."""

from __future__ import annotations

from distillgates.data.chat import (
    parse_assistant_turn,
    parse_transcript,
    prompt_wrapper_sha256,
    render_conversation,
    render_prompt,
    system_prompt,
)
from distillgates.data.registry import TOOLS


def test_system_prompt_lists_every_tool_and_is_shared_per_locale(toy_items):
    for locale in ("en", "de"):
        assert all(tool["name"] in system_prompt(locale) for tool in TOOLS)
        prompts = {item["messages"][0]["content"] for item in toy_items if item["locale"] == locale}
        assert prompts == {system_prompt(locale)}
    assert system_prompt("en") != system_prompt("de")


def test_render_prompt_layout(toy_items):
    item = toy_items[0]
    prompt = render_prompt(item)
    sys_text, user = item["messages"][0]["content"], item["messages"][1]["content"]
    assert prompt == f"<|bos|><|system|>{sys_text}<|end|><|user|>{user}<|end|><|assistant|>"
    assert render_conversation(item) == prompt + item["reference"]
    assert render_conversation(item).endswith("<|end|><|eos|>")


def test_references_parse_back_to_expected_calls(toy_items):
    for item in toy_items:
        calls, answer = parse_transcript(item["reference"])
        assert calls == item["expected_calls"], item["id"]
        assert answer is not None and "<|" not in answer


def test_parse_assistant_turn_cases():
    assert parse_assistant_turn('Sure.<|tool_call|>{"name":"calculate","arguments":{}}<|end|>') == {
        "name": "calculate",
        "arguments": {},
    }
    assert parse_assistant_turn('<|tool_call|>{"name":"calcul') is None
    assert parse_assistant_turn("It is 3.<|end|><|eos|>") == "It is 3."


def test_prompt_wrapper_sha_is_stable():
    assert prompt_wrapper_sha256() == prompt_wrapper_sha256()
    assert len(prompt_wrapper_sha256()) == 64
