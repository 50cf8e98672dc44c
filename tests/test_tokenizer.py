"""Tokenizer: exact byte-level round trip, single-id specials, fingerprints, determinism, offsets."""

from __future__ import annotations

import itertools
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import pre_tokenizers

from distillgates.data.chat import render_conversation
from distillgates.data.generator import generate_items
from distillgates.tokenizer import (
    SPECIAL_TOKENS,
    chat_template_text,
    decode,
    encode,
    gpt2_byte_decoder,
    load_tokenizer,
    save_tokenizer,
    tokenizer_fingerprint,
    train_tokenizer,
)

CORPUS = [render_conversation(item) for item in generate_items(0, 200)]


@pytest.fixture(scope="module")
def tok():
    return train_tokenizer(CORPUS, vocab_size=512)


@settings(max_examples=200, deadline=None)
@given(st.text())
def test_round_trip_arbitrary_unicode(tok, text):
    assert decode(tok, encode(tok, text)) == text


@settings(max_examples=100, deadline=None)
@given(st.lists(st.one_of(st.text(max_size=20), st.sampled_from(SPECIAL_TOKENS)), max_size=8))
def test_round_trip_with_special_tokens(tok, parts):
    text = "".join(parts)
    assert decode(tok, encode(tok, text)) == text


def test_special_tokens_are_single_ids_in_context(tok):
    ids = tok.convert_tokens_to_ids(list(SPECIAL_TOKENS))
    assert ids == list(range(len(SPECIAL_TOKENS)))
    for token, token_id in zip(SPECIAL_TOKENS, ids):
        assert encode(tok, token) == [token_id]
        assert encode(tok, f"ab{token}cd").count(token_id) == 1
    assert (tok.bos_token, tok.eos_token, tok.pad_token) == ("<|bos|>", "<|eos|>", "<|pad|>")
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (0, 1, 2)


def test_nothing_added_automatically(tok):
    assert tok("hello", add_special_tokens=True)["input_ids"] == encode(tok, "hello")


def test_vocab_size_is_reached_and_checked(tok):
    assert len(tok) == 512
    with pytest.raises(ValueError, match="vocab_size must be >="):
        train_tokenizer(CORPUS, vocab_size=100)


def test_fingerprint_stable_across_save_load(tok, tmp_path):
    save_tokenizer(tok, tmp_path / "tok")
    loaded = load_tokenizer(tmp_path / "tok")
    assert tokenizer_fingerprint(loaded) == tokenizer_fingerprint(tok)
    text = CORPUS[0]
    assert encode(loaded, text) == encode(tok, text)
    assert loaded.pad_token_id == tok.pad_token_id


def test_fingerprint_changes_with_vocab(tok):
    assert tokenizer_fingerprint(train_tokenizer(CORPUS, vocab_size=511)) != tokenizer_fingerprint(tok)
    assert tokenizer_fingerprint(train_tokenizer(CORPUS[:100], vocab_size=512)) != tokenizer_fingerprint(tok)


def test_training_is_deterministic_across_processes(tok, tmp_path):
    """A fresh interpreter (new hash seed) trains the same tokenizer from the same corpus."""
    script = (
        "from distillgates.data.chat import render_conversation\n"
        "from distillgates.data.generator import generate_items\n"
        "from distillgates.tokenizer import train_tokenizer, tokenizer_fingerprint\n"
        "corpus = [render_conversation(i) for i in generate_items(0, 200)]\n"
        "print(tokenizer_fingerprint(train_tokenizer(corpus, vocab_size=512)))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, check=True, env={"PYTHONHASHSEED": "123"}
    )
    assert out.stdout.strip() == tokenizer_fingerprint(tok)


def test_gpt2_byte_decoder_spells_every_token_as_its_bytes(tok):
    decoder = gpt2_byte_decoder()
    assert sorted(decoder.values()) == list(range(256))  # a bijection onto the bytes
    assert set(decoder) == set(pre_tokenizers.ByteLevel.alphabet())  # the alphabet the BPE spells tokens in
    special = set(tok.all_special_ids)
    for token_id in range(len(tok)):
        if token_id not in special:
            piece = tok.convert_ids_to_tokens(token_id)
            assert bytes(decoder[c] for c in piece).decode("utf-8", "replace") == tok.decode([token_id])


