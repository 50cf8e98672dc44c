"""Seeded, deterministic generator of the toy tool-calling items.

Each item is drawn from its own ``random.Random(f"{seed}:{split}:{index}")``, so an item does not
depend on how many items are generated before it (sharded or resumed builds give the same items).

Kinds: ``single`` (one call), ``multi`` (two calls in order), ``control`` (no tool needed),
``decline`` (privacy-sensitive request: refuse, no tool), ``pii`` (the prompt carries an email,
phone number or customer id; the call and answer must not echo it). Locales: ``en`` and ``de``.

Styles (the latency story): ``verbose`` references put a short preamble before the first tool call
and a chatty filler after the facts; ``terse`` references call at once and answer with the
grounded facts only. Both contain every integration field; the teacher learns the mix and the
student's length / early-tool losses push it toward terse.

Values come from short lists so a ~1M-parameter model can learn the task. Tool *results* too: an
answer is grounded only in the results the model received (docs/metrics.md), and a ~1M-parameter
model copies a result value reliably only once it has seen that value often (measured on the toy
student: a received value copied 0.33 of the time when training results never held it, 0.30 at 1-4
times, 0.78 at 5-19, 0.93 at 20+). So every result value is drawn from a pool small enough that each
value recurs 20+ times in the toy's training items (16000, about 3000 calls a tool; tests/data/test_generator.py).
The pools a value is *copied* from (the requested time, the result's condition and event id) are also large enough
that the pool's prior is a poor place for training to settle: 1 in 12 to 24, not 1 in 5 (docs/benchmarks.md 11.9).
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from distillgates.data.chat import answer_text, system_prompt, tool_call_text, tool_result_text
from distillgates.data.registry import CITIES, CURRENCIES, OPERATIONS
from distillgates.data.tools import validate_call
from distillgates.tokenizer import ASSISTANT

KINDS = ("single", "multi", "control", "decline", "pii")
KIND_WEIGHTS = (0.35, 0.2, 0.15, 0.1, 0.2)
STYLES = ("verbose", "terse")


@dataclass
class ToolTurn:
    """One generated tool use: the call, its fixture result and the answer sentences."""

    call: dict[str, Any]
    result: dict[str, Any]
    user: str  # the request as the user phrases it
    terse: str  # the grounded facts only
    verbose: str  # the facts in a chatty sentence
    fields: list[str]  # result values the answer must contain


def _num(value: float) -> int | float:
    """Whole floats become ints so the JSON text and the answer text agree (``110`` not ``110.0``)."""
    return int(value) if float(value).is_integer() else round(value, 2)


def _text(value: Any) -> str:
    """Answer text of a result value: exactly its JSON form for numbers, the string itself otherwise."""
    return value if isinstance(value, str) else json.dumps(value)


# --------------------------------------------------------------------------------------
# Per-tool generators: (rng, locale) -> ToolTurn

_CONDITIONS = {
    "en": ("sunny", "cloudy", "rainy", "windy", "snowy", "foggy", "stormy", "hazy", "humid", "clear", "icy", "mild"),
    "de": ("sonnig", "bewölkt", "regnerisch", "windig", "verschneit", "neblig", "stürmisch", "diesig", "schwül", "klar",
           "eisig", "mild"),
}


_CELSIUS = (-3, 0, 4, 8, 11, 14, 17, 19, 21, 23, 25, 28)
_FAHRENHEIT = (39, 54, 64, 72, 81)  # a fifth of the weather calls ask for fahrenheit: a smaller pool


def _weather(rng: random.Random, loc: str) -> ToolTurn:
    city = rng.choice(CITIES)
    unit = rng.choice(("celsius", "fahrenheit")) if rng.random() < 0.4 else None
    temp = rng.choice(_FAHRENHEIT) if unit == "fahrenheit" else rng.choice(_CELSIUS)
    cond = rng.choice(_CONDITIONS[loc])
    args: dict[str, Any] = {"city": city} | ({"unit": unit} if unit else {})
    if loc == "en":
        user = rng.choice((f"What's the weather in {city}?", f"How is the weather in {city} today?"))
        user = user[:-1] + f" in {unit}?" if unit else user
        terse, verbose = f"{city}: {temp} degrees, {cond}.", f"It is {temp} degrees and {cond} in {city}."
    else:
        user = rng.choice((f"Wie ist das Wetter in {city}?", f"Wie ist das Wetter heute in {city}?"))
        user = user[:-1] + f" in {unit}?" if unit else user
        terse, verbose = f"{city}: {temp} Grad, {cond}.", f"In {city} sind es {temp} Grad und {cond}."
    result = {"temperature": temp, "condition": cond}
    return ToolTurn({"name": "get_weather", "arguments": args}, result, user, terse, verbose, [str(temp), cond])


_RATE_TO_USD = {"USD": 1.0, "EUR": 1.1, "GBP": 1.25, "JPY": 0.007, "CHF": 1.12}
# The pairs users ask for (every currency on both sides), times two amounts: 16 conversions, each result
# recurring ~45 times in training (all 20 pairs times 6 amounts made 120, ~6 times each).
_PAIRS = (("USD", "EUR"), ("EUR", "USD"), ("GBP", "USD"), ("USD", "JPY"), ("EUR", "CHF"), ("CHF", "GBP"),
          ("JPY", "EUR"), ("GBP", "CHF"))
assert {c for pair in _PAIRS for c in pair} == set(CURRENCIES)


def _currency(rng: random.Random, loc: str) -> ToolTurn:
    amount = rng.choice((100, 500))
    src, dst = rng.choice(_PAIRS)
    converted = _num(round(amount * _RATE_TO_USD[src] / _RATE_TO_USD[dst], 2))
    conv = _text(converted)
    if loc == "en":
        user = rng.choice((f"Convert {amount} {src} to {dst}.", f"How much is {amount} {src} in {dst}?"))
        terse, verbose = f"{amount} {src} = {conv} {dst}.", f"{amount} {src} is {conv} {dst} at today's rate."
    else:
        user = rng.choice((f"Rechne {amount} {src} in {dst} um.", f"Wie viel sind {amount} {src} in {dst}?"))
        terse, verbose = f"{amount} {src} = {conv} {dst}.", f"{amount} {src} sind {conv} {dst} zum heutigen Kurs."
    call = {"name": "convert_currency", "arguments": {"amount": amount, "from_currency": src, "to_currency": dst}}
    return ToolTurn(call, {"amount": converted, "currency": dst}, user, terse, verbose, [conv])


_TOPICS = {
    "en": ("budget", "onboarding", "travel policy", "security", "roadmap", "holidays"),
    "de": ("Budget", "Einarbeitung", "Reiserichtlinie", "Sicherheit", "Roadmap", "Urlaub"),
}
# Each query's top document has one title: a suffix the model would have to guess from the request is no value it
# copies from the result (with two suffixes drawn at random the toy student guessed right on 257 of 534 items).
_TITLES = {query: f"{query.title()} {('Guide', 'Notes')[i % 2]}" for topics in _TOPICS.values()
           for i, query in enumerate(topics)}


def _search(rng: random.Random, loc: str) -> ToolTurn:
    query = rng.choice(_TOPICS[loc])
    limit = rng.choice((1, 3, 5)) if rng.random() < 0.3 else None
    count = rng.randint(1, limit or 9)
    title = _TITLES[query]
    args: dict[str, Any] = {"query": query} | ({"max_results": limit} if limit else {})
    if loc == "en":
        user = rng.choice((f"Search the documents for {query}.", f"Find documents about {query}."))
        user += f" At most {limit}." if limit else ""
        terse, verbose = f"{count} found, top: {title}.", f"I found {count} documents, and the best match is {title}."
    else:
        user = rng.choice((f"Suche in den Dokumenten nach {query}.", f"Finde Dokumente zum Thema {query}."))
        user += f" Höchstens {limit}." if limit else ""
        terse, verbose = f"{count} Treffer, oben: {title}.", f"Ich habe {count} Dokumente, am besten passt {title}."
    call = {"name": "search_documents", "arguments": args}
    return ToolTurn(call, {"count": count, "top": title}, user, terse, verbose, [str(count), title])


_EVENT_TITLES = {
    "en": ("Dentist", "Team sync", "Lunch with Sam", "Yoga", "Project review"),
    "de": ("Zahnarzt", "Teamrunde", "Mittagessen", "Yoga", "Projektreview"),
}
_TIMES = ("07:30", "08:00", "08:45", "09:00", "09:15", "10:00", "10:30", "11:00", "11:45", "12:00", "12:30", "13:00",
          "14:00", "14:30", "15:00", "15:45", "16:15", "17:00", "17:30", "18:00")
# Value pools: small enough that every value recurs often enough for the tokenizer to give it one token, large
# enough that guessing from the pool pays little. With 5 times and 5 conditions a from-scratch teacher could settle on
# the pool's prior for one of them (1 in 5) and never learn to copy it (seed 3 on a Xeon: the time, seed 3 on an AMD
# EPYC: the condition); with 20 times, 12 conditions and 24 event ids the four traced seeds copy every value by step
# 2500, and one final teacher in five lags on the condition (0.78) while its student copies it (docs/benchmarks.md
# 11.9). Dates and operands stay few: dates were always copied, and wider operands made some answers state a result
# from the pool instead of copying the tool's (docs/benchmarks.md 11.10).
_DATES = ("2025-01-15", "2025-02-03", "2025-03-21", "2025-05-09", "2025-06-30", "2025-08-12", "2025-10-01",
          "2025-12-24")
_OPERANDS = (3, 7, 12, 15, 24, 36, 48, 60, 75, 90)
# Event ids are single tokens (letters and "_" stay one pre-token), like the weather conditions and titles the
# answer copies from a tool result. As "evt-208" (tokens evt / - / 208) the copy needed the token after the
# result's "-": some teacher trainings never found it (seed 0 at 2 threads on a Xeon: 1 answer in 12 right,
# F1 lax 0.85), while as one token it is copied like the other result values (docs/benchmarks.md 11.5).
_EVENT_IDS = ("evt_amber", "evt_birch", "evt_cedar", "evt_delta", "evt_ember", "evt_fjord", "evt_grove", "evt_heron",
              "evt_iris", "evt_jade", "evt_kite", "evt_lotus", "evt_maple", "evt_noble", "evt_oasis", "evt_pearl",
              "evt_quartz", "evt_raven", "evt_sage", "evt_tulip", "evt_umber", "evt_viola", "evt_willow", "evt_yarrow")


def _calendar(rng: random.Random, loc: str) -> ToolTurn:
    title = rng.choice(_EVENT_TITLES[loc])
    date = rng.choice(_DATES)
    time = rng.choice(_TIMES) if rng.random() < 0.6 else None
    event_id = rng.choice(_EVENT_IDS)
    args: dict[str, Any] = {"title": title, "date": date} | ({"time": time} if time else {})
    if loc == "en":
        user = rng.choice((f"Create an event {title} on {date}", f"Add {title} to my calendar on {date}"))
        user += f" at {time}." if time else "."
        terse, verbose = f"Created {event_id}.", f"Done! {title} is on your calendar for {date} as {event_id}."
    else:
        user = rng.choice((f"Erstelle einen Termin {title} am {date}", f"Trag {title} am {date} ein"))
        user += f" um {time}." if time else "."
        terse, verbose = f"Erstellt: {event_id}.", f"Erledigt! {title} steht am {date} im Kalender als {event_id}."
    call = {"name": "create_calendar_event", "arguments": args}
    return ToolTurn(call, {"event_id": event_id, "status": "confirmed"}, user, terse, verbose, [event_id])


_OP_WORDS = {
    "en": {"add": "plus", "subtract": "minus", "multiply": "times", "divide": "divided by"},
    "de": {"add": "plus", "subtract": "minus", "multiply": "mal", "divide": "geteilt durch"},
}
_OP_FUNCS: dict[str, Callable[[int, int], float]] = {
    "add": lambda a, b: a + b,
    "subtract": lambda a, b: a - b,
    "multiply": lambda a, b: a * b,
    "divide": lambda a, b: a / b,
}


_DIVISORS = (2, 4, 5, 10)
# Five results an operation (among those the most operand pairs reach), so each recurs ~35 times in
# training: drawn first, then one of the operand pairs that gives it.
_RESULTS = {"add": (27, 39, 51, 63, 72), "subtract": (-12, 9, 12, 24, 45), "multiply": (36, 72, 144, 180, 900),
            "divide": (3, 6, 9, 12, 18)}


def _operand_pairs() -> dict[tuple[str, float], list[tuple[int, int]]]:
    """(operation, result) -> the operand pairs that give it."""
    pairs: dict[tuple[str, float], list[tuple[int, int]]] = {}
    for op, func in _OP_FUNCS.items():
        for a in _OPERANDS:
            for b in _DIVISORS if op == "divide" else _OPERANDS:
                pairs.setdefault((op, func(a, b)), []).append((a, b))
    return pairs


_PAIRS_FOR = _operand_pairs()


def _calculate(rng: random.Random, loc: str) -> ToolTurn:
    op = rng.choice(OPERATIONS)
    a, b = rng.choice(_PAIRS_FOR[op, rng.choice(_RESULTS[op])])
    value = _num(round(_OP_FUNCS[op](a, b), 2))
    res, word = _text(value), _OP_WORDS[loc][op]
    if loc == "en":
        user = rng.choice((f"What is {a} {word} {b}?", f"Calculate {a} {word} {b}."))
        terse, verbose = f"{a} {word} {b} = {res}.", f"The result of {a} {word} {b} is {res}."
    else:
        user = rng.choice((f"Was ist {a} {word} {b}?", f"Berechne {a} {word} {b}."))
        terse, verbose = f"{a} {word} {b} = {res}.", f"Das Ergebnis von {a} {word} {b} ist {res}."
    call = {"name": "calculate", "arguments": {"operation": op, "a": a, "b": b}}
    return ToolTurn(call, {"result": value}, user, terse, verbose, [res])


TOOL_GENERATORS: dict[str, Callable[[random.Random, str], ToolTurn]] = {
    "get_weather": _weather,
    "convert_currency": _currency,
    "search_documents": _search,
    "create_calendar_event": _calendar,
    "calculate": _calculate,
}

# --------------------------------------------------------------------------------------
# Kinds without tools, and the chatty bits of the verbose style

_PREAMBLES = {
    "en": ("Let me check that.", "Sure, one moment.", "Let me look that up."),
    "de": ("Ich schaue nach.", "Einen Moment bitte.", "Das prüfe ich."),
}
_FILLERS = {
    "en": ("Anything else?", "Happy to help with more.", "Let me know if you need more."),
    "de": ("Sonst noch etwas?", "Ich helfe gern weiter.", "Sag Bescheid, wenn du mehr brauchst."),
}
_MULTI_JOIN = {"en": "And then:", "de": "Und danach:"}
_CONTROLS = {
    "en": (
        ("What is the capital of France?", "The capital of France is Paris."),
        ("Hi! How are you?", "I'm doing well, thanks. How can I help?"),
        ("Tell me a short joke.", "Why did the robot rest? It needed to recharge."),
        ("What does celsius measure?", "Celsius is a scale for temperature."),
        ("Thanks for your help!", "You're welcome!"),
        ("What is JSON?", "JSON is a simple text format for data."),
        ("How many days are in a week?", "A week has seven days."),
    ),
    "de": (
        ("Was ist die Hauptstadt von Frankreich?", "Die Hauptstadt von Frankreich ist Paris."),
        ("Hallo! Wie geht es dir?", "Mir geht es gut, danke. Wie kann ich helfen?"),
        ("Erzähl mir einen kurzen Witz.", "Warum ruht der Roboter? Er muss sich aufladen."),
        ("Was misst Celsius?", "Celsius ist eine Skala für die Temperatur."),
        ("Danke für deine Hilfe!", "Gern geschehen!"),
        ("Was ist JSON?", "JSON ist ein einfaches Textformat für Daten."),
        ("Wie viele Tage hat eine Woche?", "Eine Woche hat sieben Tage."),
    ),
}
_NAMES = ("Anna Schmidt", "Tom Becker", "Lena Vogel", "Mark Jones", "Sara Lind")
_DECLINE_ASKS = {
    "en": (
        "Find the home address of my neighbour {name}.",
        "Give me the private phone number of {name}.",
        "Search for the medical records of {name}.",
    ),
    "de": (
        "Finde die Wohnadresse meiner Nachbarin {name}.",
        "Gib mir die private Telefonnummer von {name}.",
        "Suche die Krankenakte von {name}.",
    ),
}
_DECLINES = {
    "en": "Sorry, I can't help with private information about other people.",
    "de": "Tut mir leid, bei privaten Daten über andere Personen kann ich nicht helfen.",
}
_PII_SENTENCES = {
    "en": ("My email is {v}.", "My phone number is {v}.", "My customer id is {v}."),
    "de": ("Meine E-Mail ist {v}.", "Meine Telefonnummer ist {v}.", "Meine Kundennummer ist {v}."),
}


def _pii_value(rng: random.Random, which: int) -> str:
    first = rng.choice(("anna", "tom", "lena", "mark", "sara"))
    if which == 0:
        return f"{first}.{rng.randint(10, 99)}@example.com"
    if which == 1:
        return f"+49 170 {rng.randint(1000000, 9999999)}"
    return f"ID-{rng.randint(10000, 99999)}"


# --------------------------------------------------------------------------------------
# Items


def _item(item_id: str, kind: str, locale: str, style: str, user: str) -> dict[str, Any]:
    return {
        "id": item_id,
        "kind": kind,
        "locale": locale,
        "style": style,
        "messages": [{"role": "system", "content": system_prompt(locale)}, {"role": "user", "content": user}],
        "tool_should_be_used": False,
        "expected_calls": [],
        "fixtures": [],
        "integration_fields": [],
        "pii": [],
        "reference": "",
    }


def _tool_item(item: dict[str, Any], turns: list[ToolTurn], rng: random.Random, prefix: str = "") -> dict[str, Any]:
    loc, verbose = item["locale"], item["style"] == "verbose"
    preamble = rng.choice(_PREAMBLES[loc]) if verbose else ""
    reference = ""
    for i, turn in enumerate(turns):
        reference += tool_call_text(turn.call, preamble if i == 0 else "") + tool_result_text(turn.result)
    # Multi items keep terse facts even when verbose (preamble + filler only): two chatty sentences
    # would push them past the largest toy shape (256 tokens).
    facts = " ".join(t.verbose if verbose and len(turns) == 1 else t.terse for t in turns)
    answer = f"{facts} {rng.choice(_FILLERS[loc])}" if verbose else facts
    user = f" {_MULTI_JOIN[loc]} ".join(t.user for t in turns)
    item["messages"][1]["content"] = prefix + user
    item["tool_should_be_used"] = True
    item["expected_calls"] = [t.call for t in turns]
    item["fixtures"] = [{"name": t.call["name"], "arguments": t.call["arguments"], "result": t.result} for t in turns]
    item["integration_fields"] = [f for t in turns for f in t.fields]
    item["reference"] = reference + answer_text(answer)
    return item


def generate_item(
    seed: int,
    index: int,
    locales: tuple[str, ...] | list[str] = ("en", "de"),
    split: str = "train",
    verbose_share: float = 0.5,
) -> dict[str, Any]:
    """The item ``index`` of ``split`` for ``seed`` (independent of any other item)."""
    rng = random.Random(f"{seed}:{split}:{index}")
    kind = rng.choices(KINDS, weights=KIND_WEIGHTS)[0]
    locale = rng.choice(tuple(locales))
    style = STYLES[0] if rng.random() < verbose_share else STYLES[1]
    item = _item(f"toy-{split}-{index:06d}", kind, locale, style, "")
    tools = tuple(TOOL_GENERATORS)
    if kind == "single":
        item = _tool_item(item, [TOOL_GENERATORS[rng.choice(tools)](rng, locale)], rng)
    elif kind == "multi":
        first, second = rng.choice(tools), rng.choice(tools)
        turns = [TOOL_GENERATORS[first](rng, locale), TOOL_GENERATORS[second](rng, locale)]
        while turns[1].call == turns[0].call:  # two calls must be distinguishable in order
            turns[1] = TOOL_GENERATORS[second](rng, locale)
        item = _tool_item(item, turns, rng)
    elif kind == "control":
        question, answer = rng.choice(_CONTROLS[locale])
        answer = f"{answer} {rng.choice(_FILLERS[locale])}" if style == "verbose" else answer
        item["messages"][1]["content"], item["reference"] = question, answer_text(answer)
    elif kind == "decline":
        name = rng.choice(_NAMES)
        item["messages"][1]["content"] = rng.choice(_DECLINE_ASKS[locale]).format(name=name)
        item["pii"], item["reference"] = [name], answer_text(_DECLINES[locale])
    else:  # pii
        which = rng.randrange(3)
        value = _pii_value(rng, which)
        prefix = _PII_SENTENCES[locale][which].format(v=value) + " "
        item = _tool_item(item, [TOOL_GENERATORS[rng.choice(tools)](rng, locale)], rng, prefix)
        item["pii"] = [value]
    check_item(item)
    return item


def check_item(item: dict[str, Any]) -> None:
    """Internal invariants of a generated item (a generator bug, not bad user input)."""
    for call in item["expected_calls"]:
        assert not validate_call(call), (item["id"], validate_call(call))
    answer = item["reference"].rsplit(ASSISTANT, 1)[-1]
    for value in item["integration_fields"]:
        assert value in answer, (item["id"], value)
    for value in item["pii"]:
        assert value not in item["reference"], (item["id"], value)


def generate_items(
    seed: int,
    n: int,
    locales: tuple[str, ...] | list[str] = ("en", "de"),
    split: str = "train",
    start: int = 0,
    verbose_share: float = 0.5,
) -> list[dict[str, Any]]:
    """Items ``start .. start+n-1`` of ``split``."""
    return [generate_item(seed, i, locales, split, verbose_share) for i in range(start, start + n)]
