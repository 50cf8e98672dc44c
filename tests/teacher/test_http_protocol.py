"""The HTTP teacher speaks the OpenAI tool protocol to the loopback server (which checks it as real
servers do): the item's tools on every request, tool_calls read (several per message), results sent
back as tool messages answering the call ids, and the logprobs switch."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import pytest

from distillgates.config import APIConfig
from distillgates.data.tools import item_tools
from distillgates.eval.runners import TeacherRunner, run_item
from distillgates.teacher.http import HTTPTeacher
from distillgates.teacher.kd import build_kd_set, read_kd_set
from distillgates.teacher.local import Generation, LocalTeacher
from distillgates.teacher.messages import chat_messages, openai_messages
from distillgates.teacher.server import TeacherServer
from distillgates.tokenizer import END, TOOL_CALL, TOOL_RESULT

from .conftest import kd_config


class ScriptedTeacher(LocalTeacher):
    """The tiny teacher's model and tokenizer, but each generation is the next turn of a script keyed
    by the conversation's user message (the server, the protocol and the client are what is tested)."""

    def __init__(self, path: Path, script: dict[str, list[str]]) -> None:
        super().__init__(path)
        self.script = script
        self.turn: dict[str, int] = {}

    def generate(self, prompt_ids: list[int], max_new_tokens: int, *args: Any, **kwargs: Any) -> Generation:
        prompt = self.tokenizer.decode(prompt_ids, skip_special_tokens=False)
        user = next(u for u in self.script if u in prompt)
        n = self.turn[user] = self.turn.get(user, -1) + 1
        text = self.script[user][n]
        ids = self.encode(text)
        end = self.tokenizer.convert_tokens_to_ids(END)
        return Generation(text, ids, [[i] for i in ids], [[0.0] for _ in ids], [0.0] * len(ids), "stop", [end], [0.0])


def reference_turns(item: dict[str, Any]) -> list[str]:
    """The item's reference as generated turns (text after each ``<|assistant|>``, no ``<|end|>``)."""
    body = item["reference"].split(TOOL_RESULT)
    turns = [body[0]] + [part.split("<|assistant|>", 1)[1] for part in body[1:]]
    return [t.split(END, 1)[0] for t in turns]


@pytest.fixture
def client_for(tiny_teacher):
    clients: list[HTTPTeacher] = []

    def make(server: TeacherServer, **api: Any) -> HTTPTeacher:
        cfg = APIConfig(base_url=server.base_url, timeout_s=10.0, max_retries=0, **api)
        clients.append(HTTPTeacher(cfg, tiny_teacher.tokenizer, api_key=""))
        return clients[-1]

    yield make
    for client in clients:
        client.close()


def _wire_tools(item: dict[str, Any]) -> list[dict[str, Any]]:
    return [{"type": "function", "function": tool} for tool in item_tools(item)]


def test_tool_call_ids_go_back_with_the_results_and_tools_go_with_every_request(
    tiny_teacher_dir, toy_items, client_for, tmp_path
):
    single = next(it for it in toy_items if it["kind"] == "single")
    control = next(it for it in toy_items if it["kind"] == "control")
    items = [single, control]
    teacher = ScriptedTeacher(tiny_teacher_dir, {it["messages"][1]["content"]: reference_turns(it) for it in items})
    with TeacherServer(teacher) as server:
        client = client_for(server)
        result = build_kd_set(kd_config("openai", {"base_url": server.base_url}), client, items,
                              tmp_path / "kd.jsonl", progress=False)  # fmt: skip
        bodies = list(server.requests)
    assert result.complete
    _, records = read_kd_set(tmp_path / "kd.jsonl")
    for item, record in zip(items, records):
        assert record["completion_text"] == item["reference"] and record["calls"] == item["expected_calls"]
        assert all(record["fixture_hits"]) and record["finish"] == "stop"
    first, second = bodies[0], bodies[1]  # the single item's two turns (items are played one at a time)
    assert [b["tools"] for b in bodies] == [_wire_tools(single)] * 2 + [_wire_tools(control)]
    assert first["logprobs"] is True and first["top_logprobs"] == 4
    call_message, tool_message = second["messages"][-2:]
    assert call_message["role"] == "assistant" and len(call_message["tool_calls"]) == 1
    wire = call_message["tool_calls"][0]
    assert wire["id"] == "call_1_0" and wire["type"] == "function"  # the id the server gave in its first answer
    assert json.loads(wire["function"]["arguments"]) == single["expected_calls"][0]["arguments"]
    assert tool_message == {"role": "tool", "tool_call_id": "call_1_0",
                            "content": json.dumps(single["fixtures"][0]["result"], separators=(",", ":"))}  # fmt: skip
    assert TOOL_CALL not in json.dumps(second["messages"])  # the API sees no project chat markup


