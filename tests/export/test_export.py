"""Export to Core ML on Linux: every mode converts, contract read back from disk, lints fire, parity."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import coremltools as ct
import numpy as np
import pytest
import torch
from coremltools.converters.mil import Builder as mb
from coremltools.converters.mil.frontend.milproto.load import load as milproto_load
from coremltools.converters.mil.mil import types
from coremltools.models.utils import _convert_model_spec_to_pymil_prog
from torch import Tensor, nn

from distillgates.config import ExportConfig, load_config
from distillgates.export.api import export_model, export_transformer
from distillgates.export.contract import kv_layout, verify_contract
from distillgates.export.convert import convert_program, export_program
from distillgates.export.errors import ExportError
from distillgates.export.grid import int8_grid_scale
from distillgates.export.layout import ANETransformer, build_layout, head_widths, logits_names
from distillgates.export.lint import ANE_MAX_DIM, ane_op_lint, lint_int64_attention, lint_mil_ops, lint_shapes
from distillgates.export.wrappers import DecodeModule, PrefillModule
from distillgates.io import tree_sha256
from distillgates.model import Transformer, load_model, model_fingerprint, save_model

from ..conftest import tiny_model_config
from .conftest import GEMMA3_FEATURES

requires_macos = pytest.mark.requires_macos  # skipped off macOS by the plugin, with the reason


def _program_from_disk(path: Path) -> Any:
    """The MIL program of a saved package, rebuilt from the files on disk (not the in-memory model)."""
    model = ct.models.MLModel(str(path), skip_model_load=True)
    return _convert_model_spec_to_pymil_prog(model, model.get_spec().specificationVersion, milproto_load)


def _op_types(prog: Any, function: str | None = None) -> set[str]:
    functions = [prog.functions[function]] if function else prog.functions.values()
    return {op.op_type for f in functions for op in f.operations}


# --------------------------------------------------------------------------------------
# Conversion in every mode + contract


@pytest.mark.integration
def test_the_headroom_scan_needs_calibration_rows(standard_export) -> None:
    """Without rows (an API call that passes none) the figure says why it is missing; the pipeline always passes
    its first training conversations (tests/test_pipeline.py)."""
    assert standard_export.gate_inputs["fp16_headroom"]["skipped"].startswith("no calibration rows")


@pytest.mark.integration  # a Core ML conversion (~6 s)
def test_standard_export_contract_read_back(standard_export, tiny_ckpt, export_lengths) -> None:
    contract = json.loads(standard_export.contract_path.read_text())
    model = load_model(tiny_ckpt)
    cfg = model.config
    assert contract["model_fingerprint"] == model_fingerprint(model)
    assert contract["tokenizer_fingerprint"] == "tok-fingerprint-test"
    assert contract["enumerated_lengths"] == export_lengths
    assert contract["ok"] is True and verify_contract(contract, cfg, export_lengths) == []
    assert contract["contract_version"] == 3 and list(contract["packages"]) == ["model"]
    package = contract["packages"]["model"]
    assert package["path"] == "model.mlpackage" and package["default_function"] == "decode"
    assert sorted(package["functions"]) == ["decode", "prefill_16", "prefill_32"]
    prefill, decode = package["functions"]["prefill_16"], package["functions"]["decode"]
    assert [(f["name"], f["dtype"], f["shape"]) for f in prefill["inputs"]] == [
        ("input_ids", "INT32", [1, 16]), ("length", "INT32", [1])]  # fmt: skip
    assert package["functions"]["prefill_32"]["inputs"][0]["shape"] == [1, 32]  # one static function per length
    assert [(f["name"], f["dtype"]) for f in decode["inputs"]] == [("input_ids", "INT32"), ("position", "INT32")]
    assert prefill["kind"] == "prefill" and decode["kind"] == "decode"
    # output names really set: read the saved package from disk, each function
    spec = ct.models.MLModel(str(standard_export.packages["model"]), skip_model_load=True).get_spec()
    assert spec.specificationVersion >= 9  # macOS 15 (stateful models, multifunction)
    assert [f.name for f in spec.description.functions] == ["prefill_16", "prefill_32", "decode"]
    for function in spec.description.functions:
        assert [o.name for o in function.output] == ["logits"]
        assert list(function.output[0].type.multiArrayType.shape) == [1, cfg.vocab_size]
    kv = kv_layout(cfg)
    assert prefill["states"] == decode["states"] and contract["kv"]["shared_state"] is True  # one MLState for all
    assert [s["name"] for s in prefill["states"]] == kv["state_names"]
    assert all(s["shape"] == [1, 2, 48, 8] and s["dtype"] == "FLOAT16" for s in prefill["states"])
    assert contract["kv"]["bytes"] == 2 * cfg.n_layers * cfg.n_kv_heads * cfg.head_dim * cfg.max_seq_len * 2
    # every package as saved, for the identity gate
    assert contract["package_sha256"] == {p.name: tree_sha256(p) for p in standard_export.packages.values()}


@pytest.mark.integration
def test_verify_contract_catches_tampering(standard_export, tiny_ckpt, export_lengths) -> None:
    contract = json.loads(standard_export.contract_path.read_text())
    functions = contract["packages"]["model"]["functions"]
    functions["decode"]["outputs"][0]["name"] = "var_123"
    functions["prefill_16"]["inputs"][0]["shape"] = [1, 32]
    functions["prefill_32"]["states"][0]["shape"] = [1, 2, 40, 8]
    del functions["decode"]["states"][-1]
    contract["tokenizer_fingerprint"] = ""
    errors = verify_contract(contract, load_model(tiny_ckpt).config, export_lengths)
    assert any("decode: outputs are ['var_123']" in e for e in errors)
    assert any("prefill_16: input_ids shape [1, 32], expected [1, 16]" in e for e in errors)
    assert any("prefill_32: state k_cache_0 has shape [1, 2, 40, 8]" in e for e in errors)
    assert any("decode: states" in e for e in errors)
    assert any("kv.shared_state is True, but the functions' states say False" in e for e in errors)
    assert any("tokenizer_fingerprint" in e for e in errors)
    del functions["prefill_32"]
    errors = verify_contract(contract, load_model(tiny_ckpt).config, export_lengths)
    assert any("prefill_32: function missing from the contract" in e for e in errors)


@pytest.mark.integration
def test_exported_parity_per_shape_and_decode(standard_export, export_lengths) -> None:
    gate = standard_export.gate_inputs["export"]
    assert gate["source"] == "mlpackage_weights_roundtrip"
    assert sorted(gate["cosine_by_shape"]) == sorted(str(n) for n in export_lengths)
    assert all(c >= 0.999 for c in gate["cosine_by_shape"].values())
    assert len(gate["decode_cosine"]) == 16
    assert min(gate["decode_cosine"]) >= 0.999
    assert gate["int64_on_attention"] == [] and gate["lint_errors"] == [] and gate["contract_ok"] is True


@pytest.mark.integration
def test_stateful_decode_program(standard_export) -> None:
    ops = _op_types(_program_from_disk(standard_export.packages["model"]), "decode")
    assert {"read_state", "coreml_update_state", "scaled_dot_product_attention"} <= ops
    assert not ops & {"shape", "fill", "band_part", "scatter_nd"}


@pytest.mark.integration  # an int8 Core ML conversion (~8 s)
def test_qat_int8_exports_without_drift(qat_int8_export, qat_ckpt) -> None:
    path, qat_codes = qat_ckpt
    model = load_model(path)
    linears = {n: m for n, m in model.named_modules() if isinstance(m, nn.Linear) and n != "lm_head"}
    assert sorted(qat_int8_export.qat_exact) == sorted(f"model.{n}.weight" for n in linears)
    prog = _program_from_disk(qat_int8_export.packages["model"])
    quantized = [op for op in prog.functions["decode"].operations if op.op_type.startswith("constexpr_")]
    by_name = {op.name: op for op in quantized}
    for name, module in linears.items():
        op = by_name[f"p_core_model_{name.replace('.', '_')}_weight_cast_fp16"]
        codes = op.inputs["data"].val.astype(np.float32)
        assert np.array_equal(codes, qat_codes[name].numpy()), f"{name}: int8 codes differ from the QAT codes"
        # Core ML dequantizes in fp16 (the scale is stored fp16): within 1 fp16 ulp of the fp16 weight
        dequant = (codes * op.inputs["scale"].val.astype(np.float32)).astype(np.float16).astype(np.float32)
        reference = module.weight.detach().numpy().astype(np.float16).astype(np.float32)
        ulp = np.spacing(np.abs(reference).astype(np.float16)).astype(np.float32)
        assert np.all(np.abs(dequant - reference) <= ulp), f"{name}: dequantized weights off by more than 1 fp16 ulp"
    # RoPE tables are not weights: they stay uncompressed
    assert not [op for op in quantized if "rope" in op.name]
    # the check can fail: plain per-channel PTQ (scale max|w|/127) gives other codes for these weights
    weight = next(iter(linears.values())).weight.detach()
    ptq_codes = torch.round(weight / (weight.abs().amax(1, keepdim=True) / 127))
    assert not torch.equal(ptq_codes, next(iter(qat_codes.values())))
    assert all(c >= 0.999 for c in qat_int8_export.gate_inputs["export"]["cosine_by_shape"].values())


def test_int8_grid_scale_detects_grids(fake_quant) -> None:
    weight = torch.randn(24, 40)
    on_grid, _ = fake_quant(weight)
    found = int8_grid_scale(on_grid)
    assert found is not None
    torch.testing.assert_close(torch.round(on_grid / found) * found, on_grid, rtol=0, atol=1e-6)
    assert int8_grid_scale(weight) is None  # plain float weights are not on a grid


@pytest.mark.integration  # a palettized Core ML conversion (~9 s)
def test_ane_layout_palettized_export(ane_palettized_export, export_lengths) -> None:
    prog = _program_from_disk(ane_palettized_export.packages["model"])
    ops = _op_types(prog)
    assert "conv" in ops and "linear" not in ops  # 1x1 convs in the ANE layout
    assert "constexpr_lut_to_dense" in ops  # palettized weights
    luts = [op for f in prog.functions.values() for op in f.operations if op.op_type == "constexpr_lut_to_dense"]
    assert all(op.inputs["lut"].val.shape[-2] == 2**6 for op in luts)  # 6-bit palettes
    assert ane_palettized_export.contract["ok"]
    lint = ane_palettized_export.gate_inputs["ane_lint"]  # the (B, C, 1, S) layout passes the ANE lint too
    assert lint["ineligible_ops"] == [] and lint["over_limits"] == []
    assert all(c >= 0.999 for c in ane_palettized_export.parity["cosine_by_shape"].values())


def test_ane_layout_equals_standard_in_fp32(tiny_ckpt) -> None:
    model = load_model(tiny_ckpt).eval()
    ane = ANETransformer.from_standard(model).eval()
    assert ane.layers[0].attn.q_proj.weight.shape == (32, 32, 1, 1)  # (out, in) -> (out, in, 1, 1) by the hook
    ids = torch.randint(0, 64, (1, 20))
    with torch.no_grad():
        torch.testing.assert_close(ane(ids), model(ids), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_both_kv_writes_write_the_same_slot(tiny_ckpt, dtype: torch.dtype) -> None:
    """Core ML's decode (index_put, lowered to slice_update) and Core AI's (index_copy) are one decode: same cache, same
    logits, step by step after a prefill, in fp32 and in the fp16 model Core AI's fp16 compute converts."""
    model = load_model(tiny_ckpt).to(dtype).eval()
    core = build_layout(model, "standard").eval()
    prefill = PrefillModule(core).eval()
    decodes = [DecodeModule(core, kv_write=k).eval() for k in ("slice_update", "index_copy")]
    assert decodes[0].k_cache_0.dtype == dtype
    with torch.no_grad():
        prefill(torch.randint(0, 64, (1, 16), dtype=torch.int32), torch.tensor([10], dtype=torch.int32))
        for decode in decodes:
            for name, buffer in decode.named_buffers():
                if "cache" in name:
                    buffer.copy_(dict(prefill.named_buffers())[name])
        for t in range(10, 14):
            token, position = torch.tensor([[t + 3]], dtype=torch.int32), torch.tensor([t], dtype=torch.int32)
            logits = [decode(token, position) for decode in decodes]
            torch.testing.assert_close(logits[0], logits[1], rtol=0, atol=0)
    torch.testing.assert_close(decodes[0].v_cache_1, decodes[1].v_cache_1, rtol=0, atol=0)
    with pytest.raises(ValueError, match="kv_write must be one of"):
        DecodeModule(core, kv_write="scatter")


