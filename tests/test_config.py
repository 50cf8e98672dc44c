"""Every YAML shipped in distillgates/configs/ loads; bad input names the file, line and field."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from distillgates.config import (
    Config,
    ConfigError,
    ExportConfig,
    ModelConfig,
    QATConfig,
    TrainConfig,
    load_config,
    load_model_config,
)
from distillgates.model import Transformer
from distillgates.project import EMBEDDED_DIR as CONFIGS

PIPELINE_YAMLS = sorted(p for p in CONFIGS.glob("*.yaml") if p.name != "hardware_profiles.yaml")


@pytest.mark.parametrize("path", PIPELINE_YAMLS, ids=lambda p: p.name)
def test_every_config_yaml_loads_and_validates(path: Path) -> None:
    assert isinstance(load_config(path), Config)


def test_hardware_profiles_yaml_is_validated_by_its_own_loader() -> None:
    from distillgates import hardware

    profiles = hardware.load_profiles(CONFIGS / "hardware_profiles.yaml")
    assert len(profiles) >= 11


@pytest.mark.parametrize(
    ("name", "role", "billions"),
    [
        ("student_7b_gqa", "student", 7),
        ("student_8b_gqa", "student", 8),
        ("student_9b_gqa", "student", 9),
        ("drafter_4b", "drafter", 4),
    ],
)
def test_big_configs_have_the_parameter_count_of_their_name(name: str, role: str, billions: int) -> None:
    cfg = load_model_config(CONFIGS / f"{name}.yaml", role)
    with torch.device("meta"):
        model = Transformer(cfg)
    n_params = sum(p.numel() for p in model.parameters())  # tied weights counted once
    assert abs(n_params / (billions * 1e9) - 1) <= 0.05, f"{name}: {n_params / 1e9:.2f}B"
    assert n_params == cfg.n_params


def test_toy_student_is_half_to_one_million_params() -> None:
    cfg = load_config(CONFIGS / "toy.yaml")
    assert cfg.student is not None and 0.5e6 <= cfg.student.n_params <= 1e6


def _write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    return path


MODEL = "student:\n  vocab_size: 64\n  d_model: 32\n  n_layers: 1\n  n_heads: 4\n  n_kv_heads: 2\n  ffn_hidden: 64\n"


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        (MODEL + "  max_seq_len: 512\n  n_experts: 4\n", "bad.yaml:9: student.n_experts: unknown key"),
        (MODEL + "  max_seq_len: long\n", "bad.yaml:8: student.max_seq_len: expected int, got str"),
        (MODEL.replace("n_kv_heads: 2", "n_kv_heads: 3") + "  max_seq_len: 512\n", "divisible by n_kv_heads"),
        (MODEL + "  max_seq_len: 512\n  head_dim: 7\n", "head_dim must be even for RoPE, got 7"),
        (MODEL + "  max_seq_len: 64\n", "student.max_seq_len (64) is below the largest enumerated shape"),
        ("train:\n  kd:\n    kind: mse\n", "bad.yaml:2: train.kd"),
        ("shapes:\n  lengths: [128, 256]\n  mix: [1.0]\n", "mix has 1 entries"),
        ("student: [1, 2]\n", "student: expected a mapping"),
        (MODEL.replace("  ffn_hidden: 64\n", "") + "  max_seq_len: 512\n", "missing required field(s): ffn_hidden"),
        ("speed:\n  repeats: true\n", "speed.repeats: expected int, got bool"),
        ("name: [unclosed\n", "invalid YAML"),
        ("export:\n  quantize: int3\n", "quantize must be none/int8/int4/palettize4/palettize6/palettize8"),
        ("export:\n  quantize: int4\n  int4_block_size: 0\n", "int4_block_size must be >= 1, got 0"),
        ("export:\n  quantize: palettize4\n  palettize_group_size: -8\n", "palettize_group_size must be >= 0, got -8"),
        ("export:\n  minimum_deployment_target: macOS14\n", "minimum_deployment_target must be macOS15/iOS18"),
        ("train:\n  qat: {enabled: true}\nexport:\n  quantize: palettize6\n",
         "train.qat.enabled: QAT trains the int8 or int4 grid of export.quantize, and export.quantize 'palettize6' "
         "has none"),
        ("train:\n  qat: {enabled: true}\nexport:\n  quantize: int4\n  calibration: clip_search\n",
         "train.qat.enabled with export.calibration 'clip_search'"),
        ("export:\n  quantize: int8\n  calibration: clip_search\n", "bad.yaml:1: export: calibration 'clip_search' "
         "calibrates int4 weights of layout standard, got quantize 'int8', layout 'standard'"),
        ("export:\n  quantize: int4\n  layout: ane\n  calibration: clip_search\n", "got quantize 'int4', layout 'ane'"),
        ("export:\n  quantize: int4\n  calibration: gptq\n", "calibration must be none/clip_search, got 'gptq'"),
        ("export:\n  target: coreai\n  layout: ane\n", "bad.yaml:1: export: target 'coreai' with layout 'ane': the "
         "Core AI target converts layout standard only"),
        ("export:\n  target: both\n  layout: ane\n", "target 'both' with layout 'ane'"),
        ("export:\n  target: coreai\nspeed:\n  engine: coreml\n", "speed.engine coreml times export/model.mlpackage, "
         "and export.target coreai writes none"),
        ("speed:\n  engine: coreai\n", "speed.engine coreai times export/model.aimodel, and export.target coreml "
         "writes none"),
        ("speed:\n  engine: mlx\n", "engine must be torch/coreml/coreai, got 'mlx'"),
        ("export:\n  quantize: int4\n  calibration: clip_search\n  calibration_rows: 0\n",
         "calibration_rows must be >= 1, got 0"),
    ],
)
def test_bad_config_names_file_line_and_field(tmp_path: Path, text: str, fragment: str) -> None:
    with pytest.raises(ConfigError) as err:
        load_config(_write(tmp_path, text))
    assert fragment in str(err.value)
    assert "bad.yaml" in str(err.value)


# one invalid value per validation of every section: the error names the file, the line and the section
EVERY_CHECK = [
    (MODEL + "  max_seq_len: 512\n  rope_scaling: {kind: yarn}\n", "student.rope_scaling", "kind must be"),
    (MODEL + "  max_seq_len: 512\n  rope_scaling: {kind: linear, factor: 0}\n", "student.rope_scaling", "factor"),
    (MODEL.replace("n_layers: 1", "n_layers: 0") + "  max_seq_len: 512\n", "student", "n_layers must be > 0"),
    (MODEL.replace("d_model: 32", "d_model: 30") + "  max_seq_len: 512\n", "student", "divisible by n_heads"),
    (MODEL + "  max_seq_len: 512\n  activation: relu\n", "student", "activation"),
    (MODEL + "  max_seq_len: 512\n  layer_types: [full_attention, full_attention]\n", "student", "layer_types"),
    (MODEL + "  max_seq_len: 512\n  layer_types: [sliding_attention]\n", "student", "sliding_window"),
    (MODEL + "  max_seq_len: 4096\ndrafter:" + MODEL.removeprefix("student:").replace("64", "65", 1)
     + "  max_seq_len: 4096\n", "Config", "drafter.vocab_size must equal student.vocab_size"),
    ("tokenizer:\n  chat_template: my-template\n", "tokenizer"),
    ("tokenizer:\n  tool_call_format: xml\n", "tokenizer"),
    ("shapes:\n  concentration_start: 0\n", "shapes"),
    ("shapes:\n  anneal_fraction: 0\n", "shapes"),
    ("shapes:\n  rare_every: -1\n", "shapes"),
    ("shapes:\n  lengths: []\n  mix: []\n", "shapes"),
    ("shapes:\n  lengths: [256, 128]\n  mix: [0.5, 0.5]\n", "shapes"),
    ("shapes:\n  lengths: [128, 256]\n  mix: [0.7, 0.7]\n", "shapes"),
    ("data:\n  verbose_share: 2\n", "data"),
    ("data:\n  eval_min_per_shape: -1\n", "data"),
    ("data:\n  max_skipped_share: 1\n", "data"),
    ("data:\n  source: csv\n", "data"),
    ("data:\n  source: jsonl\n", "data"),
    ("data:\n  eval_fraction: 1.5\n", "data"),
    ("teacher:\n  train: {steps: 0}\n", "teacher.train"),
    ("teacher:\n  train: {value_weight: 0}\n", "teacher.train"),
    ("teacher:\n  path: m\n  finetune: {lora: {r: 0}}\n", "teacher.finetune.lora"),
    ("teacher:\n  path: m\n  finetune: {steps: 0}\n", "teacher.finetune"),
    ("teacher:\n  path: m\n  finetune: {steps: 10, warmup_steps: 10}\n", "teacher.finetune"),
    ("teacher:\n  check: {items: -1}\n", "teacher.check"),
    ("teacher:\n  kind: remote\n", "teacher"),
    ("teacher:\n  kind: openai\n", "teacher"),
    ("teacher:\n  chat_template: fancy\n", "teacher"),
    ("kd:\n  top_k: 0\n", "kd"),
    ("kd:\n  max_turns: 0\n", "kd"),
    ("train:\n  kd: {temperature: 0}\n", "train.kd"),
    ("train:\n  length: {mask_excess: true}\n", "train.length"),
    ("train:\n  length: {target: shortest}\n", "train.length"),
    ("train:\n  length: {max_new_tokens: 0}\n", "train.length"),
    ("train:\n  length: {slope: 0}\n", "train.length"),
    ("train:\n  length: {cap: 0}\n", "train.length"),
    ("train:\n  on_policy: {temperature: 0}\n", "train.on_policy"),
    ("train:\n  on_policy: {max_turns: 0}\n", "train.on_policy"),
    ("train:\n  qat: {start_fraction: 1.0}\n", "train.qat"),
    ("train:\n  mixed_precision: fp8\n", "train"),
    ("train:\n  teacher_mode: hybrid\n", "train"),
    ("train:\n  steps: 10\n  warmup_steps: 10\n", "train"),
    ("train:\n  grad_accum: 0\n", "train"),
    ("train:\n  loss_chunk: -1\n", "train"),
    ("train:\n  init_from: gguf:model.bin\n", "train"),
    ("export:\n  target: onnx\n", "export"),
    ("export:\n  coreai_eval_items: -1\n", "export"),
    ("export:\n  coreai_eval_workers: 0\n", "export"),
    ("export:\n  fp16_scaling: always\n", "export"),
    ("export:\n  palettize_mode: random\n", "export"),
    ("export:\n  compute_units: GPU\n", "export"),
    ("export:\n  compute_precision: bf16\n", "export"),
    ("export:\n  layout: nchw\n", "export"),
    ("speed:\n  engine: mlx\n", "speed"),
    ("speed:\n  speculative_items: 0\n", "speed"),
    ("speed:\n  repeats: 0\n", "speed"),
    ("eval:\n  privacy: {allow: [a.b.c]}\n", "eval.privacy"),
    ("eval:\n  missing_fixture: ignore\n", "eval"),
    ("eval:\n  threads: 0\n", "eval"),
    ("eval:\n  max_calls: 0\n", "eval"),
]


@pytest.mark.parametrize(("text", "where", "fragment"), [c if len(c) == 3 else (*c, "") for c in EVERY_CHECK])
def test_every_validation_names_file_line_and_section(tmp_path: Path, text: str, where: str, fragment: str) -> None:
    path = _write(tmp_path, text)
    with pytest.raises(ConfigError) as err:
        load_config(path)
    assert re.match(rf"{re.escape(str(path))}(:\d+)?: {re.escape(where)}: ", str(err.value)), str(err.value)
    assert fragment in str(err.value)


def test_model_config_checks_hold_in_python_too() -> None:
    with pytest.raises(ValueError, match="divisible by n_kv_heads"):
        ModelConfig(vocab_size=8, d_model=32, n_layers=1, n_heads=4, n_kv_heads=3, ffn_hidden=8, max_seq_len=8)


def test_fingerprint_changes_with_any_field() -> None:
    cfg = load_config(CONFIGS / "toy.yaml")
    other = load_config(CONFIGS / "toy.yaml")
    assert cfg.fingerprint() == other.fingerprint()
    other.train.lr *= 2
    assert cfg.fingerprint() != other.fingerprint()


_TEACHER_YAML = """
teacher:
  model: {vocab_size: 96, d_model: 32, n_layers: 4, n_heads: 4, n_kv_heads: 2, ffn_hidden: 64, max_seq_len: 64,
          norm_eps: 9.999999747378752e-06, rope_theta: 100000.0}
