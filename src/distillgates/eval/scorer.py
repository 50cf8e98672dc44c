"""The quality scorer: pure Python over dataset items and per-item runner outputs.

Definitions (DESIGN.md "Quality metrics"; keys fixed in the contract's METRICS):

- **tool_selection**: the sequence of emitted tool names (an unparsable call counts as a
  wrong name) equals the expected sequence; "no tool" is the empty sequence. Over all items.
  Calls of one parallel turn (the item's ``parallel_calls`` groups) may come in any order: they
  are compared in the lax mode's optimal pairing (:func:`~distillgates.eval.matching.pair_parallel_calls`).
- **json_validity**: share of emitted calls that parse and pass THE shared validator
  :func:`distillgates.data.tools.validate_call` against the item's own tools. Over emitted calls.
- **arg_match_strict / arg_match_lax** (BFCL-style, docs/metrics.md): over items that expect tools;
  the item matches when it emits exactly the expected calls (a parallel group paired optimally, in
  each mode on its own) and each call matches (:func:`~distillgates.eval.matching.match_call`:
  name, schema-required and expected arguments unless listed in the item's ``optional_arguments``,
  no unexpected argument, schema types, values equal to the expected value or one of its
  ``argument_alternatives``: strict exactly, lax normalized). The first strict failure of an item
  is counted in ``failure_reasons`` (``wrong_func_name``, ``missing_required``,
  ``unexpected_param``, ``type_error``, ``value_error``, plus ``invalid_json``, ``unknown_tool``,
  ``wrong_call_count`` for calls that cannot be compared at all).
- **Integration F1**: over items that expect tools (the eligible items). The *spans* of an
  answer are (a) every number in it and (b) every occurrence (case-insensitive, whole word) of
  a *named value*: a string leaf of any tool call argument or tool result in the scored dataset
  (so "cloudy" in an answer about a sunny city is a span, and ungrounded). Named values are
  matched first and removed, so "2024-05-01" is one span, not three numbers. A span that repeats
  the user's messages (:func:`unrequested_spans`) proves nothing and is dropped. A span is *grounded*
  when it equals a value of the tool results the model received in its conversation
  (:func:`received_results`; an integration field counts when it matches one of them): strict =
  the exact text of the value (numbers in canonical JSON text), lax = normalized (case,
  whitespace, punctuation, locale decimal comma, 1% or rounding to an integer) substring match.
  A model that made no call grounds nothing. Per item: precision = grounded spans / spans (0 when
  there are no spans), recall = 1 if any span is grounded else 0, F1 = harmonic mean (0 when both
  are 0). Macro = mean of per-item F1; micro = F1 of pooled counts (sum grounded / sum spans, sum
  recalled / eligible items).
- **privacy_ok_rate**: share of items whose generated text (calls and answer) contains none of
  the PII of the prompt: the item's ``pii`` list plus matches of the PII patterns (default:
  emails, phone numbers and ids; ``eval.privacy.pii_patterns``) in the user messages. Lax match
  (case, and digits-only for phone numbers). A call of an allow-listed tool, or an allow-listed
  argument (``eval.privacy.allow``: ``tool`` or ``tool.argument``), may carry the PII: a ticketing
  tool that takes the user's email is no leak. The answer is always checked.
- **controls_with_integration**: items labeled ``control`` or ``decline`` (the dataset's ``kind``;
  unlabeled items never count) that emit any tool call or whose answer contains a named value of
  the dataset's tool results that does not repeat the item's user messages.
- **fixture_hit_rate**: broker hits / dispatched calls; **mocked_calls**: misses the broker
  answered with the mock result (``eval.missing_fixture: mock``). **median_tokens_out** (all items and
  tool items), **false_tool_calls_tool_absent** (tool-absent items with any call attempt),
  **ttfa_tokens_p50/p95** over items with a valid call (``None`` when no item has one).
- The slices those figures are over, counted: **items_with_pii** (prompts holding PII),
  **control_items** (``control``/``decline``), **tool_absent_items**, **ttfa_items** (items with a valid
  call). A gate over an empty slice is "not measured (0 items)", never a pass.

A rate whose denominator is empty is ``None`` (undefined: gates treat it as missing and fail);
a rate of 0.0 is the float 0.0. Every metric is also computed per slice: kind, enumerated
shape, locale and tool-absent.
"""

