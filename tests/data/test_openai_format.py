"""OpenAI chat-format rows -> items: calls, fixtures, history, labels, tools; bad rows name file, line, field."""

from __future__ import annotations

import copy
import json
import re

import pytest

from distillgates.config import Config, DataConfig, ShapesConfig, TokenizerConfig
from distillgates.data.build import build_data
from distillgates.data.chat import parse_transcript, render_prompt
from distillgates.data.dataset import DatasetError, read_dataset
from distillgates.data.openai_format import read_items, split_items
from distillgates.data.tools import item_tools, validate_call

from ..conftest import own_data_rows, write_jsonl


@pytest.fixture
def rows_file(tmp_path):
    path = tmp_path / "rows.jsonl"
    write_jsonl(path, own_data_rows())
    return path


def test_rows_become_items_with_calls_fixtures_and_their_own_tools(rows_file):
    items = {item["id"]: item for item in read_items(rows_file)}
    single = items["single-0"]
    assert [t["name"] for t in item_tools(single)] == ["create_ticket", "search_files"]
    assert single["expected_calls"] == [{"name": "create_ticket", "arguments": {
        "title": "VPN drops every 1 hours", "priority": "high", "urgent": True, "tags": ["network"]}}]
    assert single["fixtures"][0]["result"] == {"ticket_id": "T-1040", "status": "open"}
    assert "create_ticket(title,priority,urgent?:bool,tags?:list,reporter?:obj)" in single["messages"][0]["content"]
    assert "get_weather" not in single["messages"][0]["content"]  # the toy registry is not this item's tools
    for item in items.values():  # the reference replays the expected calls and ends in the answer
        calls, answer = parse_transcript(item["reference"])
        assert calls == item["expected_calls"] and answer
        assert all(not validate_call(c, item_tools(item)) for c in calls)


def test_parallel_calls_interleave_with_their_results_in_row_order(rows_file):
    item = {i["id"]: i for i in read_items(rows_file)}["parallel-0"]
    assert [c["name"] for c in item["expected_calls"]] == ["create_ticket", "search_files"]
    assert item["argument_alternatives"] == [{}, {"query": ["printer guide", "printer handbook"]}]
    reference = item["reference"]
    assert reference.index('"T-1041"') < reference.index('"search_files"')  # call 1, result 1, then call 2
    assert reference.startswith("On it.<|tool_call|>")


def test_multi_turn_history_is_prompt_and_the_last_turn_is_the_target(rows_file):
    item = {i["id"]: i for i in read_items(rows_file)}["multiturn-0"]
    assert item["instructions"] == "You are the IT helpdesk."
    assert item["messages"][0]["content"].startswith("You are the IT helpdesk. Tools: create_ticket(")
    assert [m["role"] for m in item["messages"]] == ["system", "user", "assistant", "tool", "assistant", "user"]
    assert [c["name"] for c in item["expected_calls"]] == ["create_ticket"]  # the history's search is not expected
    prompt = render_prompt(item)
    assert '<|assistant|><|tool_call|>{"name":"search_files"' in prompt and prompt.endswith("<|assistant|>")


def test_labels_and_unlabeled_kinds(rows_file):
    kinds = {i["id"]: i["kind"] for i in read_items(rows_file)}
    assert kinds == {"single-0": "single", "parallel-0": "multi", "multiturn-0": "single", "control-0": "control",
                     "decline-0": "decline", "chat-0": "no_tool"}
    decline = {i["id"]: i for i in read_items(rows_file)}["decline-0"]
    assert decline["pii"] == ["Lena Novak"] and not decline["tool_should_be_used"]


def _edit(fn):
    def mutate(row):
        row = copy.deepcopy(row)
        fn(row)
        return json.dumps(row)

    return mutate


def _set_arguments(message: int, text: str):
    return _edit(lambda r: r["messages"][message]["tool_calls"][0]["function"].__setitem__("arguments", text))