@pytest.mark.parametrize("kv_write", ["slice_update", "index_copy"])
@pytest.mark.parametrize("length", [3, 9])  # a prompt inside the window (5), and one past it
def test_sliding_layers_keep_a_ring_of_their_window(kv_write: str, length: int) -> None:
    """A sliding layer's state is a ring of its window's slots (Gemma 3: 5 of 48 here), the global layer's the whole
    context; prefill (padded to 12) then decode 14 steps, wrapping the ring three times, give the eager model's
    logits, as the full cache with a window mask does. Padding written into the ring would overwrite slots the window
    still holds: the decode after it fails."""
    from .conftest import gemma3_model

    model = gemma3_model()
    cfg = model.config
    assert (cfg.ring_len, [cfg.state_len(i) for i in range(2)]) == (5, [5, 48])
    core = build_layout(model, "standard").eval()
    ids = torch.randint(0, 64, (1, length + 14), generator=torch.Generator().manual_seed(length))
    got = {}
    for ring in (True, False):
        prefill, decode = PrefillModule(core, ring=ring).eval(), DecodeModule(core, kv_write, ring=ring).eval()
        assert [tuple(getattr(decode, f"k_cache_{i}").shape) for i in range(2)] == \
            [(1, cfg.n_kv_heads, 5 if ring else 48, 16), (1, cfg.n_kv_heads, 48, 16)]  # fmt: skip
        padded = torch.zeros(1, 12, dtype=torch.int32)
        padded[0, :length] = ids[0, :length]
        logits = []
        with torch.no_grad():
            prefill(padded, torch.tensor([length], dtype=torch.int32))
            for name, buffer in decode.named_buffers():
                if "cache" in name:
                    buffer.copy_(dict(prefill.named_buffers())[name])
            for t in range(length, length + 14):
                logits.append(decode(ids[:, t : t + 1].int(), torch.tensor([t], dtype=torch.int32)))
                torch.testing.assert_close(logits[-1][0], model(ids[:, : t + 1])[0, -1], rtol=1e-4, atol=1e-4)
        got[ring] = torch.cat(logits)
    torch.testing.assert_close(got[True], got[False], rtol=1e-5, atol=1e-5)