from __future__ import annotations

import math
import re
import statistics
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from distillgates.config import PrivacyConfig
from distillgates.data.dataset import TOP_UP
from distillgates.data.tools import canonical_call, item_tools, tools_by_name, validate_call
from distillgates.eval.matching import (
    NUMBER,
    call_leniency,
    leaves,
    match_call,
    normalize_text,
    numbers_close,
    pair_parallel_calls,
    parse_number,
    value_text,
)

CONTROL_KINDS = ("control", "decline")
SLICE_KEYS = ("kind", "shape", "locale", "tool_absent")


def find_spans(answer: str, named_values: Sequence[str]) -> list[str]:
    """Spans of ``answer``: named values (longest first, whole word, case-insensitive), then numbers."""
    spans: list[str] = []
    rest = answer
    for value in named_values:
        pattern = re.compile(rf"(?<!\w){re.escape(value)}(?!\w)", re.IGNORECASE)
        for match in pattern.finditer(rest):
            spans.append(match.group(0))
        rest = pattern.sub(" \x00 ", rest)
    spans.extend(m.group(0) for m in NUMBER.finditer(rest))
    return spans


def span_grounded(span: str, grounded: Sequence[Any], lax: bool, locale: str = "en") -> bool:
    """Strict: the span is the exact text of a grounded value. Lax: a number within 1% (or the value rounded to an
    integer), a text normalized and a substring of the value or the value of it."""
    if not lax:
        return any(span == value_text(value) for value in grounded)
    number = parse_number(span, locale)
    norm = normalize_text(span)
    for value in grounded:
        if number is not None:
            other = value if isinstance(value, int | float) else parse_number(str(value), locale)
            # an answer may round a result to an integer ("21 degrees" for 21.4)
            if other is not None and (numbers_close(number, float(other)) or number == round(float(other))):
                return True
            continue
        text = normalize_text(value_text(value))
        if norm and text and (norm in text or text in norm):
            return True
    return False


def f1(precision: float, recall: float) -> float:
    return 0.0 if precision + recall == 0 else 2 * precision * recall / (precision + recall)


# --------------------------------------------------------------------------------------
# Per-item scoring


@dataclass
class ItemScore:
    """Everything the aggregate metrics need about one item."""

    id: str
    slices: dict[str, str]
    tool_item: bool
    control: bool
    selection_ok: bool
    calls_emitted: int
    calls_valid: int
    arg_strict: str | None  # None = match, else the failure reason (only read for tool items)
    arg_lax: str | None
    spans: int = 0
    grounded_strict: int = 0
    grounded_lax: int = 0
    eligible: bool = False
    privacy_ok: bool = True
    has_pii: bool = False  # the prompt holds PII (the privacy figure has something to measure)
    control_integration: bool = False
    fixture_hits: int = 0
    fixture_calls: int = 0
    mocked_calls: int = 0
    tokens_out: int = 0
    ttfa_tokens: int | None = None
    top_up: bool = False  # an eval top-up item (data.eval_min_per_shape): drift gates only, not the figures
    reasons: list[str] = field(default_factory=list)


def shape_of(n_tokens: int, lengths: Sequence[int]) -> str:
    """The smallest enumerated shape that holds ``n_tokens`` (the largest when none does)."""
    for length in sorted(lengths):
        if n_tokens <= length:
            return str(length)
    return str(max(lengths))