def test_parallel_tool_calls_are_read_and_answered_by_id(tiny_teacher_dir, toy_items, client_for, tmp_path):
    """A response with two tool_calls: both are played (interleaved with their results, as the data
    reader writes parallel calls) and the next request answers both ids in one assistant message."""
    multi = next(it for it in toy_items if it["kind"] == "multi")
    first, second, answer = reference_turns(multi)
    assert second.startswith(TOOL_CALL)  # no preamble: one response can carry both calls
    teacher = ScriptedTeacher(tiny_teacher_dir, {multi["messages"][1]["content"]: [first + second, answer]})
    with TeacherServer(teacher) as server:
        client = client_for(server)
        turn = client.complete(multi["messages"], max_new_tokens=64, top_k=2, tools=item_tools(multi))
        assert [c["id"] for c in turn.tool_calls] == ["call_1_0", "call_1_1"]
        assert [c["name"] for c in turn.tool_calls] == [c["name"] for c in multi["expected_calls"]]
        assert turn.token_ids is None  # two calls in one message: the tokens do not spell our turns
        teacher.turn.clear()
        build_kd_set(kd_config("openai", {"base_url": server.base_url}), client, [multi], tmp_path / "kd.jsonl",
                     progress=False)  # fmt: skip
        last = server.requests[-1]["messages"]
    _, (record,) = read_kd_set(tmp_path / "kd.jsonl")
    assert record["completion_text"] == multi["reference"] and record["calls"] == multi["expected_calls"]
    assert record["fixture_hits"] == [True, True] and len(record["request_ids"]) == 2
    assert [m["role"] for m in last[-3:]] == ["assistant", "tool", "tool"]
    assert [c["id"] for c in last[-3]["tool_calls"]] == ["call_2_0", "call_2_1"]
    assert [m["tool_call_id"] for m in last[-2:]] == ["call_2_0", "call_2_1"]


