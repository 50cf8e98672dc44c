"""The KD step against a real OpenAI-compatible server this project did not write: ``transformers serve``.

The test builds a tiny random-weight Qwen2 model (nothing is downloaded) with a ChatML/Hermes chat
template that renders ``tools``, assistant ``tool_calls`` (``<tool_call>{json}</tool_call>``) and
``tool`` messages (the template refuses a tool message without ``tool_call_id``), and serves it
offline over loopback. transformers serve parses ``<tool_call>`` blocks of a ``qwen2`` model into
``message.tool_calls`` (ids ``<request id>_tool_call_<i>``) and ignores ``logprobs`` (it logs the
field as unsupported), so the teacher runs with ``teacher.api.logprobs: false``.

Random weights write garbage, so the model's ``generation_config.json`` carries a ``sequence_bias``
that, right after the multi item's user message, forces two parallel tool calls; everything else it
generates is unbiased garbage (a turn without calls, which the KD builder must take as text). The
test checks the protocol end to end, not quality.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from distillgates.data.tools import item_tools
from distillgates.teacher.http import HTTPTeacher, TeacherHTTPError
from distillgates.teacher.kd import build_kd_set, read_kd_set

from .conftest import kd_config

pytestmark = pytest.mark.integration

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>", "<tool_response>",
            "</tool_response>"]  # fmt: skip

# Hermes-style tool template (the layout Qwen2.5 and NousResearch models use), written for this test.
CHAT_TEMPLATE = """\
{%- if messages[0].role == 'system' %}{% set system = messages[0].content %}{% else %}{% set system = '' %}{% endif %}
{%- if tools %}
{{- '<|im_start|>system\\n' + system + '\\n\\n# Tools\\n<tools>' }}
{%- for tool in tools %}{{- '\\n' + (tool | tojson) }}{%- endfor %}
{{- '\\n</tools>\\nCall a tool with <tool_call>\\n{\"name\": <name>, \"arguments\": <object>}' }}
{{- '\\n</tool_call><|im_end|>\\n' }}
{%- elif system %}{{- '<|im_start|>system\\n' + system + '<|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
{%- if message.role == 'system' %}
{%- elif message.role == 'assistant' %}
{{- '<|im_start|>assistant\\n' + (message.content or '') }}
{%- for call in message.tool_calls or [] %}
{{- '\\n<tool_call>\\n{\"name\": \"' + call.function.name + '\", \"arguments\": ' }}
{{- (call.function.arguments | tojson) + '}\\n</tool_call>' }}
{%- endfor %}
{{- '<|im_end|>\\n' }}
{%- elif message.role == 'tool' %}
{%- if not message.tool_call_id %}{{ raise_exception('a tool message needs the tool_call_id it answers') }}{% endif %}
{{- '<|im_start|>tool\\n<tool_response>\\n' + message.tool_call_id + ': ' + message.content }}
{{- '\\n</tool_response><|im_end|>\\n' }}
{%- else %}
{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"""


def hermes_call(call: dict[str, Any]) -> str:
    return "<tool_call>\n" + json.dumps({"name": call["name"], "arguments": call["arguments"]}) + "\n</tool_call>"


def build_served_model(path: Path, corpus: list[str], trigger: str, forced: str) -> None:
    """A tiny Qwen2 + ChatML tokenizer at ``path``; greedy decoding writes ``forced`` right after
    ``trigger`` + the assistant header, and garbage anywhere else."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import GenerationConfig, PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=600, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())  # fmt: skip
    bpe.train_from_iterator(corpus, trainer)
    tok = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    tok.chat_template = CHAT_TEMPLATE
    tok.save_pretrained(path)
    end, pad = tok.convert_tokens_to_ids(["<|im_end|>", "<|endoftext|>"])
    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=4096,
                      eos_token_id=end, pad_token_id=pad, tie_word_embeddings=True)  # fmt: skip
    model = Qwen2ForCausalLM(cfg)
    with torch.no_grad():  # larger than HF's init: greedy output then varies (HF's writes one token forever)
        for name, param in model.named_parameters():
            if not name.endswith("norm.weight"):
                param.normal_(0.0, 0.3)
    model.save_pretrained(path)
    tail = tok.encode(trigger + "<|im_end|>\n<|im_start|>assistant\n")[-12:]  # ends the trigger prompt only
    target = [*tok.encode(forced), end]
    bias = [[tail + target[: i + 1], 100.0] for i in range(len(target))]
    bias += [[[tok.convert_tokens_to_ids(s)], -50.0] for s in SPECIALS if s != "<|im_end|>"]  # garbage is plain text
    GenerationConfig(eos_token_id=end, pad_token_id=pad, do_sample=False, sequence_bias=bias).save_pretrained(path)


class RecordingTransport(httpx.HTTPTransport):
    """A real HTTP transport that keeps every request body and response body (for the assertions)."""

    def __init__(self) -> None:
        super().__init__()
        self.exchanges: list[tuple[dict[str, Any], dict[str, Any]]] = []

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        response = super().handle_request(request)
        response.read()
        self.exchanges.append((json.loads(request.content), response.json() if response.status_code == 200 else {}))
        return response


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def served(tmp_path_factory, toy_items):
    """``(base_url, model_dir, multi item)`` of a ``transformers serve`` process on loopback (it needs
    the dev extra ``transformers[serving]``; without it the process exits and the log says so)."""
    tmp_path = tmp_path_factory.mktemp("serve")
    multi = next(it for it in toy_items if it["kind"] == "multi")
    corpus = [json.dumps(t) for it in toy_items for t in item_tools(it)]
    corpus += [json.dumps(it["messages"]) for it in toy_items]
    forced = "\n".join(hermes_call(c) for c in multi["expected_calls"])
    model_dir = tmp_path / "chatml-qwen2"
    build_served_model(model_dir, [*corpus, forced, CHAT_TEMPLATE], multi["messages"][-1]["content"], forced)
    port = _free_port()
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_HUB_DISABLE_TELEMETRY": "1",
           "OMP_NUM_THREADS": "1"}  # fmt: skip
    log = open(tmp_path / "serve.log", "w")  # noqa: SIM115 (closed below)
    process = subprocess.Popen(
        [sys.executable, "-m", "transformers.cli.transformers", "serve", str(model_dir), "--host", "127.0.0.1",
         "--port", str(port), "--device", "cpu", "--dtype", "float32", "--log-level", "info"],
        stdout=log, stderr=subprocess.STDOUT, env=env,
    )  # fmt: skip
    base_url = f"http://127.0.0.1:{port}"

    def log_text() -> str:
        return (tmp_path / "serve.log").read_text()

    try:
        deadline = time.monotonic() + 180
        while True:
            if process.poll() is not None:
                pytest.fail(f"transformers serve exited ({process.returncode}):\n{log_text()}")
            try:
                if httpx.get(f"{base_url}/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"transformers serve did not start in 180 s:\n{log_text()}")
            time.sleep(0.5)
        yield f"{base_url}/v1", model_dir, multi
    finally:
        process.terminate()
        try:
            process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        log.close()


def test_kd_set_from_transformers_serve(served, toy_items, tiny_tokenizer, tmp_path):
    base_url, model_dir, multi = served
    control = next(it for it in toy_items if it["kind"] == "control")
    items = [multi, control]
    cfg = kd_config("openai", {"base_url": base_url, "model_name": str(model_dir), "logprobs": False, "timeout_s": 120},
                    max_new_tokens=80, max_turns=3)  # fmt: skip
    transport = RecordingTransport()
    teacher = HTTPTeacher(cfg.teacher.api, tiny_tokenizer, api_key="", transport=transport)
    try:
        result = build_kd_set(cfg, teacher, items, tmp_path / "kd.jsonl", progress=False)
    finally:
        teacher.close()
    assert result.complete, result.message
    header, (multi_record, control_record) = read_kd_set(tmp_path / "kd.jsonl")
    assert header["logprobs"] is False
    # requests: the item's tools every time, no log-probs asked for
    sent = [body for body, _ in transport.exchanges]
    wire_tools = [{"type": "function", "function": t} for t in item_tools(multi)]
    assert [body["tools"] for body in sent[:2]] == [wire_tools, wire_tools]
    assert all("logprobs" not in body for body in sent)
    # the first answer: two parallel tool_calls, parsed by the server from the forced <tool_call> blocks
    first_calls = transport.exchanges[0][1]["choices"][0]["message"]["tool_calls"]
    arguments = [json.loads(c["function"]["arguments"]) for c in first_calls]
    assert arguments == [c["arguments"] for c in multi["expected_calls"]]
    # the second request answers both ids in tool messages after the assistant message that made the calls
    assistant, *results = sent[1]["messages"][-3:]
    assert [c["id"] for c in assistant["tool_calls"]] == [c["id"] for c in first_calls]
    assert [m["tool_call_id"] for m in results] == [c["id"] for c in first_calls]
    assert [json.loads(m["content"]) for m in results] == [f["result"] for f in multi["fixtures"]]
    # KD records: both calls played and hit their fixtures; the garbage turns are text (answers or cut short)
    assert multi_record["calls"] == multi["expected_calls"] and multi_record["fixture_hits"] == [True, True]
    assert multi_record["finish"] in ("stop", "length") and control_record["calls"] == []
    assert control_record["finish"] in ("stop", "length") and control_record["completion_text"]
    assert all(top == [] for r in (multi_record, control_record) for top in r["topk_ids"])  # text-only KD
    assert tiny_tokenizer.decode(multi_record["completion_ids"]) == multi_record["completion_text"]


def test_chatml_student_kd_set_from_transformers_serve(served, toy_items, chatml_tokenizer, tmp_path):
    """The same server and model, a student with the library's ChatML template: the KD rows are ChatML,
    the two parallel tool_calls one ``<tool_call>`` turn as the student's template writes them (no toy
    markup), and sequence-level training runs on the set."""
    from distillgates.data.chat import chat_format
    from distillgates.train.data import read_kd_set as read_training_records
    from distillgates.train.recipe import Recipe

    from ..train.conftest import tiny_config

    torch.set_num_threads(1)
    base_url, model_dir, multi = served
    control = next(it for it in toy_items if it["kind"] == "control")
    items = [multi, control]
    cfg = kd_config("openai", {"base_url": base_url, "model_name": str(model_dir), "logprobs": False, "timeout_s": 120},
                    max_new_tokens=80, max_turns=3)  # fmt: skip
    teacher = HTTPTeacher(cfg.teacher.api, chatml_tokenizer, api_key="")
    try:
        result = build_kd_set(cfg, teacher, items, tmp_path / "kd.jsonl", progress=False)
    finally:
        teacher.close()
    assert result.complete, result.message
    _, (multi_record, control_record) = read_kd_set(tmp_path / "kd.jsonl")
    fmt = chat_format(chatml_tokenizer)
    text = multi_record["completion_text"]
    call_turn = text.split(fmt.end_of_turn)[0]
    assert "<|tool_call|>" not in text and call_turn.count("<tool_call>") == 2
    assert fmt.parse_turn(call_turn).calls == multi["expected_calls"]
    assert text[len(call_turn) :].startswith("<|im_end|>\n<|im_start|>user\n<tool_response>")  # both results
    assert multi_record["calls"] == multi["expected_calls"] and multi_record["fixture_hits"] == [True, True]
    assert multi_record["prompt_text"] == fmt.prompt(multi) and control_record["calls"] == []
    assert chatml_tokenizer.decode(multi_record["completion_ids"]) == text
    records = read_training_records(tmp_path / "kd.jsonl")
    train = tiny_config(len(chatml_tokenizer), steps=3, lr=1e-2)
    recipe = Recipe(train.train, train.student, train.shapes, chatml_tokenizer, items, items[:1], tmp_path / "student",
                    kd_records=records, device="cpu", progress=False, speed_prompts=0)  # fmt: skip
    recipe.setup()
    for row in recipe.rows:  # sequence-level KD: a finished item's row is the prompt and the teacher's text
        if records[row.item["id"]]["finish"] == "stop":
            completion = chatml_tokenizer.decode(row.ids[row.prompt_len :])
            assert records[row.item["id"]]["completion_text"].startswith(completion)
    recipe.train()
    log = (tmp_path / "student" / "train_log.jsonl").read_text().splitlines()
    assert len([line for line in log if '"total"' in line]) == 3


def test_transformers_serve_ignores_logprobs_so_the_client_refuses_it(served, toy_items, tiny_tokenizer):
    base_url, model_dir, _ = served
    control = next(it for it in toy_items if it["kind"] == "control")
    api = kd_config("openai", {"base_url": base_url, "model_name": str(model_dir), "timeout_s": 120}).teacher.api
    teacher = HTTPTeacher(api, tiny_tokenizer, api_key="")
    try:
        with pytest.raises(TeacherHTTPError, match=r"set teacher\.api\.logprobs: false"):
            teacher.complete(control["messages"], max_new_tokens=8, top_k=4, tools=item_tools(control))
    finally:
        teacher.close()