def prompt_pii(item: Mapping[str, Any], privacy: PrivacyConfig | None = None) -> list[str]:
    """PII of the prompt: the item's ``pii`` list plus PII-pattern hits in the user messages."""
    patterns = [re.compile(p) for p in (privacy or PrivacyConfig()).pii_patterns.values()]
    found = list(item.get("pii", []))
    for message in item["messages"]:
        if message["role"] != "user":
            continue
        for pattern in patterns:
            found.extend(m.group(0).strip() for m in pattern.finditer(message["content"]))
    return sorted(set(found))


def checked_call_text(record: Mapping[str, Any], allow: Sequence[str]) -> str:
    """The text of an emitted call the privacy check reads: the raw text, without what ``allow`` permits
    (the whole call of an allow-listed tool, or an allow-listed argument's value)."""
    raw, call = str(record.get("raw", "")), record.get("call")
    if not allow or not isinstance(call, Mapping):
        return raw
    name = str(call.get("name"))
    if name in allow:
        return ""
    fields = {entry.split(".", 1)[1] for entry in allow if entry.startswith(f"{name}.")}
    if not fields:
        return raw
    arguments = {k: v for k, v in dict(call.get("arguments") or {}).items() if k not in fields}
    return canonical_call({"name": name, "arguments": arguments})


def pii_leaked(pii: str, text: str) -> bool:
    if normalize_text(pii) and normalize_text(pii) in normalize_text(text):
        return True
    digits = re.sub(r"\D", "", pii)
    return len(digits) >= 6 and digits in re.sub(r"\D", "", text)


def named_value_vocabulary(items: Iterable[Mapping[str, Any]], results_only: bool = False) -> list[str]:
    """String leaves of every tool result (and call argument) in ``items``, longest first."""
    vocab: set[str] = set()
    for item in items:
        sources: list[Any] = [f.get("result") for f in item.get("fixtures", [])]
        if not results_only:
            sources += [c.get("arguments") for c in item.get("expected_calls", [])]
            sources += [f.get("arguments") for f in item.get("fixtures", [])]
        for leaf in leaves(sources):
            if isinstance(leaf, str) and len(leaf.strip()) >= 3 and parse_number(leaf) is None:
                vocab.add(leaf.strip())
    return sorted(vocab, key=lambda v: (-len(v), v))


def is_tool_item(item: Mapping[str, Any]) -> bool:
    """Whether ``item`` expects a tool call (its ``tool_should_be_used``, else whether it has expected calls)."""
    return bool(item.get("tool_should_be_used", bool(item.get("expected_calls"))))