def test_offsets_cover_the_text(tok):
    text = next(t for t in CORPUS if t.isascii())
    enc = tok(text, add_special_tokens=False, return_offsets_mapping=True)
    offsets = enc["offset_mapping"]
    assert offsets[0][0] == 0 and offsets[-1][1] == len(text)
    assert all(prev[1] == cur[0] for prev, cur in itertools.pairwise(offsets))  # untrimmed: no gaps
    assert [decode(tok, [i]) for i in enc["input_ids"]] == [text[s:e] for s, e in offsets]


def test_load_missing_directory_is_a_clear_error(tmp_path: Path):
    with pytest.raises(FileNotFoundError, match=r"no tokenizer\.json"):
        load_tokenizer(tmp_path)


def test_a_tokenizer_without_a_chat_template_is_refused_naming_the_field(tmp_path: Path):
    """``load_tokenizer`` names the file and the field of a tokenizer with no chat template (and none of the toy's
    special tokens to give it the toy's); ``chat_template_text`` names the setting."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    plain = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel({"a": 0, "[UNK]": 1}, "[UNK]")))
    plain.save_pretrained(tmp_path / "plain")
    with pytest.raises(ValueError, match=r"tokenizer_config\.json: chat_template: the tokenizer has no chat template"):
        load_tokenizer(tmp_path / "plain")
    # a config's template stands in
    assert load_tokenizer(tmp_path / "plain", "{{ messages }}").chat_template == "{{ messages }}"
    with pytest.raises(ValueError, match=r"tokenizer\.chat_template: expected one of .* or a \.jinja file"):
        chat_template_text("fancy", "tokenizer.chat_template")
    with pytest.raises(FileNotFoundError, match=r"tokenizer\.chat_template: no template file"):
        chat_template_text(str(tmp_path / "missing.jinja"), "tokenizer.chat_template")


def test_the_builtin_template_names_are_the_configs() -> None:
    from distillgates.config import BUILTIN_CHAT_TEMPLATES
    from distillgates.tokenizer import CHAT_TEMPLATES

    assert tuple(CHAT_TEMPLATES) == BUILTIN_CHAT_TEMPLATES


def test_the_gemma_template_writes_gemma_turns_with_hermes_calls() -> None:
    """``chat_template: gemma``: Gemma 3's turns (no system role: the system message opens the first user turn),
    calls as Hermes JSON in a model turn, consecutive results in one user turn; its stop token is ``<end_of_turn>``."""
    from distillgates.data.chat import ChatFormat
    from distillgates.tokenizer import template_tokenizer

    fmt = ChatFormat(template_tokenizer("gemma"))
    assert fmt.tool_call_format == "hermes" and fmt.stop_tokens == ["<end_of_turn>", "<eos>"]
    call = {"type": "function", "function": {"name": "f", "arguments": {"a": 1}}}
    text = fmt.render([{"role": "system", "content": "S"}, {"role": "user", "content": "Q"},
                       {"role": "assistant", "content": "", "tool_calls": [call]}, {"role": "tool", "content": "1"},
                       {"role": "tool", "content": "2"}, {"role": "assistant", "content": "done"}])
    assert text == ("<bos><start_of_turn>user\nS\n\nQ<end_of_turn>\n<start_of_turn>model\n<tool_call>\n"
                    '{"name": "f", "arguments": {"a": 1}}\n</tool_call><end_of_turn>\n<start_of_turn>user\n'
                    "<tool_response>\n1\n</tool_response>\n<tool_response>\n2\n</tool_response><end_of_turn>\n"
                    "<start_of_turn>model\ndone<end_of_turn>\n")
    assert fmt.parse_turn(fmt.assistant_text("", [{"name": "f", "arguments": {"a": 1}}])).calls == [
        {"name": "f", "arguments": {"a": 1}}]
