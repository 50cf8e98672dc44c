"""The API teacher path in the student's chat format: a ChatML student gets its KD rows in ChatML (Hermes
``<tool_call>`` blocks, parallel calls in one turn) whatever format the served teacher writes, and the
loopback server renders and parses in its own model's format. Real tokenizers and chat templates, a
real loopback HTTP server; the served model's generations are scripted (:class:`ScriptedTeacher`)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from distillgates.config import APIConfig
from distillgates.data.chat import chat_format
from distillgates.data.tools import item_tools
from distillgates.teacher.http import HTTPTeacher
from distillgates.teacher.kd import build_kd_set, read_kd_set
from distillgates.teacher.local import Generation
from distillgates.teacher.server import TeacherServer
from distillgates.teacher.tokens import TokenBytes
from distillgates.tokenizer import TOOL_CALL

from ..train.conftest import tiny_config
from .conftest import kd_config, save_tiny_teacher
from .test_http_protocol import ScriptedTeacher, reference_turns


class RecordingTeacher(ScriptedTeacher):
    """:class:`ScriptedTeacher` that keeps the prompts the server rendered for it."""

    def __init__(self, path: Path, script: dict[str, list[str]]) -> None:
        super().__init__(path, script)
        self.prompts: list[str] = []

    def generate(self, prompt_ids: list[int], max_new_tokens: int, *args: Any, **kwargs: Any) -> Generation:
        self.prompts.append(self.tokenizer.decode(prompt_ids, skip_special_tokens=False))
        return super().generate(prompt_ids, max_new_tokens, *args, **kwargs)


def hermes_calls(calls: list[dict[str, Any]]) -> str:
    """Parallel calls as a ChatML/Hermes model writes them (the layout of Qwen2.5's template)."""
    return "\n".join("<tool_call>\n" + json.dumps({"name": c["name"], "arguments": c["arguments"]},
                                                  ensure_ascii=False) + "\n</tool_call>" for c in calls)  # fmt: skip


def played(item: dict[str, Any], fmt: Any, preamble: str, answer: str) -> str:
    """The completion a teacher's parallel-call response and answer should give in ``fmt``: the student's
    template rendering the conversation (the calls in one assistant message, both results, the answer)."""
    calls = [{"id": f"c{j}", "type": "function",
              "function": {"name": c["name"], "arguments": json.dumps(c["arguments"])}}
             for j, c in enumerate(item["expected_calls"])]  # fmt: skip
    results = [{"role": "tool", "tool_call_id": f"c{j}", "content": json.dumps(f["result"], separators=(",", ":"))}
               for j, f in enumerate(item["fixtures"])]  # fmt: skip
    messages = [*item["messages"], {"role": "assistant", "content": preamble, "tool_calls": calls}, *results,
                {"role": "assistant", "content": answer}]  # fmt: skip
    return fmt.render(messages, item_tools(item))[len(fmt.prompt(item)) :]


def _client(server: TeacherServer, tokenizer: Any, **api: Any) -> HTTPTeacher:
    return HTTPTeacher(APIConfig(base_url=server.base_url, timeout_s=10.0, max_retries=0, **api), tokenizer, api_key="")


@pytest.fixture(scope="module")
def chatml_teacher_dir(tmp_path_factory, chatml_tokenizer) -> Path:
    return save_tiny_teacher(tmp_path_factory.mktemp("chatml-teacher"), chatml_tokenizer)


def test_a_toy_format_teacher_gives_a_chatml_student_chatml_rows(tiny_teacher_dir, chatml_tokenizer, toy_items,
                                                                 tmp_path):  # fmt: skip
    """The teacher writes toy calls, the server parses them into tool_calls, and the ChatML student's
    rows hold them as its template writes them: both parallel calls in one ``<tool_call>`` turn, no toy
    markup (main's client wrote ``<|tool_call|>{json}`` here, which the student's parser took for an answer)."""
    multi = next(it for it in toy_items if it["kind"] == "multi")
    control = next(it for it in toy_items if it["kind"] == "control")
    first, second, answer = reference_turns(multi)
    assert second.startswith(TOOL_CALL)  # one response can carry both calls
    script = {multi["messages"][1]["content"]: [first + second, answer],
              control["messages"][1]["content"]: reference_turns(control)}  # fmt: skip
    fmt = chat_format(chatml_tokenizer)
    with TeacherServer(RecordingTeacher(tiny_teacher_dir, script)) as server:
        client = _client(server, chatml_tokenizer)
        result = build_kd_set(kd_config("openai", {"base_url": server.base_url}, max_new_tokens=200), client,
                              [multi, control], tmp_path / "kd.jsonl", progress=False)  # fmt: skip
        bodies = list(server.requests)
        client.close()
    assert result.complete
    header, (record, control_record) = read_kd_set(tmp_path / "kd.jsonl")
    text = record["completion_text"]
    assert text == played(multi, fmt, first.split(TOOL_CALL)[0], answer)
    assert TOOL_CALL not in text and "<|tool_call|>" not in record["prompt_text"]
    call_turn = text.split(fmt.end_of_turn)[0]
    assert call_turn.count("<tool_call>") == 2  # parallel calls kept, in one turn as the template writes them
    assert record["prompt_text"] == fmt.prompt(multi) and record["prompt_text"].startswith("<|im_start|>system\n")
    assert record["calls"] == multi["expected_calls"] and record["fixture_hits"] == [True, True]
    assert record["answer"] == answer and record["finish"] == "stop"
    assert chatml_tokenizer.decode(record["completion_ids"]) == text
    assert header["tokenizer_fingerprint"] != ""  # the student's, not the teacher's
    # the teacher's toy tokens do not spell the ChatML call turn (text only); its answer is mapped through bytes
    n_answer = len(chatml_tokenizer.encode(answer, add_special_tokens=False))
    assert all(row == [] for row in record["topk_ids"][: len(fmt.encode(call_turn))])
    assert all(record["topk_ids"][-2 - n_answer : -2]) and record["topk_ids"][-2:] == [[], []]
    assert control_record["completion_text"] == reference_turns(control)[0] + "<|im_end|>\n"
    # the wire: no stop sent, no chat markup of either format, both results answering the server's ids
    assert all("stop" not in body for body in bodies)
    assert not any(mark in json.dumps(b["messages"]) for b in bodies for mark in (TOOL_CALL, "<tool_call>"))
    assistant, *results = bodies[1]["messages"][-3:]
    assert [c["id"] for c in assistant["tool_calls"]] == ["call_1_0", "call_1_1"]
    assert [m["tool_call_id"] for m in results] == ["call_1_0", "call_1_1"]


def test_a_chatml_teacher_served_in_its_format_keeps_its_distribution_and_trains(
    chatml_teacher_dir, chatml_tokenizer, toy_items, tmp_path
):
    """A teacher in the student's format: the server renders its prompts with the model's ChatML template
    and parses its Hermes calls; the client's rendering spells the teacher's own tokens, so every
    generated position keeps the teacher's top-k (parallel calls too), and the student trains on the set."""
    from distillgates.train.data import read_kd_set as read_training_records
    from distillgates.train.recipe import Recipe

    torch.set_num_threads(1)
    multi = next(it for it in toy_items if it["kind"] == "multi")
    single = next(it for it in toy_items if it["kind"] == "single")
    control = next(it for it in toy_items if it["kind"] == "control")
    fmt = chat_format(chatml_tokenizer)
    answer = reference_turns(multi)[-1]
    script = {multi["messages"][1]["content"]: [hermes_calls(multi["expected_calls"]), answer],
              single["messages"][1]["content"]: [hermes_calls(single["expected_calls"]), reference_turns(single)[-1]],
              control["messages"][1]["content"]: reference_turns(control)}  # fmt: skip
    teacher = RecordingTeacher(chatml_teacher_dir, script)
    items = [multi, single, control]
    with TeacherServer(teacher) as server:
        client = _client(server, chatml_tokenizer)
        result = build_kd_set(kd_config("openai", {"base_url": server.base_url}, max_new_tokens=200), client,
                              items, tmp_path / "kd.jsonl", progress=False)  # fmt: skip
        client.close()
        with httpx.Client(base_url=server.base_url + "/") as http:
            bad_stop = {"messages": multi["messages"], "max_tokens": 2, "stop": ["<|end|>"]}  # not a ChatML token
            response = http.post("chat/completions", json=bad_stop)
            assert response.status_code == 400 and "stop" in response.json()["error"]["message"]
    assert result.complete and result.coverage == 1.0, result.message
    _, records = read_kd_set(tmp_path / "kd.jsonl")
    record = records[0]
    text = record["completion_text"]
    assert text == played(multi, fmt, "", answer)
    assert text.startswith(hermes_calls(multi["expected_calls"]) + "<|im_end|>")  # the teacher's own text
    assert record["calls"] == multi["expected_calls"] and record["fixture_hits"] == [True, True]
    # the server rendered the teacher's prompts in its ChatML: the item, then both results in one user turn
    assert teacher.prompts[0] == fmt.prompt(multi)
    header = fmt.assistant_header
    assert teacher.prompts[1] == fmt.prompt(multi) + text[: text.rindex(header) + len(header)]
    assert "<tool_response>" in teacher.prompts[1] and teacher.prompts[1].count("<|im_start|>user") == 2
    # training runs on the ChatML KD set: the KD term is on (the teacher's top-k at every generated position)
    cfg = tiny_config(len(chatml_tokenizer), steps=3, lr=1e-2)
    recipe = Recipe(cfg.train, cfg.student, cfg.shapes, chatml_tokenizer, items, items[:1], tmp_path / "student",
                    kd_records=read_training_records(tmp_path / "kd.jsonl"), device="cpu", progress=False,
                    speed_prompts=0)  # fmt: skip
    recipe.setup()
    assert all(row.kd_ids for row in recipe.rows)
    recipe.train()
    log = [json.loads(line) for line in (tmp_path / "student" / "train_log.jsonl").read_text().splitlines()]
    steps = [r for r in log if "total" in r]
    assert len(steps) == 3 and all(r["kd"] > 0 and r["ce"] > 0 for r in steps)


def test_an_unparsable_chatml_call_is_answered_by_id_and_the_teacher_sees_its_own_text(
    chatml_teacher_dir, chatml_tokenizer, toy_items, tmp_path
):
    """The served model writes a Hermes call that does not parse: the server returns it as content, the
    student's parser finds the malformed call (error result), the next request sends the text with a
    nameless call whose id the result answers, and the server renders the model's own text back."""
    single = next(it for it in toy_items if it["kind"] == "single")
    broken = '<tool_call>\n{"name": "get_weather", "argum\n</tool_call>'
    good = hermes_calls(single["expected_calls"])
    answer = reference_turns(single)[-1]
    teacher = RecordingTeacher(chatml_teacher_dir, {single["messages"][1]["content"]: [broken, good, answer]})
    with TeacherServer(teacher) as server:
        client = _client(server, chatml_tokenizer, logprobs=False)
        result = build_kd_set(kd_config("openai", {"base_url": server.base_url, "logprobs": False}, max_new_tokens=200),
                              client, [single], tmp_path / "kd.jsonl", progress=False)  # fmt: skip
        bodies = list(server.requests)
        client.close()
    assert result.complete
    _, (record,) = read_kd_set(tmp_path / "kd.jsonl")
    assert record["calls"] == [None, *single["expected_calls"]] and record["fixture_hits"] == [None, True]
    assert record["completion_text"].startswith(broken + "<|im_end|>\n<|im_start|>user\n<tool_response>")
    assistant, result_message = bodies[1]["messages"][-2:]
    assert assistant["content"] == broken and assistant["tool_calls"][0]["function"]["name"] == ""
    assert result_message["tool_call_id"] == assistant["tool_calls"][0]["id"]
    assert json.loads(result_message["content"]) == {"error": "invalid tool call JSON"}
    fmt = chat_format(chatml_tokenizer)
    assert teacher.prompts[1].startswith(fmt.prompt(single) + broken + "<|im_end|>\n")  # its own text, as written


def test_evaluating_an_api_teacher_for_a_chatml_student(chatml_teacher_dir, chatml_tokenizer, toy_items):
    """The eval loop's teacher session in ChatML: both parallel calls of one response dispatched in one
    turn, the next request answering both ids (the server answers 400 otherwise), then the answer."""
    from distillgates.eval.runners import TeacherRunner, run_item

    multi = next(it for it in toy_items if it["kind"] == "multi")
    answer = reference_turns(multi)[-1]
    teacher = RecordingTeacher(chatml_teacher_dir, {multi["messages"][1]["content"]:
                                                    [hermes_calls(multi["expected_calls"]), answer]})  # fmt: skip
    with TeacherServer(teacher) as server:
        client = _client(server, chatml_tokenizer)
        output = run_item(multi, TeacherRunner(client, max_new_tokens=200).session())
        client.close()
        assert [m["tool_call_id"] for m in server.requests[1]["messages"][-2:]] == ["call_1_0", "call_1_1"]
    assert [c["call"] for c in output["calls"]] == multi["expected_calls"]
    assert all(c["fixture_hit"] for c in output["calls"]) and output["answer"] == answer
    assert output["turns"][0]["text"] == hermes_calls(multi["expected_calls"])  # one turn, both calls


def test_an_unstripped_hermes_preamble_keeps_the_teachers_distribution(chatml_tokenizer):
    """vLLM's Hermes parser returns all the text before ``<tool_call>`` as the content, its newline included:
    the turn is still the one the model wrote (the template writes that newline itself), so the log-probs
    spell it and the turn keeps the teacher's top-k rather than going text-only."""
    fmt = chat_format(chatml_tokenizer)
    arguments = json.dumps({"city": "Paris"})
    written = fmt.assistant_text("Let me check.", [{"id": "c0", "name": "get_weather", "arguments": arguments}])
    assert written.startswith("Let me check.\n<tool_call>")
    ids = chatml_tokenizer.encode(written, add_special_tokens=False)
    by_id = TokenBytes(chatml_tokenizer).by_id
    tokens = [{"token": by_id[i].decode("utf-8", errors="replace"), "logprob": -0.5, "bytes": list(by_id[i])}
              for i in ids]  # fmt: skip
    body = {"id": "r1", "choices": [{
        "message": {"role": "assistant", "content": "Let me check.\n", "tool_calls": [
            {"id": "c0", "type": "function", "function": {"name": "get_weather", "arguments": arguments}}]},
        "finish_reason": "tool_calls", "logprobs": {"content": [{**t, "top_logprobs": [t]} for t in tokens]}}]}
    client = HTTPTeacher(APIConfig(base_url="http://127.0.0.1:9", max_retries=0), chatml_tokenizer, api_key="")
    result = client._parse(body)
    client.close()
    assert result.text == written and result.content == "Let me check.\n"  # the message kept as it came
    assert result.token_ids == ids and result.topk_ids == [[i] for i in ids]