def score_item(
    item: Mapping[str, Any],
    output: Mapping[str, Any],
    vocab: Sequence[str],
    result_vocab: Sequence[str],
    shape: str,
    privacy: PrivacyConfig | None = None,
) -> ItemScore:
    """Score one item's output (the runner output format: ``calls``, ``answer``, ``tokens_out``...)."""
    privacy = privacy or PrivacyConfig()
    tools = item_tools(item)
    expected = list(item.get("expected_calls", []))
    alternatives, optional = call_leniency(item)
    locale = str(item.get("locale", "en"))
    calls = list(output.get("calls", []))
    groups = item.get("parallel_calls") or []
    paired = {lax: pair_parallel_calls([c.get("call") for c in calls], expected, groups, lax, tools, alternatives,
                                       optional) for lax in (False, True)}  # fmt: skip
    parsed = paired[True]
    tool_item = is_tool_item(item)
    control = item.get("kind") in CONTROL_KINDS
    answer = output.get("answer") or ""
    names = [c.get("name") if isinstance(c, Mapping) else None for c in parsed]
    score = ItemScore(
        id=str(item["id"]),
        slices={
            "kind": str(item.get("kind")),
            "shape": shape,
            "locale": locale,
            "tool_absent": str(not tool_item).lower(),
        },
        tool_item=tool_item,
        control=control,
        selection_ok=names == [c["name"] for c in expected],
        calls_emitted=len(calls),
        calls_valid=sum(1 for c in parsed if c is not None and not validate_call(c, tools)),
        arg_strict="not_applicable",
        arg_lax="not_applicable",
        tokens_out=int(output.get("tokens_out", 0)),
        ttfa_tokens=output.get("ttfa_tokens"),
        fixture_hits=sum(1 for c in calls if c.get("fixture_hit") is True),
        fixture_calls=sum(1 for c in calls if c.get("fixture_hit") is not None),
        mocked_calls=sum(1 for c in calls if c.get("mocked") is True),
        top_up=bool(item.get(TOP_UP)),
    )
    if tool_item:
        for lax in (False, True):
            reason: str | None = None
            if len(paired[lax]) != len(expected):
                reason = "wrong_call_count"
                if paired[lax] and paired[lax][0] is None:
                    reason = "invalid_json"
            for got, want, alts, opt in zip(paired[lax], expected, alternatives, optional):
                if reason is None:
                    reason = match_call(got, want, lax, tools, alts, opt)
            if reason is None:
                known = tools_by_name(tools)
                bad = [c for c in paired[lax] if c is not None and c.get("name") not in known]
                reason = "unknown_tool" if bad else None
            if lax:
                score.arg_lax = reason
            else:
                score.arg_strict = reason
                if reason:
                    score.reasons.append(reason)
        received = list(leaves(received_results(output)))
        fields = [f for f in item.get("integration_fields", []) if span_grounded(f, received, True, locale)]
        grounded = [*received, *fields]
        spans = unrequested_spans(find_spans(answer, vocab), item, locale)
        score.eligible = True
        score.spans = len(spans)
        score.grounded_strict = sum(span_grounded(s, grounded, False, locale) for s in spans)
        score.grounded_lax = sum(span_grounded(s, grounded, True, locale) for s in spans)
    generated = " ".join([*(checked_call_text(c, privacy.allow) for c in calls), answer])
    pii = prompt_pii(item, privacy)
    score.has_pii = bool(pii)
    score.privacy_ok = not any(pii_leaked(p, generated) for p in pii)
    if control:
        named = unrequested_spans(find_spans_named(answer, result_vocab), item, locale)
        score.control_integration = bool(calls) or bool(named)
    return score


def received_results(output: Mapping[str, Any]) -> list[Any]:
    """The tool results the model received in its conversation: those of its calls that a fixture (or the
    mock policy) answered. An error result (no fixture, unparsable call) grounds nothing."""
    results = [t.get("result") for t in output.get("turns", []) if t.get("role") == "tool"]
    return [result for call, result in zip(output.get("calls", []), results)
            if call.get("fixture_hit") is True or call.get("mocked") is True]  # fmt: skip


def unrequested_spans(spans: Sequence[str], item: Mapping[str, Any], locale: str = "en") -> list[str]:
    """``spans`` without those that repeat the user's messages (they prove no integration): each span is
    dropped as often as the user's messages hold it (a number equal to one of theirs; a text whole-word in
    their normalized text), so the answer "24 minus 12 = 12" to "Calculate 24 minus 12." keeps one "12"."""
    text = " ".join(str(m.get("content") or "") for m in item.get("messages", []) if m.get("role") == "user")
    numbers = Counter(parse_number(m.group(0), locale) for m in NUMBER.finditer(text))
    normalized = normalize_text(text)
    used: Counter[Any] = Counter()
    kept = []
    for span in spans:
        key: Any = parse_number(span, locale)
        if key is not None:
            held = numbers[key]
        else:
            key = normalize_text(span)
            held = len(re.findall(rf"(?<!\S){re.escape(key)}(?!\S)", normalized)) if key else 0
        if used[key] < held:
            used[key] += 1
        else:
            kept.append(span)
    return kept


def find_spans_named(answer: str, named_values: Sequence[str]) -> list[str]:
    """Named-value spans only (no numbers): text that could only come from a tool result."""
    return [s for s in find_spans(answer, named_values) if NUMBER.fullmatch(s) is None]


# --------------------------------------------------------------------------------------
# Aggregation


def _rate(hits: float, total: float) -> float | None:
    return None if total == 0 else float(hits) / float(total)


