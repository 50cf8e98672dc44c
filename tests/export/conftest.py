"""Session-scoped export artifacts for the export tests (conversion takes ~10-20 s per export)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from distillgates.config import Config, ExportConfig, ShapesConfig
from distillgates.export.api import ExportResult, export_model
from distillgates.model import Transformer, save_model

from ..conftest import tiny_model_config

LENGTHS = [16, 32]
TOKENIZER_FP = "tok-fingerprint-test"


def pipeline_config(**export: object) -> Config:
    return Config(shapes=ShapesConfig(lengths=LENGTHS, mix=[0.5, 0.5]), export=ExportConfig(**export))  # type: ignore[arg-type]


def fake_quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """int8 per-channel symmetric grid as a torch qint8 observer sets it (scale = max|w| / 127.5)."""
    flat = weight.reshape(weight.shape[0], -1)
    scale = flat.abs().amax(1) / 127.5  # (out,)
    zero = torch.zeros(weight.shape[0], dtype=torch.int32)
    return torch.fake_quantize_per_channel_affine(weight, scale, zero, 0, -128, 127), scale


def _model(seed: int) -> Transformer:
    torch.manual_seed(seed)
    # the export tests check shapes and errors against these two numbers (max_seq_len 48 > LENGTHS)
    return Transformer(tiny_model_config(vocab_size=64, max_seq_len=48)).eval()


@pytest.fixture(scope="session")
def tiny_ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("ckpt") / "model.pt"
    save_model(path, _model(0))
    return path


@pytest.fixture(scope="session")
def qat_ckpt(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, torch.Tensor]]:
    """Weights of every linear (not the tied embedding) on a QAT int8 per-channel grid, and their int8 codes."""
    model = _model(1)
    codes = {}
    with torch.no_grad():
        for name, module in model.named_modules():
            if isinstance(module, torch.nn.Linear) and name != "lm_head":
                on_grid, scale = fake_quantize_int8(module.weight)
                module.weight.copy_(on_grid)
                codes[name] = torch.round(on_grid / scale[:, None]).clamp(-128, 127)
    path = tmp_path_factory.mktemp("qat") / "model.pt"
    save_model(path, model)
    return path, codes


@pytest.fixture(scope="session")
def standard_export(tiny_ckpt: Path, tmp_path_factory: pytest.TempPathFactory) -> ExportResult:
    return export_model(tiny_ckpt, pipeline_config(quantize="none"), tmp_path_factory.mktemp("std"), TOKENIZER_FP)


@pytest.fixture(scope="session")
def int8_export(tiny_ckpt: Path, tmp_path_factory: pytest.TempPathFactory) -> ExportResult:
    """The toy default: int8 post-training quantization (weights not on a QAT grid)."""
    return export_model(tiny_ckpt, pipeline_config(quantize="int8"), tmp_path_factory.mktemp("ptq"), TOKENIZER_FP)


@pytest.fixture(scope="session")
def qat_int8_export(qat_ckpt: tuple[Path, dict], tmp_path_factory: pytest.TempPathFactory) -> ExportResult:
    return export_model(qat_ckpt[0], pipeline_config(quantize="int8"), tmp_path_factory.mktemp("int8"), TOKENIZER_FP)


@pytest.fixture(scope="session")
def ane_palettized_export(tiny_ckpt: Path, tmp_path_factory: pytest.TempPathFactory) -> ExportResult:
    cfg = pipeline_config(quantize="palettize6", layout="ane")
    return export_model(tiny_ckpt, cfg, tmp_path_factory.mktemp("ane"), TOKENIZER_FP)


@pytest.fixture(scope="session")
def fake_quant() -> object:
    return fake_quantize_int8


@pytest.fixture(scope="session")
def export_lengths() -> list[int]:
    return LENGTHS


GEMMA3_FEATURES = {"qk_norm": True, "head_dim": 16, "embed_scale": True, "activation": "gelu_tanh",
                   "sandwich_norm": True, "query_pre_attn_scalar": 12, "sliding_window": 5,
                   "layer_types": ["sliding_attention", "full_attention"],
                   "rope_local_theta": 100.0}  # Gemma 3's, with a window shorter than every enumerated length


def gemma3_model(**overrides: object) -> Transformer:
    """A tiny model with every Gemma 3 feature, its norms away from their init (so that leaving one out shows)."""
    torch.manual_seed(0)
    model = Transformer(tiny_model_config(**{"vocab_size": 64, "max_seq_len": 48, **GEMMA3_FEATURES, **overrides}))
    model.eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.normal_(0.5, 0.3)
    return model


def overflowing_model(family: str, vocab_size: int = 96) -> Transformer:
    """A model whose residual stream leaves fp16's range while its logits stay ordinary (the final norm): each
    block's addition to the stream scaled up (Gemma 3: its post norms; Llama: o_proj and down_proj)."""
    torch.manual_seed(0)
    if family == "gemma3":
        model = gemma3_model(vocab_size=vocab_size)
    else:
        model = Transformer(tiny_model_config(vocab_size=vocab_size, max_seq_len=48)).eval()
    with torch.no_grad():
        for layer in model.layers:
            for weight in ((layer.post_attn_norm.weight, layer.post_mlp_norm.weight) if family == "gemma3" else
                           (layer.attn.o_proj.weight, layer.mlp.down_proj.weight)):  # fmt: skip
                weight.mul_(1e6 if family == "gemma3" else 5e6)
    return model
