"""fp16 headroom: the peak activations of a real forward, and the layer pushed past fp16's range named."""

from __future__ import annotations

import copy
import math

import pytest
import torch

from distillgates.export.headroom import FP16_MAX, activation_peaks, fp16_headroom
from distillgates.model import Transformer

from ..conftest import tiny_model_config
from .conftest import overflowing_model


def _rows() -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return [torch.randint(0, 96, (1, n), generator=gen) for n in (5, 17, 30)]


def test_every_layer_output_and_linear_input_is_scanned() -> None:
    torch.manual_seed(0)
    model = Transformer(tiny_model_config()).eval()
    peaks = activation_peaks(model, _rows())
    assert {"embed", "layers.0.mlp.down_proj.input", "layers.1.attn.o_proj.input", "layers.1", "norm"} <= set(peaks)
    manual = model.layers[0].mlp(model.layers[0].mlp_norm(model.embed(_rows()[2])))
    assert peaks["layers.0.mlp"] >= float(manual.abs().max()) > 0
    headroom = fp16_headroom(model, _rows())
    assert headroom["over"] == [] and headroom["max_peak"] == max(peaks.values()) < FP16_MAX
    assert headroom["margin"] == pytest.approx(FP16_MAX / headroom["max_peak"]) and headroom["tokens"] == 52


def test_an_activation_pushed_past_fp16_is_named() -> None:
    """The injected violation: one MLP's down projection scaled until its output leaves fp16's range; the layers it
    feeds (the residual stream after it) are over too, and the worst is named."""
    torch.manual_seed(0)
    model = Transformer(tiny_model_config()).eval()
    with torch.no_grad():
        model.layers[0].mlp.down_proj.weight.mul_(1e8)
    headroom = fp16_headroom(model, _rows())
    assert "layers.0.mlp" in headroom["over"] and "layers.0.mlp.down_proj" in headroom["over"]
    assert "layers.0.mlp.down_proj.input" not in headroom["over"]  # its input is as before: the scan locates it
    assert headroom["max_peak"] > FP16_MAX and headroom["margin"] < 1.0
    with pytest.raises(ValueError, match="needs calibration rows"):
        fp16_headroom(model, [])


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_scaling_the_residual_stream_brings_it_into_fp16_with_the_same_logits(family: str) -> None:
    """The fix (export.fp16_scaling: auto): the stream times a power of two; fp32 logits unchanged, the scan clean,
    and an fp16 forward finite and close to fp32 where the unscaled model's is NaN."""
    from distillgates.export.headroom import residual_alpha, scale_residual

    model, rows = overflowing_model(family), _rows()
    before = fp16_headroom(model, rows)
    assert {"layers.0", "layers.1"} <= set(before["over"])
    alpha = residual_alpha(before)
    assert alpha < 1 and math.log2(alpha).is_integer()
    scaled = scale_residual(model, alpha)
    after = fp16_headroom(scaled, rows)
    assert after["over"] == [] and after["max_peak"] <= FP16_MAX / 2
    assert model.config.residual_scale == 1.0 and scaled.config.residual_scale == alpha  # the original is untouched
    with torch.no_grad():
        for row in rows:
            want = model(row)
            torch.testing.assert_close(scaled(row), want, atol=1e-4, rtol=1e-4)
            assert not torch.isfinite(copy.deepcopy(model).half()(row)).all()
            half = copy.deepcopy(scaled).half()(row).float()
            assert torch.isfinite(half).all()
            assert torch.nn.functional.cosine_similarity(half.flatten(), want.flatten(), dim=0) > 0.999