def test_server_rejects_what_real_servers_reject(tiny_teacher):
    user = {"role": "user", "content": "weather in Paris?"}
    call = {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city":"Paris"}'}}
    calls = {"role": "assistant", "content": None, "tool_calls": [call]}
    bad = {
        "tool message without tool_call_id": [user, {"role": "tool", "content": "{}"}],
        "tool_call_id of no call": [user, calls, {"role": "tool", "tool_call_id": "c2", "content": "{}"}],
        "call never answered": [user, calls, {"role": "user", "content": "and?"}],
        "call without id": [user, {**calls, "tool_calls": [{k: v for k, v in call.items() if k != "id"}]}],
        "arguments not a string": [user, {**calls, "tool_calls": [{**call, "function": dict(name="f", arguments={})}]}],
    }  # fmt: skip
    with TeacherServer(tiny_teacher) as server, httpx.Client(base_url=server.base_url + "/") as http:
        for why, messages in bad.items():
            response = http.post("chat/completions", json={"messages": messages, "max_tokens": 2})
            assert response.status_code == 400, why
        ok = [user, calls, {"role": "tool", "tool_call_id": "c1", "content": '{"temperature":20}'}]
        assert http.post("chat/completions", json={"messages": ok, "max_tokens": 2}).status_code == 200
        assert len(server.requests) == 1



_USER = {"role": "user", "content": "weather in Paris?"}
_CALL = {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city":"Paris"}'}}
_CALLS = {"role": "assistant", "content": None, "tool_calls": [_CALL]}
_RESULT = {"role": "tool", "tool_call_id": "c1", "content": "{}"}


@pytest.mark.parametrize(
    ("body", "why"),
    [
        ([_USER], "body must be a JSON object"),
        ({"messages": []}, "messages must be a non-empty list"),
        ({"messages": [_USER], "tools": [{"type": "retrieval"}]}, "tools[0] must be {'type': 'function'"),
        ({"messages": [{"role": "robot", "content": "hi"}]}, "messages[0].role is invalid"),
        ({"messages": [_USER, {**_CALLS, "tool_calls": {"id": "c1"}}]}, "messages[1].tool_calls must be a list"),
        ({"messages": [_USER, {**_CALLS, "tool_calls": [{**_CALL, "type": "code"}]}, _RESULT]},
         "messages[1].tool_calls[0] must be {'type': 'function'"),
        ({"messages": [_USER, {**_CALLS, "content": 5}, _RESULT]}, "messages[1].content must be a string or null"),
        ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content must be a string"),
        ({"messages": [_USER, _CALLS]}, "the last assistant message has tool_calls without tool messages: ['c1']"),
    ],
)  # fmt: skip
def test_the_server_names_what_is_wrong_with_a_request(body: Any, why: str) -> None:
    from distillgates.teacher.server import _validate

    assert (_validate(body) or "").startswith(why)
    assert _validate({"messages": [_USER, _CALLS, _RESULT]}) is None

def test_logprobs_off_gives_a_text_only_kd_set(tiny_teacher, toy_items, client_for, tmp_path):
    with TeacherServer(tiny_teacher) as server:
        client = client_for(server, logprobs=False)
        cfg = kd_config("openai", {"base_url": server.base_url, "logprobs": False})
        build_kd_set(cfg, client, toy_items[:2], tmp_path / "kd.jsonl", progress=False)
        assert all("logprobs" not in b and "top_logprobs" not in b for b in server.requests)
    header, records = read_kd_set(tmp_path / "kd.jsonl")
    assert header["logprobs"] is False
    assert all(top == [] for r in records for top in r["topk_ids"]) and all(r["completion_ids"] for r in records)


def test_openai_messages_round_trip_the_renderers_form():
    """History from the data reader (interleaved parallel calls, no ids) converts to valid OpenAI
    messages (ids synthesized, each result answering its call) and back."""
    messages = [
        {"role": "system", "content": "S"},
        {"role": "user", "content": "U"},
        {"role": "assistant", "content": "P", "tool_calls": [{"name": "a", "arguments": {"x": 1}}]},
        {"role": "tool", "content": '{"r":1}'},
        {"role": "assistant", "content": "", "tool_calls": [{"name": "b", "arguments": {}}]},
        {"role": "tool", "content": '{"r":2}'},
        {"role": "assistant", "content": "done"},
        {"role": "user", "content": "again"},
    ]
    wire = openai_messages(messages)
    assert wire[2] == {"role": "assistant", "content": "P", "tool_calls": [
        {"id": "call_2", "type": "function", "function": {"name": "a", "arguments": '{"x":1}'}}]}  # fmt: skip
    assert wire[3] == {"role": "tool", "tool_call_id": "call_2", "content": '{"r":1}'}
    assert wire[4]["content"] is None and wire[5]["tool_call_id"] == wire[4]["tool_calls"][0]["id"] == "call_4"
    assert chat_messages(wire) == messages
    text_call = [{"role": "user", "content": "U"},  # a local model's call, written in the chat format
                 {"role": "assistant", "content": 'P<|tool_call|>{"name":"a","arguments":{}}'},
                 {"role": "tool", "content": "{}"}]  # fmt: skip
    assert openai_messages(text_call)[1]["tool_calls"][0]["id"] == openai_messages(text_call)[2]["tool_call_id"]
    broken = [{"role": "user", "content": "U"}, {"role": "assistant", "content": "x<|tool_call|>{"},
              {"role": "tool", "content": '{"error":"invalid tool call JSON"}'}]  # fmt: skip
    assert openai_messages(broken)[1]["tool_calls"][0]["function"] == {"name": "", "arguments": "{"}
    assert chat_messages(openai_messages(broken)) == broken  # the server renders what the model wrote
    with pytest.raises(ValueError, match=r"messages\[1\]: a tool result that answers no tool call"):
        openai_messages([{"role": "user", "content": "U"}, {"role": "tool", "content": "{}"}])


def test_evaluating_an_api_teacher_plays_its_parallel_calls(tiny_teacher_dir, toy_items, client_for):
    """The eval loop's teacher session: the item's tools sent, both parallel calls dispatched, the
    next request answering both ids (the server would answer 400 otherwise)."""
    multi = next(it for it in toy_items if it["kind"] == "multi")
    first, second, answer = reference_turns(multi)
    teacher = ScriptedTeacher(tiny_teacher_dir, {multi["messages"][1]["content"]: [first + second, answer]})
    with TeacherServer(teacher) as server:
        output = run_item(multi, TeacherRunner(client_for(server), max_new_tokens=64).session())
        assert [b["tools"] for b in server.requests] == [_wire_tools(multi)] * 2
    assert [c["call"] for c in output["calls"]] == multi["expected_calls"]
    assert all(c["fixture_hit"] for c in output["calls"]) and output["answer"] == answer


def test_the_server_answers_routes_keys_and_bodies_as_an_api_does(tiny_teacher):
    """A wrong key is 401 (the key never echoed), an unknown route 404, a body that is not JSON 400; the models
    route lists the model."""
    ok = {"messages": [_USER], "max_tokens": 2}
    server = TeacherServer(tiny_teacher, api_key="sk-right")
    with server, httpx.Client(base_url=server.base_url + "/") as http:
        wrong = http.post("chat/completions", json=ok, headers={"Authorization": "Bearer sk-wrong"})
        assert wrong.status_code == 401 and "sk-wrong" not in wrong.text
        assert http.get("models", headers={"Authorization": "Bearer sk-wrong"}).status_code == 401
        key = {"Authorization": "Bearer sk-right"}
        assert http.get("models", headers=key).json()["data"][0]["id"] == server.model_name
        assert http.get("nowhere", headers=key).status_code == 404
        assert http.post("embeddings", json=ok, headers=key).status_code == 404
        bad = http.post("chat/completions", content=b"{not json", headers=key)
        assert bad.status_code == 400 and "invalid JSON" in bad.text
        assert http.post("chat/completions", json=ok, headers=key).status_code == 200