def test_the_contract_holds_each_states_shape() -> None:
    """``kv.state_shapes``: the sliding layers' rings and the global layers' whole context; bytes count every state;
    a package whose state has the other shape is named."""
    from distillgates.export.contract import function_errors

    from .conftest import gemma3_model

    cfg = gemma3_model().config
    kv = kv_layout(cfg)
    assert kv["ring_len"] == 5 and kv["state_shapes"]["k_cache_0"] == [1, cfg.n_kv_heads, 5, 16]
    assert kv["state_shapes"]["v_cache_1"] == [1, cfg.n_kv_heads, 48, 16]
    assert kv["bytes"] == 2 * (5 + 48) * cfg.n_kv_heads * 16 * 2
    outputs = [{"name": "logits", "shape": [1, 64]}]
    inputs = {"decode": ["input_ids", "position"], "prefill_8": ["input_ids", "length"]}
    functions = {name: {"inputs": [{"name": n, "dtype": "INT32", "shape": [1, 1 if name == "decode" else 8]}
                                   for n in inputs[name]],
                        "outputs": outputs,
                        "states": [{"name": n, "shape": kv["state_shapes"][n]} for n in kv["state_names"]]}
                 for name in ("prefill_8", "decode")}  # fmt: skip
    assert function_errors({"model": {"functions": functions}}, cfg, [8]) == []
    functions["decode"]["states"][0]["shape"] = [1, cfg.n_kv_heads, 48, 16]  # a full cache where the ring belongs
    assert function_errors({"model": {"functions": functions}}, cfg, [8]) == \
        [f"decode: state k_cache_0 has shape [1, {cfg.n_kv_heads}, 48, 16], expected [1, {cfg.n_kv_heads}, 5, 16]"]


