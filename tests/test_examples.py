"""examples/own-data: its config validates, its committed data is what its generator writes, and reads."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from distillgates.config import load_config
from distillgates.data.openai_format import read_items
from distillgates.eval.evaluate import check_eval_budget
from distillgates.pipeline import Pipeline
from distillgates.rundir import RunDir

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "own-data"


def _check_eval_budget(cfg, tmp_path):  # type: ignore[no-untyped-def]
    """The example's data step (in ``tmp_path``, the working directory) on its checkpoint's tokenizer: its eval budget
    holds every held-out reference, as the check step requires."""
    (tmp_path / "examples" / "own-data").symlink_to(EXAMPLE)
    Pipeline(cfg, tmp_path / "run").run(["data"])
    run = RunDir(tmp_path / "run")
    check_eval_budget(run.items("eval"), run.tokenizer(), cfg.eval.max_new_tokens, cfg.eval.max_calls)


def test_own_data_example_config_and_data():
    cfg = load_config(EXAMPLE / "config.yaml")
    assert cfg.data.source == "jsonl"
    assert cfg.eval.privacy.allow == ["create_ticket.reporter", "ticket_status.ticket_id"]
    assert cfg.tokenizer.chat_template == "chatml" and cfg.student.max_seq_len >= max(cfg.shapes.lengths)
    spec = importlib.util.spec_from_file_location("make_data", EXAMPLE / "make_data.py")
    assert spec is not None and spec.loader is not None
    make_data = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(make_data)
    for split in ("train", "eval"):
        path = EXAMPLE / f"{split}.jsonl"
        assert [json.loads(line) for line in path.read_text().splitlines()] == make_data.rows_of(split)
        items = read_items(path)
        kinds = {item["kind"] for item in items}
        assert {"single", "multi", "control", "decline"} <= kinds
        assert any(len(item["messages"]) > 2 for item in items)  # multi-turn history
        assert any(item.get("parallel_calls") for item in items)
        names = {call["name"] for item in items for call in item["expected_calls"]}
        assert names == {"create_ticket", "search_files", "ticket_status"}


@pytest.mark.integration
@pytest.mark.parametrize("config", ["config.yaml", "config-gpu.yaml"])
def test_smollm2_example_config_prunes_the_real_checkpoint(smollm2_gguf, smollm2_dir, tmp_path, monkeypatch, config):
    """examples/smollm2 (the CPU and the GPU recipe) validates with its checkpoint linked where the config names it
    (what link_checkpoint.py does, here in a scratch working directory; the conversion is the session's,
    ``smollm2_dir``): student and drafter inherit the teacher's architecture."""
    example = EXAMPLE.parent / "smollm2"
    (tmp_path / "examples" / "smollm2").mkdir(parents=True)
    (tmp_path / "examples" / "smollm2" / smollm2_gguf.name).symlink_to(smollm2_gguf)
    monkeypatch.chdir(tmp_path)
    cfg = load_config(example / config)
    assert cfg.tokenizer.chat_template == "chatml" and cfg.teacher is not None and cfg.teacher.path
    assert cfg.student is not None and cfg.drafter is not None
    assert (cfg.student.n_layers, cfg.drafter.n_layers) == (10, 2)
    for model in (cfg.student, cfg.drafter):
        assert (model.vocab_size, model.d_model, model.n_heads, model.n_kv_heads) == (49152, 576, 9, 3)
        assert model.norm_eps == 9.999999747378752e-06 and model.max_seq_len == max(cfg.shapes.lengths)
    _check_eval_budget(cfg, tmp_path)


@pytest.mark.integration
def test_gemma3_example_config_prunes_the_real_checkpoint(gemma3_gguf, gemma3_dir, tmp_path, monkeypatch):
    """examples/gemma3 validates with its checkpoint where link_checkpoint.py puts it (here linked in a scratch
    working directory; the conversion is the session's, ``gemma3_dir``): Gemma's tool-calling template, and the
    student and drafter inherit every Gemma 3 feature of the 270M."""
    example = EXAMPLE.parent / "gemma3"
    (tmp_path / "examples" / "gemma3").mkdir(parents=True)
    (tmp_path / "examples" / "gemma3" / gemma3_gguf.name).symlink_to(gemma3_gguf)
    monkeypatch.chdir(tmp_path)
    cfg = load_config(example / "config.yaml")
    assert cfg.tokenizer.chat_template == "gemma" and cfg.teacher is not None and cfg.teacher.finetune is not None
    assert cfg.student is not None and cfg.drafter is not None
    assert (cfg.student.n_layers, cfg.drafter.n_layers) == (9, 2)
    for model in (cfg.student, cfg.drafter):
        assert (model.vocab_size, model.d_model, model.n_heads, model.n_kv_heads, model.head_dim) == (262144, 640, 4, 1,
                                                                                                      256)
        assert model.embed_scale and model.sandwich_norm and model.qk_norm and model.activation == "gelu_tanh"
        assert model.sliding_window == 512 and model.query_pre_attn_scalar == 256
        assert model.max_seq_len == max(cfg.shapes.lengths) <= model.sliding_window  # no ring at these shapes
    assert cfg.export.compute_precision == "fp16" and cfg.export.fp16_scaling == "auto"
    _check_eval_budget(cfg, tmp_path)