@pytest.mark.parametrize(
    ("line", "mutate", "field"),
    [
        (2, lambda row: json.dumps(row)[:-2], "<json>"),
        (1, _set_arguments(1, '{"title": "x", '), "messages[1].tool_calls[0].function.arguments"),
        (1, _set_arguments(1, '{"title": "x", "priority": "asap"}'), "messages[1].tool_calls[0].function.arguments"),
        (1, _set_arguments(1, '{"title": "x", "priority": "low", "urgent": "yes"}'),
         "messages[1].tool_calls[0].function.arguments"),
        (1, _edit(lambda r: r["messages"][1]["tool_calls"][0]["function"].__setitem__("name", "delete_all")),
         "messages[1].tool_calls[0].function.name"),
        (2, _edit(lambda r: r["messages"][3].pop("tool_call_id")), "messages[3].tool_call_id"),
        (2, _edit(lambda r: r["messages"].pop(3)), "messages[1].tool_calls[1].id"),
        (1, _edit(lambda r: r["messages"].pop()), "messages"),
        (1, _edit(lambda r: r["tools"][0]["function"]["parameters"]["properties"].__setitem__("x", {"type": "strin"})),
         "tools[0].parameters.properties.x.type"),
        (4, _edit(lambda r: r.__setitem__("labels", ["control"])), "labels"),
        (3, _edit(lambda r: r["messages"][5].__setitem__("role", "robot")), "messages[5].role"),
        (2, _edit(lambda r: r.__setitem__("argument_alternatives", {"zz": {"query": ["a"]}})),
         "argument_alternatives.zz"),
        (1, lambda row: "[1, 2]", "<row>"),
        (1, _edit(lambda r: r.__setitem__("tools", {"create_ticket": {}})), "tools"),
        (1, _edit(lambda r: r["tools"][0].__setitem__("type", "retrieval")), "tools[0].type"),
        (1, _edit(lambda r: r["tools"].__setitem__(0, "create_ticket")), "tools[0]"),
        (1, _edit(lambda r: r["messages"][1]["tool_calls"].__setitem__(0, "create_ticket")),
         "messages[1].tool_calls[0]"),
        (1, _edit(lambda r: r["messages"][1]["tool_calls"][0].__setitem__("id", "")), "messages[1].tool_calls[0].id"),
        (1, _edit(lambda r: r["messages"][1]["tool_calls"][0].__setitem__("function", "create_ticket")),
         "messages[1].tool_calls[0].function.name"),
        (1, _set_arguments(1, "[1, 2]"), "messages[1].tool_calls[0].function.arguments"),
        (2, _edit(lambda r: r["messages"][3].__setitem__("tool_call_id", r["messages"][2]["tool_call_id"])),
         "messages[3].tool_call_id"),
        (1, _edit(lambda r: r["messages"].__setitem__(0, {"role": "system", "content": "hi"})), "messages"),
        (1, _edit(lambda r: r["messages"][1].__setitem__("tool_calls", {"id": "x"})), "messages[1].tool_calls"),
        (2, _edit(lambda r: r["messages"][1]["tool_calls"][1].update(id=r["messages"][1]["tool_calls"][0]["id"])),
         "messages[1].tool_calls[1].id"),
        (1, _edit(lambda r: r["messages"].append({"role": "system", "content": "late"})), "messages[4].role"),
        (1, _edit(lambda r: r["messages"].insert(3, {"role": "assistant", "content": "early answer"})), "messages[4]"),
        (1, _edit(lambda r: r.__setitem__("locale", "xx")), "locale"),
        (2, _edit(lambda r: r.__setitem__("id", "single-0")), "id"),
    ],
)  # fmt: skip
def test_bad_rows_name_file_line_and_field(tmp_path, line, mutate, field):
    rows = own_data_rows()
    lines = [json.dumps(row) for row in rows]
    lines[line - 1] = mutate(rows[line - 1])
    path = tmp_path / "rows.jsonl"
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(DatasetError, match=re.escape(f"{path}:{line}: {field}:")):
        read_items(path)


