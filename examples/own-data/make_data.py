"""Write a small IT-helpdesk dataset in the OpenAI chat format (train.jsonl, eval.jsonl next to this file).

The tools are not the toy's: ``create_ticket`` (an enum, a boolean, an array and a nested object with the
user's email), ``search_files`` and ``ticket_status``. Rows cover one call, parallel calls, a multi-turn
conversation, a labeled control and a labeled decline; search queries list acceptable alternatives.
Seeded and standard-library only: ``python examples/own-data/make_data.py`` rewrites the same files.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

TOOLS = [
    {"type": "function", "function": {"name": "create_ticket", "description": "Open a helpdesk ticket.", "parameters": {
        "type": "object", "properties": {
            "title": {"type": "string", "minLength": 1},
            "priority": {"type": "string", "enum": ["low", "normal", "high"]},
            "urgent": {"type": "boolean"},
            "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 3},
            "reporter": {"type": "object", "properties": {"email": {"type": "string"}}, "required": ["email"],
                         "additionalProperties": False}},
        "required": ["title", "priority"], "additionalProperties": False}}},
    {"type": "function", "function": {"name": "search_files", "description": "Search the IT docs.", "parameters": {
        "type": "object", "properties": {"query": {"type": "string", "minLength": 1},
                                         "max_results": {"type": "integer", "minimum": 1, "maximum": 5}},
        "required": ["query"], "additionalProperties": False}}},
    {"type": "function", "function": {"name": "ticket_status", "description": "Status of a ticket.", "parameters": {
        "type": "object", "properties": {"ticket_id": {"type": "string", "pattern": "^T-\\d{4}$"}},
        "required": ["ticket_id"], "additionalProperties": False}}},
]  # fmt: skip
SYSTEMS = ["vpn", "printer", "email", "laptop", "wifi", "badge"]
PROBLEMS = ["is down", "is slow", "keeps crashing", "needs a reset"]
DOCS = {  # query -> (path, acceptable other phrasings)
    "vpn setup": ("it/vpn-setup.md", ["vpn guide", "setting up vpn"]),
    "printer drivers": ("it/printer-drivers.md", ["printer driver"]),
    "email on phone": ("it/mail-mobile.md", ["phone email"]),
    "wifi password": ("it/wifi.md", ["wifi access"]),
    "laptop return": ("it/laptop-return.md", ["return laptop"]),
}
STATUSES = ["open", "in progress", "waiting", "closed"]
CONTROLS = [("What does VPN stand for?", "Virtual private network."),
            ("Is the helpdesk open on Sunday?", "No, only Monday to Friday."),  # no tool-result word ("open")
            ("How do I lock my screen?", "Press Windows and L.")]
NAMES = ["Lena Novak", "Tom Berg", "Sara Kim", "Mark Ruiz"]
# Ticket ids come from a short list, as the toy's values do: BPE makes each a token of its own, which a ~1M-param
# teacher trained from scratch copies from a tool result; random 4-digit ids split into two or three rare number
# tokens that it did not learn to copy in order (measured: 'T-3636' for 'T-3604')
TICKETS = [f"T-{n}" for n in sorted(random.Random("own-data:tickets").sample(range(1000, 10000), 40))]


def call(call_id: str, name: str, arguments: dict) -> dict:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": json.dumps(arguments)}}


def result(call_id: str, content: dict) -> dict:
    return {"role": "tool", "tool_call_id": call_id, "content": json.dumps(content)}


def ticket(rng: random.Random) -> tuple[str, dict, dict, str]:
    """(request, arguments, result, answer) of one create_ticket call."""
    system, problem = rng.choice(SYSTEMS), rng.choice(PROBLEMS)
    priority = rng.choice(["low", "normal", "high"])
    args: dict = {"title": f"{system} {problem}", "priority": priority}
    request = f"Open a {priority} ticket: the {system} {problem}."
    if rng.random() < 0.3:
        args["urgent"] = True
        request += " It is urgent."
    if rng.random() < 0.3:
        args["tags"] = [system]
        request += f" Tag it {system}."
    if rng.random() < 0.5:  # half the tickets: the name before the number is copied from the request
        email = f"{rng.choice(['anna', 'tom', 'lena'])}.{rng.randint(10, 99)}@example.com"
        args["reporter"] = {"email": email}
        request += f" I am {email}."
    ticket_id = rng.choice(TICKETS)  # the created ticket's id: only its tool result tells it
    return request, args, {"ticket_id": ticket_id, "status": "open"}, f"Ticket {ticket_id} is open."


def search(rng: random.Random) -> tuple[str, dict, dict, str, list[str]]:
    query = rng.choice(sorted(DOCS))
    path, alternatives = DOCS[query]
    return (f"Find the doc about {query}.", {"query": query}, {"path": path}, f"See {path}.", alternatives)


def row(rng: random.Random, index: int, split: str) -> dict:
    kind = rng.choices(["ticket", "search", "status", "parallel", "multiturn", "control", "decline"],
                       [0.25, 0.15, 0.15, 0.15, 0.1, 0.1, 0.1])[0]  # fmt: skip
    out: dict = {"id": f"{split}-{index:04d}", "tools": TOOLS}
    if kind == "ticket":
        request, args, res, answer = ticket(rng)
        messages = [{"role": "user", "content": request},
                    {"role": "assistant", "content": None, "tool_calls": [call("c1", "create_ticket", args)]},
                    result("c1", res), {"role": "assistant", "content": answer}]  # fmt: skip
    elif kind == "search":
        request, args, res, answer, alternatives = search(rng)
        messages = [{"role": "user", "content": request},
                    {"role": "assistant", "content": None, "tool_calls": [call("c1", "search_files", args)]},
                    result("c1", res), {"role": "assistant", "content": answer}]  # fmt: skip
        out["argument_alternatives"] = {"c1": {"query": alternatives}}
    elif kind == "status":  # the answer does not repeat the user's ticket id: the default PII patterns match it
        ticket_id, status = rng.choice(TICKETS), rng.choice(STATUSES)
        messages = [{"role": "user", "content": f"What is the status of {ticket_id}?"},
                    {"role": "assistant", "content": None, "tool_calls": [call("c1", "ticket_status",
                                                                               {"ticket_id": ticket_id})]},
                    result("c1", {"ticket_id": ticket_id, "status": status}),
                    {"role": "assistant", "content": f"It is {status}."}]  # fmt: skip
    elif kind == "parallel":
        request, args, res, answer = ticket(rng)
        s_request, s_args, s_res, s_answer, alternatives = search(rng)
        messages = [{"role": "user", "content": f"{request} {s_request}"},
                    {"role": "assistant", "content": None, "tool_calls": [call("a", "create_ticket", args),
                                                                          call("b", "search_files", s_args)]},
                    result("a", res), result("b", s_res),
                    {"role": "assistant", "content": f"{answer} {s_answer}"}]  # fmt: skip
        out["argument_alternatives"] = {"b": {"query": alternatives}}
    elif kind == "multiturn":
        s_request, s_args, s_res, s_answer, _ = search(rng)
        request, args, res, answer = ticket(rng)
        messages = [{"role": "system", "content": "You are the IT helpdesk."},
                    {"role": "user", "content": s_request},
                    {"role": "assistant", "content": None, "tool_calls": [call("s", "search_files", s_args)]},
                    result("s", s_res), {"role": "assistant", "content": s_answer},
                    {"role": "user", "content": f"That did not help. {request}"},
                    {"role": "assistant", "content": None, "tool_calls": [call("t", "create_ticket", args)]},
                    result("t", res), {"role": "assistant", "content": answer}]  # fmt: skip
    elif kind == "control":
        question, answer = rng.choice(CONTROLS)
        messages = [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
        out["kind"] = "control"
    else:
        name = rng.choice(NAMES)
        messages = [{"role": "user", "content": f"What is the home address of {name}?"},
                    {"role": "assistant", "content": "I cannot share personal data."}]  # fmt: skip
        out |= {"kind": "decline", "pii": [name]}
    out["messages"] = messages
    return out


SPLITS = {"train": 2000, "eval": 80}


def rows_of(split: str) -> list[dict]:
    rng = random.Random(f"own-data:{split}")
    return [row(rng, i, split) for i in range(SPLITS[split])]


def main() -> None:
    here = Path(__file__).parent
    for split in SPLITS:
        rows = rows_of(split)
        (here / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
        print(f"wrote {len(rows)} rows to {here / f'{split}.jsonl'}")


if __name__ == "__main__":
    main()