@pytest.mark.integration  # torch.export of both wrappers (~5 s)
@pytest.mark.parametrize("shared", [True, False])
def test_runner_parity_through_package_runners(tiny_ckpt, export_lengths, shared: bool) -> None:
    """The parity Core ML's and Core AI's gates share (``runner_parity``), through package runners: here the
    exported programs standing in for ``MLModel.predict`` (fp16 states, as Core ML's), one state shared by every
    function or copied over; measured against another model's logits it fails."""
    from distillgates.export.parity import runner_parity
    from distillgates.runtime.coreml_engine import stand_in_engine

    model = load_model(tiny_ckpt)
    engine = stand_in_engine(model, export_lengths, shared_state=shared)
    names = logits_names(model.config.vocab_size)
    parity = runner_parity(engine.prefill_runners, engine.decode_runner, names, model, export_lengths, shared)
    assert min(parity["cosine_by_shape"].values()) > 0.999 and min(parity["decode_cosine"]) > 0.999
    assert parity["top1_agreement"] == 1.0 and len(parity["decode_cosine"]) == 16
    assert parity["top1_gaps"] == [0.0] * len(parity["top1_gaps"])  # one per case, 0: no argmax flipped
    other = load_model(tiny_ckpt)
    with torch.no_grad():
        other.layers[0].mlp.down_proj.weight.mul_(3.0)  # the artifact of another model fails it
    broken = runner_parity(engine.prefill_runners, engine.decode_runner, names, other, export_lengths, shared)
    assert min(broken["cosine_by_shape"].values()) < 0.999 and min(broken["decode_cosine"]) < 0.999


# --------------------------------------------------------------------------------------
# Lints


class _Int64Prefill(PrefillModule):
    """Violates the int64 lint: positions from an int64 cumsum feed RoPE, the mask and the KV write."""

    def forward(self, input_ids: Tensor, length: Tensor) -> Tensor:
        return super().forward(input_ids.long(), length.long())


@pytest.mark.integration  # torch.export of the prefill (~5 s)
def test_int64_lint_fires_on_attention_path(tiny_ckpt, export_lengths) -> None:
    core = build_layout(load_model(tiny_ckpt), "standard")
    clean = export_program(PrefillModule(core), "prefill", export_lengths)
    assert lint_int64_attention(clean) == []
    bad = export_program(_Int64Prefill(core), "prefill", export_lengths)
    errors = lint_int64_attention(bad)
    assert errors and all("int64 on attention path" in e for e in errors)