@pytest.mark.parametrize("fmt", ["jsonl", "hf"])
def test_a_byte_that_is_not_utf8_names_file_line_and_byte(tmp_path, fmt):
    """A Latin-1 'é' (0xe9) in line 3: the error names the file, the line and the byte, in every reader of data files;
    under data.invalid_rows: skip the row is listed like any bad row."""
    if fmt == "hf":
        pytest.importorskip("datasets", reason="the 'hf' source needs the optional 'datasets' package")
    lines = [json.dumps(row).encode() for row in own_data_rows()]
    lines[2] = lines[2].replace(b'"content": "', b'"content": "caf\xe9 ', 1)
    path = tmp_path / "rows.jsonl"
    path.write_bytes(b"\n".join(lines) + b"\n")
    column = lines[2].index(b"\xe9") + 1
    with pytest.raises(DatasetError, match=re.escape(f"{path}:3: <utf-8>: byte 0xe9 at byte {column} of the line")):
        read_items(path, fmt)
    if fmt == "jsonl":
        skipped: list[dict[str, str]] = []
        assert len(read_items(path, skipped=skipped)) == len(lines) - 1
        assert [row["where"] for row in skipped] == [f"{path}:3"] and skipped[0]["reason"].startswith("<utf-8>:")


def test_a_dataset_file_with_a_byte_that_is_not_utf8_names_its_line(tmp_path):
    path = tmp_path / "dataset.jsonl"
    path.write_bytes(b'{"__header__": true}\n{"id": "caf\xe9"}\n')
    with pytest.raises(DatasetError, match=re.escape(f"{path}:2: <utf-8>: byte 0xe9 at byte 12 of the line")):
        read_dataset(path)


def test_split_is_seeded_and_disjoint():
    items = [{"id": str(i)} for i in range(50)]
    train, held = split_items(items, 0.2, seed=3)
    assert len(held) == 10 and not {i["id"] for i in train} & {i["id"] for i in held}
    assert split_items(items, 0.2, seed=3) == (train, held)
    assert split_items(items, 0.2, seed=4)[1] != held


def _config(path, **data) -> Config:
    return Config(tokenizer=TokenizerConfig(vocab_size=600),
                  data=DataConfig(source="jsonl", path=str(path), eval_fraction=0.25, **data),
                  shapes=ShapesConfig(lengths=[256, 512], mix=[0.5, 0.5]))  # fmt: skip


def test_data_step_builds_own_data_and_keeps_the_old_folder_on_a_bad_row(tmp_path):
    path = tmp_path / "rows.jsonl"
    write_jsonl(path, own_data_rows(variants=4))
    built = build_data(_config(path), tmp_path / "data")
    _, train = read_dataset(built.train, built.tokenizer_fingerprint)
    _, held = read_dataset(built.eval, built.tokenizer_fingerprint)
    assert len(train) + len(held) + sum(map(len, built.dropped.values())) == 24 and len(held) == 6
    assert all(item["tools"] == item_tools(item) and item_tools(item)[0]["name"] == "create_ticket" for item in train)
    before = {p.name: p.read_bytes() for p in (tmp_path / "data").glob("*.jsonl")}

    rows = own_data_rows(variants=4)
    rows[7]["messages"][1]["tool_calls"][0]["function"]["arguments"] = "{not json"
    write_jsonl(path, rows)
    with pytest.raises(DatasetError, match=re.escape(f"{path}:8: messages[1].tool_calls[0].function.arguments:")):
        build_data(_config(path), tmp_path / "data")
    assert {p.name: p.read_bytes() for p in (tmp_path / "data").glob("*.jsonl")} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["data", "rows.jsonl"]  # no staging folder left


def test_given_eval_file_is_the_eval_split(tmp_path):
    train_path, eval_path = tmp_path / "train.jsonl", tmp_path / "eval.jsonl"
    rows = own_data_rows(variants=2)
    write_jsonl(train_path, rows[:6])
    write_jsonl(eval_path, rows[6:])
    built = build_data(_config(train_path, eval_path=str(eval_path)), tmp_path / "data")
    assert {i["id"] for i in read_dataset(built.eval)[1]} | set(built.dropped["eval"]) == {r["id"] for r in rows[6:]}
    write_jsonl(eval_path, rows[:1])
    with pytest.raises(DatasetError, match="eval ids are training ids"):
        build_data(_config(train_path, eval_path=str(eval_path)), tmp_path / "data2")