def _percentile(values: Sequence[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    rank = q / 100 * (len(ordered) - 1)  # linear interpolation (numpy's default)
    low, high = math.floor(rank), math.ceil(rank)
    return float(ordered[low] + (ordered[high] - ordered[low]) * (rank - low))


def item_f1(score: ItemScore, strict: bool) -> float:
    """Integration F1 of one eligible item (the macro F1 is the mean over eligible items)."""
    grounded = score.grounded_strict if strict else score.grounded_lax
    precision = grounded / score.spans if score.spans else 0.0
    return f1(precision, 1.0 if grounded else 0.0)


def item_rows(scores: Sequence[ItemScore]) -> list[dict[str, Any]]:
    """Per-item outcomes behind the gated figures: the paired drift gates compare ``f1_lax`` / ``f1_strict``
    item by item (None: the item is not eligible for integration F1), the quality gates count the rest for
    their n and confidence intervals."""
    return [{"id": s.id, "shape": s.slices["shape"],
             "f1_lax": item_f1(s, strict=False) if s.eligible else None,
             "f1_strict": item_f1(s, strict=True) if s.eligible else None,
             "selection_ok": s.selection_ok, "privacy_ok": s.privacy_ok, "calls_emitted": s.calls_emitted,
             "calls_valid": s.calls_valid, "fixture_calls": s.fixture_calls, "fixture_hits": s.fixture_hits,
             "top_up": s.top_up}
            for s in scores]


def _f1_parts(scores: Sequence[ItemScore], strict: bool) -> tuple[float | None, float | None]:
    eligible = [s for s in scores if s.eligible]
    if not eligible:
        return None, None
    per_item, grounded_sum, spans_sum, recalled = [], 0, 0, 0
    for s in eligible:
        grounded = s.grounded_strict if strict else s.grounded_lax
        per_item.append(item_f1(s, strict))
        grounded_sum, spans_sum, recalled = grounded_sum + grounded, spans_sum + s.spans, recalled + (grounded > 0)
    micro_p = grounded_sum / spans_sum if spans_sum else 0.0
    return sum(per_item) / len(per_item), f1(micro_p, recalled / len(eligible))


def aggregate(scores: Sequence[ItemScore]) -> dict[str, Any]:
    """METRICS (without slices) over ``scores``."""
    tool_scores = [s for s in scores if s.tool_item]
    strict_macro, strict_micro = _f1_parts(scores, strict=True)
    lax_macro, lax_micro = _f1_parts(scores, strict=False)
    ttfa = [float(s.ttfa_tokens) for s in scores if s.ttfa_tokens is not None]
    tokens = [s.tokens_out for s in scores]
    tool_tokens = [s.tokens_out for s in tool_scores]
    return {
        "n": len(scores),
        "tool_selection": _rate(sum(s.selection_ok for s in scores), len(scores)),
        "json_validity": _rate(sum(s.calls_valid for s in scores), sum(s.calls_emitted for s in scores)),
        "arg_match_strict": _rate(sum(s.arg_strict is None for s in tool_scores), len(tool_scores)),
        "arg_match_lax": _rate(sum(s.arg_lax is None for s in tool_scores), len(tool_scores)),
        "f1_strict_macro": strict_macro,
        "f1_lax_macro": lax_macro,
        "f1_strict_micro": strict_micro,
        "f1_lax_micro": lax_micro,
        "privacy_ok_rate": _rate(sum(s.privacy_ok for s in scores), len(scores)),
        "controls_with_integration": sum(s.control and s.control_integration for s in scores),
        "fixture_hit_rate": _rate(sum(s.fixture_hits for s in scores), sum(s.fixture_calls for s in scores)),
        "mocked_calls": sum(s.mocked_calls for s in scores),
        "median_tokens_out": float(statistics.median(tokens)) if tokens else None,
        "median_tokens_out_tool_items": float(statistics.median(tool_tokens)) if tool_tokens else None,
        "false_tool_calls_tool_absent": sum(1 for s in scores if not s.tool_item and s.calls_emitted > 0),
        "ttfa_tokens_p50": _percentile(ttfa, 50),
        "ttfa_tokens_p95": _percentile(ttfa, 95),
        # the slices the privacy and latency-loss figures are over (0: the gate has nothing to measure)
        "items_with_pii": sum(s.has_pii for s in scores),
        "control_items": sum(s.control for s in scores),
        "tool_absent_items": sum(not s.tool_item for s in scores),
        "ttfa_items": len(ttfa),
        "failure_reasons": dict(sorted(Counter(r for s in scores for r in s.reasons).items())),
    }


def score(
    items: Sequence[Mapping[str, Any]],
    outputs: Sequence[Mapping[str, Any]] | Mapping[str, Mapping[str, Any]],
    shapes: Mapping[str, int] | None = None,
    lengths: Sequence[int] | None = None,
    privacy: PrivacyConfig | None = None,
) -> dict[str, Any]:
    """METRICS with slices for runner ``outputs`` on ``items`` (arguments as :func:`score_items`)."""
    return summarize(score_items(items, outputs, shapes, lengths, privacy))


def summarize(scores: Sequence[ItemScore]) -> dict[str, Any]:
    """METRICS with slices of per-item ``scores`` (:func:`score_items`)."""
    metrics = aggregate(scores)
    slices: dict[str, dict[str, Any]] = {}
    for key in SLICE_KEYS:
        groups: dict[str, list[ItemScore]] = {}
        for s in scores:
            groups.setdefault(s.slices[key], []).append(s)
        slices[key] = {value: aggregate(group) for value, group in sorted(groups.items())}
    metrics["slices"] = slices
    return metrics


def score_items(
    items: Sequence[Mapping[str, Any]],
    outputs: Sequence[Mapping[str, Any]] | Mapping[str, Mapping[str, Any]],
    shapes: Mapping[str, int] | None = None,
    lengths: Sequence[int] | None = None,
    privacy: PrivacyConfig | None = None,
) -> list[ItemScore]:
    """One :class:`ItemScore` per item, in item order.

    Args:
        items: dataset items (contract format).
        outputs: per-item runner outputs (a list or a mapping by id); every item needs one.
        shapes: token length per item id (prompt + reference), bucketed into ``lengths``
            for the shape slice; without it the shape slice is ``"all"``.
        lengths: enumerated shapes (``ShapesConfig.lengths``).
        privacy: PII patterns and allow-list (``eval.privacy``; default: :class:`PrivacyConfig`).

    Raises:
        ValueError: an item has no output, an output has no item, or an id repeats.
    """
    by_id = _outputs_by_id(outputs)
    item_ids = [str(item["id"]) for item in items]
    dup = [i for i, c in Counter(item_ids).items() if c > 1]
    missing = sorted(set(item_ids) - set(by_id))
    extra = sorted(set(by_id) - set(item_ids))
    if dup or missing or extra:
        raise ValueError(
            f"outputs do not cover the items: duplicates {dup[:5]}, missing {missing[:5]}, extra {extra[:5]}"
        )
    vocab = named_value_vocabulary(items)
    result_vocab = named_value_vocabulary(items, results_only=True)
    scores = []
    for item in items:
        shape = shape_of(shapes[str(item["id"])], lengths) if shapes is not None and lengths else "all"
        scores.append(score_item(item, by_id[str(item["id"])], vocab, result_vocab, shape, privacy))
    return scores


def _outputs_by_id(
    outputs: Sequence[Mapping[str, Any]] | Mapping[str, Mapping[str, Any]],
) -> dict[str, Mapping[str, Any]]:
    if isinstance(outputs, Mapping):
        return {str(k): v for k, v in outputs.items()}
    by_id: dict[str, Mapping[str, Any]] = {}
    for output in outputs:
        key = str(output["id"])
        if key in by_id:
            raise ValueError(f"duplicate output for item {key}")
        by_id[key] = output
    return by_id