class _DynamicShape(nn.Module):
    """Violates the dynamic-shape lint: a table sliced and a tensor filled with the traced length."""

    def forward(self, x: Tensor) -> Tensor:
        return x + torch.ones(x.shape[1]) * torch.arange(x.shape[1]).float()  # fill + range from a dynamic dim


class _Scatter(nn.Module):
    """Violates the CPU-op lint: index_put with a vector of indices lowers to scatter_nd."""

    def forward(self, x: Tensor, idx: Tensor) -> Tensor:
        out = x.clone()
        out[idx] = 0.0
        return out


def _convert(module: nn.Module, args: tuple[Tensor, ...], inputs: list[ct.TensorType], dynamic: Any = None) -> Any:
    ep = torch.export.export(module.eval(), args, dynamic_shapes=dynamic).run_decompositions({})
    return ct.convert(ep, convert_to="mlprogram", inputs=inputs, minimum_deployment_target=ct.target.macOS15,
                      skip_model_load=True)  # fmt: skip


def test_dynamic_shape_lint_fires() -> None:
    shapes = ct.EnumeratedShapes(shapes=[(1, 4), (1, 8)], default=(1, 8))
    mlmodel = _convert(_DynamicShape(), (torch.zeros(1, 8),), [ct.TensorType(name="x", shape=shapes)],
                       dynamic=({1: torch.export.Dim.AUTO},))  # fmt: skip
    errors = lint_mil_ops(mlmodel._mil_program)
    assert any("dynamic-shape op" in e for e in errors), errors


def test_cpu_forcing_op_lint_fires() -> None:
    inputs = [ct.TensorType(name="x", shape=(6, 4)), ct.TensorType(name="idx", shape=(2,), dtype=np.int32)]
    mlmodel = _convert(_Scatter(), (torch.zeros(6, 4), torch.tensor([1, 3], dtype=torch.int32)), inputs)
    errors = lint_mil_ops(mlmodel._mil_program)
    assert any("CPU-forcing op scatter" in e for e in errors), errors


@pytest.mark.integration
def test_shape_lint_fires_outside_enumerated_set(standard_export, export_lengths) -> None:
    spec = ct.utils.load_spec(str(standard_export.packages["model"]))
    assert lint_shapes(spec, export_lengths, 48) == []
    assert any("outside the set: [32]" in e for e in lint_shapes(spec, [16], 48))
    assert any("differ from the enumerated set [16, 24, 32]" in e for e in lint_shapes(spec, [16, 24, 32], 48))
    assert any("outside the KV cache" in e for e in lint_shapes(spec, [16, 32, 64], 48))


@pytest.mark.integration  # a Core ML conversion per function (~20 s)
def test_export_removes_the_packages_of_an_earlier_layout(tiny_ckpt, tmp_path) -> None:
    """A re-export into a run's export/ leaves only model.mlpackage (not the prefill/decode pair of before)."""
    for stale in ("prefill.mlpackage", "decode.mlpackage"):
        (tmp_path / stale / "Data").mkdir(parents=True)
    result = export_transformer(load_model(tiny_ckpt), ExportConfig(), [16], tmp_path, "tok")
    assert sorted(p.name for p in tmp_path.glob("*.mlpackage")) == ["model.mlpackage"]
    assert result.packages == {"model": tmp_path / "model.mlpackage"}


def test_export_refuses_lengths_beyond_the_cache(tiny_ckpt, tmp_path) -> None:
    with pytest.raises(ExportError, match=r"\[64\] exceed the model's max_seq_len 48"):
        export_transformer(load_model(tiny_ckpt), ExportConfig(), [16, 64], tmp_path, "tok")


# --------------------------------------------------------------------------------------
# ANE op-eligibility lint


@pytest.mark.integration
def test_ane_lint_of_the_export(standard_export) -> None:
    lint = standard_export.gate_inputs["ane_lint"]
    assert lint["source"] == "op-eligibility lint (static MIL)"
    assert lint["ineligible_ops"] == [] and lint["over_limits"] == []  # the fp16 attention/MLP path is clean
    assert 0.9 < lint["op_eligible_share"] <= 1.0  # fp16 linears/attention dominate the FLOPs
    by_op = lint["by_op_type"]
    assert by_op["linear"]["eligible"] and by_op["scaled_dot_product_attention"]["eligible"]
    assert max(by_op, key=lambda k: by_op[k]["flops"]) == "linear"
    assert not by_op["cumsum"]["eligible"]  # int32 position math: off the ANE, but not on the attention/MLP path
    assert ("ane_residency" in standard_export.gate_inputs) == (sys.platform == "darwin")  # only MLComputePlan
    on_disk = json.loads(standard_export.ane_lint_path.read_text())
    assert standard_export.ane_lint_path.name == "ane_lint.json"
    assert on_disk["op_eligible_share"] == pytest.approx(lint["op_eligible_share"])