@pytest.mark.parametrize("suffix", ["jsonl", "parquet"])
def test_hugging_face_datasets_source_gives_the_same_items(tmp_path, rows_file, suffix):
    pytest.importorskip("datasets", reason="the 'hf' source needs the optional 'datasets' package")
    rows = own_data_rows()
    # Arrow stores one schema for all rows: tools and arguments as JSON strings keep them exactly as written
    flat = [{**row, "tools": json.dumps(row["tools"]), "argument_alternatives": json.dumps(
        row.get("argument_alternatives", {})), "kind": row.get("kind", ""), "pii": row.get("pii", [])}
        for row in rows]  # fmt: skip
    path = tmp_path / f"rows.{suffix}"
    if suffix == "jsonl":
        write_jsonl(path, flat)
    else:
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.Table.from_pylist(flat), path)
    by_hf = read_items(path, "hf")
    by_jsonl = read_items(rows_file)
    for a, b in zip(by_hf, by_jsonl, strict=True):
        assert {**a, "id": b["id"]} == b

    flat[2]["messages"][5]["role"] = "robot"
    write_jsonl(tmp_path / "bad.jsonl", flat)
    with pytest.raises(DatasetError, match=re.escape(f"{tmp_path / 'bad.jsonl'}:3: messages[5].role:")):
        read_items(tmp_path / "bad.jsonl", "hf")


def test_parallel_groups_are_checked(rows_file):
    from distillgates.data.dataset import validate_item

    item = {i["id"]: i for i in read_items(rows_file)}["parallel-0"]
    for bad in ([[0, 1]], [[1, 3]], [["0", 2]], [[0, 2], [0, 2]]):
        with pytest.raises(DatasetError, match=r"x: parallel_calls\[\d\]:"):
            validate_item({**item, "parallel_calls": bad}, "x")


def test_hf_source_without_the_datasets_package_says_what_to_install(rows_file, monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "datasets", None)  # import datasets -> ImportError
    with pytest.raises(DatasetError, match=re.escape(f"{rows_file}: <file>: the 'datasets' package is needed")):
        read_items(rows_file, "hf")


# --------------------------------------------------------------------------------------
# Real-world rows (issue 30: classes 6-8)


def test_6_optional_arguments_row_field_reaches_the_item_the_scorer_and_the_broker(tmp_path):
    from distillgates.eval.broker import ToolBroker
    from distillgates.eval.scorer import score

    rows = own_data_rows()
    rows[1]["optional_arguments"] = {"b": ["max_results"]}  # parallel-0: search_files gives max_results 1
    write_jsonl(tmp_path / "rows.jsonl", rows)
    item = {i["id"]: i for i in read_items(tmp_path / "rows.jsonl")}["parallel-0"]
    assert item["optional_arguments"] == [[], ["max_results"]]
    without = [item["expected_calls"][0], {"name": "search_files", "arguments": {"query": "printer manual"}}]
    broker = ToolBroker.for_item(item)
    assert broker.call(**without[1]).hit  # left out, the fixture still answers
    output = {"id": item["id"], "calls": [{"raw": "", "call": c, "errors": [], "fixture_hit": True} for c in without],
              "turns": [], "answer": "", "tokens_out": 0, "ttfa_tokens": None}  # fmt: skip
    metrics = score([item], [output])
    assert metrics["arg_match_strict"] == 1.0 and metrics["arg_match_lax"] == 1.0

    for bad, field in (({"zz": ["max_results"]}, "optional_arguments.zz"),
                       ({"b": ["query"]}, "optional_arguments[1]"), ({"b": ["colour"]}, "optional_arguments[1]")):
        rows[1]["optional_arguments"] = bad
        write_jsonl(tmp_path / "rows.jsonl", rows)
        with pytest.raises(DatasetError, match=re.escape(f"{tmp_path / 'rows.jsonl'}:2: {field}:")):
            read_items(tmp_path / "rows.jsonl")


def _nonstandard_rows():
    rows = own_data_rows()
    rows[0]["tools"] = copy.deepcopy(rows[0]["tools"])  # the shared OWN_TOOLS
    params = rows[0]["tools"][0]["function"]["parameters"]
    params["properties"]["reporter"]["type"] = "dict"
    params["properties"]["tags"] = {"type": "tuple", "items": {"type": "any"}}
    params["properties"]["effort"] = {"type": "float"}
    return rows