shapes: {lengths: [32, 64], mix: [0.5, 0.5]}
train: {init_from: teacher}
drafter_train: {init_from: teacher}
"""


def test_a_model_pruned_from_the_teacher_inherits_what_it_must_share(tmp_path: Path) -> None:
    """A drafter/student trained from the teacher states its depth; the rest it must share comes from the teacher
    (a GGUF teacher's norm_eps is 1e-5 through float32: 1e-5 written counts as the same value)."""
    path = tmp_path / "c.yaml"
    path.write_text(_TEACHER_YAML + "student: {n_layers: 3, norm_eps: 1.0e-5}\ndrafter: {n_layers: 1}\n")
    cfg = load_config(path)
    assert cfg.teacher is not None and cfg.teacher.model is not None and cfg.student and cfg.drafter
    for model in (cfg.student, cfg.drafter):
        for name in ("vocab_size", "d_model", "n_heads", "n_kv_heads", "head_dim", "ffn_hidden", "norm_eps",
                     "rope_theta"):  # fmt: skip
            assert getattr(model, name) == getattr(cfg.teacher.model, name), name
        assert model.max_seq_len == 64  # the largest shape
    assert (cfg.student.n_layers, cfg.drafter.n_layers) == (3, 1)


def test_a_pruned_model_that_contradicts_the_teacher_names_its_own_section(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text(_TEACHER_YAML + "student: {n_layers: 3}\ndrafter:\n  n_layers: 1\n  d_model: 48\n")
    with pytest.raises(ConfigError, match=r"c\.yaml:11: drafter\.d_model: 48, but drafter_train\.init_from 'teacher'"):
        load_config(path)


def test_student_qat_follows_export_quantize() -> None:
    """int4 export: the student's QAT trains int4 per block of export.int4_block_size; int8 and none: int8."""
    int4 = Config(train=TrainConfig(qat=QATConfig(enabled=True)),
                  export=ExportConfig(quantize="int4", int4_block_size=64))
    assert int4.student_qat_int4_block == 64
    assert Config(export=ExportConfig(quantize="int8")).student_qat_int4_block is None
    assert Config(export=ExportConfig(quantize="none")).student_qat_int4_block is None
    assert Config(export=ExportConfig(quantize="palettize6")).student_qat_int4_block is None  # no QAT: allowed