@pytest.mark.integration  # a Core ML conversion per layout (~15-25 s each)
@pytest.mark.parametrize(("layout", "quantize"), [("standard", "none"), ("ane", "int8")])
def test_a_vocabulary_above_the_ane_limit_exports_split_heads(layout: str, quantize: str, tmp_path: Path) -> None:
    """The LM head is split into chunks within ANE_MAX_DIM, one output each: the ANE lint finds nothing
    over the limit, the contract lists the chunks, and the concatenated chunks have parity with eager."""
    torch.manual_seed(0)
    vocab = ANE_MAX_DIM + 16
    model = Transformer(tiny_model_config(vocab_size=vocab, max_seq_len=48)).eval()
    result = export_transformer(model, ExportConfig(quantize=quantize, layout=layout), [16, 32], tmp_path, "tok")
    assert result.errors == [] and result.contract["ok"] is True
    lint = result.gate_inputs["ane_lint"]
    assert lint["over_limits"] == [] and lint["ineligible_ops"] == []
    head_op = "linear" if layout == "standard" else "conv"
    spec = ct.models.MLModel(str(result.packages["model"]), skip_model_load=True).get_spec()  # read back from disk
    program = _program_from_disk(result.packages["model"])
    for function in spec.description.functions:
        outputs = [(o.name, list(o.type.multiArrayType.shape)) for o in function.output]
        assert outputs == [("logits_0", [1, vocab // 2]), ("logits_1", [1, vocab // 2])]
        heads = [op for op in program.functions[function.name].operations
                 if op.op_type == head_op and vocab // 2 in op.outputs[0].shape]  # fmt: skip
        assert len(heads) == 2  # two head chunks, no op as wide as the vocabulary
        described = result.contract["packages"]["model"]["functions"][function.name]
        assert described["logits"].endswith("concatenate them in this order")
    gate = result.gate_inputs["export"]
    assert min(gate["cosine_by_shape"].values()) >= 0.999 and min(gate["decode_cosine"]) >= 0.999
    tampered = json.loads(result.contract_path.read_text())
    tampered["packages"]["model"]["functions"]["decode"]["outputs"][1]["shape"] = [1, vocab // 2 - 1]
    assert any("decode: logits last dims [8200, 8199], expected [8200, 8200]" in e
               for e in verify_contract(tampered, model.config, [16, 32]))  # fmt: skip


def test_head_widths_stay_within_the_ane_limit() -> None:
    assert head_widths(96) == [96] and logits_names(96) == ["logits"]
    assert head_widths(ANE_MAX_DIM) == [ANE_MAX_DIM]
    assert head_widths(ANE_MAX_DIM + 1) == [8193, 8192] and logits_names(ANE_MAX_DIM + 1) == ["logits_0", "logits_1"]
    assert head_widths(49152) == [16384] * 3  # SmolLM
    qwen = head_widths(151936)  # Qwen2.5
    assert len(qwen) == 10 and sum(qwen) == 151936 and max(qwen) - min(qwen) <= 1 and max(qwen) <= ANE_MAX_DIM


@pytest.mark.parametrize("tie", [True, False])
def test_split_heads_equal_the_unsplit_head_in_fp32(tie: bool) -> None:
    torch.manual_seed(0)
    model = Transformer(tiny_model_config(vocab_size=ANE_MAX_DIM + 5, tie_embeddings=tie)).eval()
    x = torch.randn(1, 1, 32)  # (1, 1, d)
    with torch.no_grad():
        chunks = build_layout(model, "standard").head(x)
        assert isinstance(chunks, tuple) and [c.shape[1] for c in chunks] == head_widths(ANE_MAX_DIM + 5)
        torch.testing.assert_close(torch.cat(chunks, 1), model.lm_head(model.norm(x)).reshape(1, -1))
        ane = ANETransformer.from_standard(model).eval()
        assert isinstance(ane.lm_head, nn.ModuleList) and len(ane.lm_head) == 2
        ids = torch.randint(0, ANE_MAX_DIM + 5, (1, 6))
        torch.testing.assert_close(ane(ids), model(ids), rtol=1e-5, atol=1e-5)


def _linear_prog(dtype: Any, out_features: int = 64) -> Any:
    np_dtype = np.float16 if dtype == types.fp16 else np.float32

    @mb.program(input_specs=[mb.TensorSpec(shape=(2, 64), dtype=dtype)], opset_version=ct.target.macOS15)
    def prog(x: Any) -> Any:
        return mb.linear(x=x, weight=np.ones((out_features, 64), dtype=np_dtype))

    return prog


def test_ane_lint_rules() -> None:
    @mb.program(input_specs=[mb.TensorSpec(shape=(1, 1, 1, 1, 1, 2, 64), dtype=types.fp16)],
                opset_version=ct.target.macOS15)  # fmt: skip
    def rank7_prog(x: Any) -> Any:
        return mb.relu(x=x)

    fp16, fp32 = _linear_prog(types.fp16), _linear_prog(types.fp32)
    good = ane_op_lint({"p": fp16}, symbol_size=1)
    assert good["ineligible_ops"] == [] and good["over_limits"] == []
    assert good["op_eligible_share"] == 1.0 and good["by_op_type"]["linear"]["flops"] == 2 * 2 * 64 * 64
    bad = ane_op_lint({"p": fp32}, symbol_size=1)
    assert bad["op_eligible_share"] == 0.0
    assert "fp32 output (ANE computes fp16)" in bad["by_op_type"]["linear"]["reasons"]
    assert len(bad["ineligible_ops"]) == 1 and bad["ineligible_ops"][0].startswith("p: linear (")
    assert bad["ineligible_ops"][0].endswith("): fp32 output (ANE computes fp16)")
    rank = ane_op_lint({"p": rank7_prog}, symbol_size=1)
    assert not rank["by_op_type"]["relu"]["eligible"] and rank["ineligible_ops"] == []
    assert len(rank["over_limits"]) == 1 and rank["over_limits"][0].endswith("rank 7 > 5")
    wide = ane_op_lint({"p": _linear_prog(types.fp16, out_features=ANE_MAX_DIM + 1)}, symbol_size=1)
    assert wide["over_limits"][0].endswith(f"dimension > {ANE_MAX_DIM} in [2, {ANE_MAX_DIM + 1}]")
    both = ane_op_lint({"a": fp16, "b": fp32}, symbol_size=1)
    assert both["op_eligible_share"] == pytest.approx(0.5)
    assert [m.split(":")[0] for m in both["ineligible_ops"]] == ["b"]  # each finding names its program


def test_ane_lint_holds_only_the_attention_mlp_path_to_the_rules() -> None:
    """An op off the ANE list fails the lint when it reads activations; int32 index math does not."""

    inputs = [mb.TensorSpec(shape=(2, 64), dtype=types.fp16), mb.TensorSpec(shape=(2,), dtype=types.int32)]

    @mb.program(input_specs=inputs, opset_version=ct.target.macOS15)
    def index_math(x: Any, position: Any) -> Any:
        return mb.relu(x=x), mb.cumsum(x=position, axis=0)  # int32: off the ANE, not on the path

    @mb.program(input_specs=[mb.TensorSpec(shape=(2, 64), dtype=types.fp16)], opset_version=ct.target.macOS15)
    def on_activations(x: Any) -> Any:
        return mb.cumsum(x=mb.relu(x=x), axis=1)

    index = ane_op_lint({"prefill": index_math}, symbol_size=1)
    assert index["ineligible_ops"] == [] and not index["by_op_type"]["cumsum"]["eligible"]
    found = ane_op_lint({"prefill": on_activations}, symbol_size=1)["ineligible_ops"]
    assert len(found) == 1 and found[0].startswith("prefill: cumsum (")
    assert found[0].endswith("): op cumsum not in the ANE op list"), found


# --------------------------------------------------------------------------------------
# Errors


def test_shapes_beyond_max_seq_len_are_an_export_error(tiny_ckpt, tmp_path) -> None:
    config = tmp_path / "c.yaml"
    config.write_text("shapes:\n  lengths: [16, 64]\n  mix: [0.5, 0.5]\nexport:\n  quantize: none\n")
    with pytest.raises(ExportError, match="exceed the model's max_seq_len 48"):
        export_model(tiny_ckpt, load_config(config), tmp_path / "out", "t")
    assert not (tmp_path / "out" / "model.mlpackage").exists()


# --------------------------------------------------------------------------------------
# macOS only: Core ML prediction and MLComputePlan


@pytest.mark.integration
@requires_macos
def test_coreml_parity_per_shape_and_16_decode_steps(standard_export, tiny_ckpt, export_lengths) -> None:
    from distillgates.export.parity import coreml_parity

    for shared in (True, False):  # one MLState for prefill and decode, and the copied state
        parity = coreml_parity(standard_export.packages["model"], load_model(tiny_ckpt), export_lengths, shared,
                               decode_steps=16)  # fmt: skip
        assert sorted(parity["cosine_by_shape"]) == sorted(str(n) for n in export_lengths)
        assert all(c >= 0.999 for c in parity["cosine_by_shape"].values()), parity
        assert len(parity["decode_cosine"]) == 16 and min(parity["decode_cosine"]) >= 0.999, parity
    recorded = standard_export.gate_inputs["coreml_parity"]  # what the coreml_parity gates read
    assert recorded["source"] == "MLModel.predict" and recorded["cosine_by_shape"] == parity["cosine_by_shape"]


@pytest.mark.integration
@requires_macos
def test_mlcomputeplan_residency(standard_export) -> None:
    from distillgates.export.compute_plan import ane_residency

    report = ane_residency(standard_export.packages["model"], ["prefill_16", "decode"])
    assert report["source"] == "MLComputePlan" and sorted(report["functions"]) == ["decode", "prefill_16"]
    assert all(0.0 <= f["residency"] <= 1.0 and "linear" in f["by_op_type"] for f in report["functions"].values())
    # an op's cost counts for the device it prefers (none where the plan gives no usage): the shares add up to <= 1
    assert all(f["residency"] + f["gpu_share"] + f["cpu_share"] <= 1.0 + 1e-6 for f in report["functions"].values())
    recorded = standard_export.gate_inputs["ane_residency"]  # recorded by the export, per function
    assert recorded["source"] == "MLComputePlan"
    assert sorted(recorded["functions"]) == ["decode", "prefill_16", "prefill_32"]
    with pytest.raises(ValueError, match=r"no functions \['prefill_64'\]"):
        ane_residency(standard_export.packages["model"], ["prefill_64"])


def test_an_op_coremltools_cannot_convert_is_an_export_error():
    """coremltools' NotImplementedError ("Unsupported fx node ...") becomes an ExportError naming the program."""

    class KthValue(nn.Module):
        def forward(self, input_ids: Tensor, position: Tensor) -> Tensor:
            return torch.kthvalue(input_ids.float(), 1).values  # no Core ML conversion for kthvalue

    args = (torch.zeros(1, 1, dtype=torch.int32), torch.zeros(1, dtype=torch.int32))
    ep = torch.export.export(KthValue().eval(), args).run_decompositions({})
    with pytest.raises(ExportError, match=r"unsupported op in the decode program: .*kthvalue"):
        convert_program(ep, "decode", [128, 192], ExportConfig())


@pytest.mark.integration  # a Core ML conversion per family (~6 s each)
@pytest.mark.parametrize("features", [{"attention_bias": True}, {"qk_norm": True, "head_dim": 16}, GEMMA3_FEATURES],
                         ids=["qwen2-biases", "qwen3-qk-norm", "gemma3"])  # fmt: skip
def test_pretrained_family_features_export_with_parity(
    features: dict[str, Any], export_lengths: list[int], tmp_path: Path
) -> None:
    """q/k/v biases and q/k norms (a head_dim other than d/H too), and Gemma 3's features (sliding layers with a
    window shorter than the prompts) reach the package: the weights read back from it give the eager logits (the
    round trip fails on a parameter the package lacks)."""
    from .conftest import TOKENIZER_FP, pipeline_config

    torch.manual_seed(0)
    model = Transformer(tiny_model_config(vocab_size=64, max_seq_len=48, **features)).eval()
    with torch.no_grad():  # biases and norm weights away from their 0 / 1 init, so that leaving them out shows
        for name, param in model.named_parameters():
            if name.endswith(("bias", "norm.weight")):
                param.normal_(0.5, 0.3)
    save_model(tmp_path / "model.pt", model)
    result = export_model(tmp_path / "model.pt", pipeline_config(quantize="none"), tmp_path / "out", TOKENIZER_FP)
    gate = result.gate_inputs["export"]
    assert sorted(gate["cosine_by_shape"]) == sorted(str(n) for n in export_lengths)
    assert min(gate["cosine_by_shape"].values()) >= 0.999 and min(gate["decode_cosine"]) >= 0.999
    assert gate["lint_errors"] == [] and gate["contract_ok"] is True


def test_a_flipped_argmax_is_scored_by_how_much_eager_preferred_its_own() -> None:
    """top1_gap: 0 where the argmaxes agree, the eager log-probability margin of its own argmax over the artifact's
    otherwise (a near-tie is small, a real flip large): what the top-1 gates tell rounding from a loss by."""
    from distillgates.export.parity import top1_gap

    want = torch.tensor([2.0, 1.99, -3.0])
    assert top1_gap(want.clone(), want) == 0.0
    assert top1_gap(torch.tensor([1.0, 1.1, 0.0]), want) == pytest.approx(0.01, abs=1e-5)  # a near-tie
    assert top1_gap(torch.tensor([0.0, 0.0, 9.0]), want) == pytest.approx(5.0, abs=1e-5)  # a real flip