def test_7_a_schema_with_non_json_schema_types_names_its_field_or_is_mapped_when_asked(tmp_path):
    path = tmp_path / "rows.jsonl"
    write_jsonl(path, _nonstandard_rows())
    field = r"tools\[0\]\.parameters\.properties\.(reporter|tags\.items|effort)\.type"
    with pytest.raises(DatasetError, match=re.escape(f"{path}:1: ") + field + ": not a valid JSON Schema") as err:
        read_items(path)
    assert "data.map_schema_types" in str(err.value)
    item = read_items(path, map_types=True)[0]
    properties = item["tools"][0]["parameters"]["properties"]
    assert properties["reporter"]["type"] == "object" and properties["effort"] == {"type": "number"}
    assert properties["tags"] == {"type": "array", "items": {}}
    assert validate_call({"name": "create_ticket", "arguments": {"title": "x", "priority": "low", "effort": 2}},
                         item_tools(item)) == []  # fmt: skip
    from distillgates.data.openai_format import map_schema_types

    assert map_schema_types({"type": ["dict", "null"], "properties": {"a": {"type": ["any", "string"]}}}) == {
        "type": ["object", "null"], "properties": {"a": {}}}  # fmt: skip
    with pytest.raises(ValueError, match="invalid_rows must be error/skip"):
        DataConfig(invalid_rows="ignore")


def test_8_skip_policy_lists_every_skipped_row_and_a_threshold_fails_the_step(tmp_path, capsys):
    from distillgates.pipeline import step_data
    from distillgates.rundir import RunDir

    path = tmp_path / "rows.jsonl"
    rows = own_data_rows(variants=4)
    rows[7]["messages"][1]["tool_calls"][0]["function"]["arguments"] = '{"title": "x", "priority": "asap"}'
    write_jsonl(path, rows)
    cfg = _config(path, invalid_rows="skip")
    summary = step_data(cfg, RunDir(tmp_path / "run"))
    skipped = [json.loads(line) for line in (tmp_path / "run" / "data" / "skipped_rows.jsonl").read_text().splitlines()]
    assert skipped == [{"where": f"{path}:8", "reason": "messages[1].tool_calls[0].function.arguments: value_error: "
                        "arguments.priority: 'asap' is not one of ['low', 'normal', 'high']"}]  # fmt: skip
    assert summary["skipped_rows"] == 1 and "skipped 1 invalid rows" in capsys.readouterr().err
    with pytest.raises(DatasetError, match=re.escape(f"{path}:8: messages[1].tool_calls[0].function.arguments:")):
        build_data(_config(path), tmp_path / "strict")  # the default policy is error

    before = (tmp_path / "run" / "data" / "train.jsonl").read_bytes()
    rows[9]["messages"] = []  # 2 of 24 rows: 8% > the default 5%
    write_jsonl(path, rows)
    with pytest.raises(DatasetError, match=re.escape(f"{path}: <file>: 2 of 24 rows are invalid, more than "
                                                     "data.max_skipped_share 0.05; the first: ")):  # fmt: skip
        step_data(cfg, RunDir(tmp_path / "run"))
    assert (tmp_path / "run" / "data" / "train.jsonl").read_bytes() == before
    assert step_data(_config(path, invalid_rows="skip", max_skipped_share=0.1), RunDir(tmp_path / "run"))[
        "skipped_rows"] == 2  # fmt: skip


def test_a_missing_or_empty_file_and_a_split_without_training_rows_are_named(tmp_path):
    for fmt in ("jsonl", "hf"):
        with pytest.raises(DatasetError, match=re.escape(f"{tmp_path / 'none.jsonl'}: <file>: not found")):
            read_items(tmp_path / "none.jsonl", fmt=fmt)
    blank = tmp_path / "blank.jsonl"
    blank.write_text("\n\n")
    with pytest.raises(DatasetError, match=re.escape(f"{blank}: <file>: no rows")):
        read_items(blank)
    with pytest.raises(DatasetError, match=r"eval_fraction 0\.9 leaves no training items out of 2"):
        split_items([{"id": "a"}, {"id": "b"}], 0.9, seed=0)
