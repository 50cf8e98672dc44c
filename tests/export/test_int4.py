"""int4 per-block export of an int4-QAT'd model (lossless) and with post-training calibration (``clip_search``)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from distillgates.export.api import export_transformer
from distillgates.export.errors import ExportError
from distillgates.export.grid import calibrated_int4_scale, input_second_moments, int4_block_grid, quantized_weights
from distillgates.export.layout import build_layout
from distillgates.export.roundtrip import map_to_parameters, package_weights
from distillgates.model import Transformer
from distillgates.train.qat import QAT

from ..conftest import tiny_model_config
from .conftest import LENGTHS, TOKENIZER_FP, pipeline_config

BLOCK = 16


def _model(seed: int = 0) -> Transformer:
    torch.manual_seed(seed)
    return Transformer(tiny_model_config(vocab_size=64, max_seq_len=48)).eval()


def _qat_model() -> Transformer:
    """Two int4-QAT steps (block 16), finalized."""
    model = _model()
    qat = QAT(model, int4_block=BLOCK)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    idx = torch.randint(0, 64, (2, 12))
    for _ in range(2):
        torch.nn.functional.cross_entropy(qat(idx[:, :-1]).flatten(0, 1), idx[:, 1:].flatten()).backward()
        optimizer.step()
        optimizer.zero_grad()
    return qat.finalize()[0].eval()


def _rows(n: int, seed: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 64, (1, 24), generator=generator) for _ in range(n)]


def _export(model: Transformer, out: Path, **export: object):  # type: ignore[no-untyped-def]
    cfg = pipeline_config(quantize="int4", int4_block_size=BLOCK, **export)
    return export_transformer(model, cfg.export, LENGTHS, out, TOKENIZER_FP, raise_on_error=False,
                              calibration=_rows(8, 1) if cfg.export.calibration != "none" else None)  # fmt: skip


def _shipped(result, model: Transformer) -> dict[str, torch.Tensor]:  # type: ignore[no-untyped-def]
    """The prefill_16 weights read back from the package, by parameter name of ``model``."""
    from distillgates.export.convert import export_program
    from distillgates.export.wrappers import PrefillModule

    ep = export_program(PrefillModule(build_layout(model, "standard")), "prefill", LENGTHS)
    mapped = map_to_parameters(package_weights(result.packages["model"])["prefill_16"], ep, "model")
    return {name.removeprefix("core.model."): value for name, value in mapped.items()}


@pytest.mark.integration  # two int4 Core ML conversions (~20 s)
def test_export_of_an_int4_qat_model_ships_its_weights_and_a_perturbed_copy_fails_the_gate(tmp_path: Path) -> None:
    """The package read back holds the QAT'd weights (at the fp16 Core ML dequantizes to) and the parity gate
    passes; the same model with its weights moved off the grid after QAT is re-quantized and fails it."""
    model = _qat_model()
    result = _export(model, tmp_path / "qat")
    shipped = _shipped(result, model)
    names = [n.removeprefix("model.") for n in quantized_weights(build_layout(model, "standard"))]
    assert len(names) == 14 and sorted(result.qat_exact) == sorted(f"model.{n}" for n in names)
    for name in names:
        weight = model.get_parameter(name).detach()
        assert torch.equal(shipped[name], weight.half().float()), name  # codes and scales are the QAT ones
    # the tied head (QAT'd too) is quantized by coremltools' per-block pass: the same codes, scale within an fp16 ulp
    torch.testing.assert_close(shipped["lm_head.weight"], model.lm_head.weight.detach(), rtol=2e-3, atol=0)
    assert result.errors == [] and min(result.parity["cosine_by_shape"].values()) >= 0.999
    with torch.no_grad():  # the violation: weights moved by a third of a step after QAT
        for name in names:
            weight = model.get_parameter(name)
            _codes, scale = int4_block_grid(weight, BLOCK)
            noise = torch.randn_like(weight).reshape(scale.shape[0], -1, BLOCK) * scale[..., None] / 3
            weight.add_(noise.reshape(weight.shape))
    perturbed = _export(model, tmp_path / "perturbed")
    assert perturbed.qat_exact == []
    assert any("prefill weights (mlpackage_weights_roundtrip) vs eager cosine below 0.999" in e
               for e in perturbed.errors), perturbed.errors  # fmt: skip


def test_clip_search_lowers_the_output_error_of_int4_weights() -> None:
    """On a linear whose inputs have a few large channels (as LLM activations do), the calibrated scales give a
    smaller output error than the data-free ``max|block| / 7`` on held-out inputs."""
    torch.manual_seed(0)
    linear = torch.nn.Linear(64, 48, bias=False)
    gain = torch.ones(64)
    gain[torch.randperm(64)[:4]] = 20.0  # outlier input channels
    calibration, held_out = torch.randn(256, 64) * gain, torch.randn(256, 64) * gain
    blocks = calibration.reshape(256, -1, BLOCK)  # (N, nb, block)
    moments = torch.einsum("nbi,nbj->bij", blocks, blocks) / 256  # (nb, block, block)

    def output_error(scale: torch.Tensor | None) -> float:
        codes, s = int4_block_grid(linear.weight, BLOCK, scale)
        q = (codes * s[..., None]).reshape(linear.weight.shape)
        return float(((held_out @ q.T - held_out @ linear.weight.detach().T) ** 2).mean())

    data_free = output_error(None)
    calibrated = output_error(calibrated_int4_scale(linear.weight, BLOCK, moments))
    assert calibrated < 0.9 * data_free, (calibrated, data_free)


def test_clip_search_lowers_every_layers_output_error_on_a_tiny_model() -> None:
    """Calibration statistics from a tiny model's forward on some rows; on other rows, each quantized layer's output
    error (its float inputs times the weight error) is lower with the calibrated scales than with the data-free."""
    model = _model()
    moments = input_second_moments(model, _rows(8, 1), BLOCK)
    inputs: dict[int, list[torch.Tensor]] = {}

    def keep(key: int) -> object:
        return lambda _module, args: inputs.setdefault(key, []).append(args[0])

    hooks = [owner.register_forward_pre_hook(keep(id(w))) for owner, w in quantized_weights(model).values()]
    with torch.no_grad():
        for row in _rows(8, 2):
            model(row)
    for hook in hooks:
        hook.remove()

    def output_error(weight: torch.Tensor, grid: tuple[torch.Tensor, torch.Tensor]) -> float:
        codes, s = grid
        x = torch.cat(inputs[id(weight)]).reshape(-1, weight.shape[1])  # (tokens, in)
        return float(((x @ ((codes * s[..., None]).reshape(weight.shape) - weight.detach()).T) ** 2).mean())

    weights = quantized_weights(model)
    assert len(weights) == 14 and set(moments) == {id(w) for _o, w in weights.values()} | {id(model.lm_head.weight)}
    for name, (_owner, weight) in weights.items():
        calibrated = int4_block_grid(weight, BLOCK, calibrated_int4_scale(weight, BLOCK, moments[id(weight)]))
        assert output_error(weight, calibrated) < output_error(weight, int4_block_grid(weight, BLOCK)), name


@pytest.mark.integration  # two int4 Core ML conversions (~20 s)
def test_calibrated_export_ships_the_calibrated_grid(tmp_path: Path) -> None:
    """The package holds the clip_search grid (other scales than data-free, codes in [-7, 7]) and the model exported
    is untouched (calibration snaps a copy). On this random tiny model the parity is not better than data-free
    (each layer's error is, test above; the errors of clipped weights add up across layers): the 135M figure is in
    benchmarks.md section 9."""
    model = _model()
    data_free = _export(model, tmp_path / "free")
    calibrated = _export(model, tmp_path / "cal", calibration="clip_search")
    assert calibrated.contract["export"]["calibration"] == "clip_search"
    shipped = _shipped(calibrated, model)
    q_proj = shipped["layers.0.attn.q_proj.weight"]
    levels = [len(torch.unique(block)) for block in q_proj.reshape(-1, BLOCK)]
    assert max(levels) <= 15  # symmetric int4 codes [-7, 7] per block: the calibrated grid, no -8
    assert not torch.equal(q_proj, _shipped(data_free, model)["layers.0.attn.q_proj.weight"])  # other scales
    assert torch.equal(model.layers[0].attn.q_proj.weight, _model().layers[0].attn.q_proj.weight)  # model untouched
    assert min(calibrated.parity["cosine_by_shape"].values()) > 0.98  # measured (0.994 vs data-free 0.995)


def test_calibration_without_rows_is_refused(tmp_path: Path) -> None:
    cfg = pipeline_config(quantize="int4", calibration="clip_search")
    with pytest.raises(ExportError, match=r"export\.calibration 'clip_search' needs calibration rows, got none"):
        export_transformer(_model(), cfg.export, LENGTHS, tmp_path, TOKENIZER_FP)
