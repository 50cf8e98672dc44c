"""Process-step targets: character spans -> token masks through the tokenizer offsets.

Mask definition under test: a token is masked iff its offsets overlap the span, so the masked run
is contiguous and decodes to text that contains the span (exactly the span where the
pre-tokenizer aligns boundaries, as for tool names and argument values).
"""

from __future__ import annotations

import json

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from distillgates.data.chat import render_conversation
from distillgates.data.targets import SPAN_KINDS, encode_item, process_masks, reference_spans
from distillgates.tokenizer import decode


def _runs(mask):
    """Contiguous runs of True as (start, end) token ranges."""
    runs, start = [], None
    for i, flag in enumerate([*mask, False]):
        if flag and start is None:
            start = i
        elif not flag and start is not None:
            runs.append((start, i))
            start = None
    return runs


@st.composite
def text_and_span(draw):
    text = draw(st.text(min_size=1, max_size=60))
    a = draw(st.integers(0, len(text) - 1))
    b = draw(st.integers(a + 1, len(text)))
    return text, (a, b)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text_and_span())
def test_masked_tokens_decode_to_text_containing_the_span(toy_tokenizer, case):
    text, (a, b) = case
    ids, masks = process_masks(toy_tokenizer, text, {"span": [(a, b)]})
    runs = _runs(masks["span"])
    assert len(runs) == 1  # one span -> one contiguous run of tokens
    start, end = runs[0]
    assert text[a:b] in decode(toy_tokenizer, ids[start:end])
    offsets = toy_tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"]
    assert offsets[start][0] <= a and offsets[end - 1][1] >= b  # covers the span
    assert all(offsets[i][1] <= a or offsets[i][0] >= b for i in range(len(ids)) if not masks["span"][i])


def test_reference_spans_point_at_the_right_text(toy_items):
    for item in toy_items:
        text = render_conversation(item)
        spans = reference_spans(item)
        assert [text[a:b] for a, b in spans["tool_name"]] == [c["name"] for c in item["expected_calls"]]
        args = [json.loads(text[a:b]) for a, b in spans["arguments"]]
        assert args == [c["arguments"] for c in item["expected_calls"]]
        values = [v for c in item["expected_calls"] for v in c["arguments"].values()]
        values = [v if isinstance(v, str) else json.dumps(v) for v in values]
        assert [text[a:b] for a, b in spans["argument_values"]] == values
        assert [text[a:b] for a, b in spans["integration"]] == item["integration_fields"]
        generated = "".join(text[a:b] for a, b in spans["generated"])
        assert "<|tool_result|>" not in generated and generated.endswith("<|end|><|eos|>")
        assert len(spans["generated"]) == len(item["expected_calls"]) + 1


def test_item_masks_decode_to_the_spans(toy_items, toy_tokenizer):
    for item in toy_items[:150]:
        encoded = encode_item(toy_tokenizer, item)
        text = render_conversation(item)
        spans = reference_spans(item)
        assert set(encoded.masks) == set(SPAN_KINDS)
        assert not any(encoded.masks["generated"][: encoded.prompt_len])  # the prompt is never a target
        for kind in SPAN_KINDS:
            runs = _runs(encoded.masks[kind])
            pieces = [decode(toy_tokenizer, encoded.input_ids[s:e]) for s, e in runs]
            for a, b in spans[kind]:
                assert any(text[a:b] in piece for piece in pieces), (item["id"], kind, text[a:b])
        # The pre-tokenizer splits at JSON punctuation, so names and values align exactly.
        for kind in ("tool_name", "argument_values"):
            pieces = [decode(toy_tokenizer, encoded.input_ids[s:e]) for s, e in _runs(encoded.masks[kind])]
            assert "".join(pieces) == "".join(text[a:b] for a, b in spans[kind]), (item["id"], kind)
