"""Export parity on what ships: the saved package's (compressed) weights, read back per function into the exported
program; the multifunction package stores them once."""

from __future__ import annotations

import re
import shutil
import struct
from pathlib import Path

import coremltools as ct
import numpy as np
import pytest
import torch

from distillgates.export import api
from distillgates.export.api import export_model
from distillgates.export.convert import export_program
from distillgates.export.errors import ExportError
from distillgates.export.layout import build_layout
from distillgates.export.roundtrip import (
    SOURCE,
    RoundTripError,
    map_to_parameters,
    package_weights,
    roundtrip_module,
    weight_sharing_errors,
)
from distillgates.export.wrappers import DecodeModule, PrefillModule
from distillgates.model import load_model

from .conftest import TOKENIZER_FP, pipeline_config

LM_HEAD = "p_core_model_lm_head_weight_to_fp16_quantized"  # the tied embedding / LM head, int8 in the package
BLOB_SENTINEL = 0xDEADBEEF  # first field of each blob's metadata in weight.bin (coremltools' MILBlob format)


def _spec_path(package: Path) -> Path:
    return package / "Data" / "com.apple.CoreML" / "model.mlmodel"


def _prefill_program(ckpt: Path, lengths: list[int]) -> torch.export.ExportedProgram:
    return export_program(PrefillModule(build_layout(load_model(ckpt), "standard")), "prefill", lengths)


def _weight_bin(package: Path) -> Path:
    return package / "Data" / "com.apple.CoreML" / "weights" / "weight.bin"


def _one_function_package(package: Path, function: str, target: Path) -> Path:
    """A copy of one function of a multifunction package, on its own (what a one-function package weighs)."""
    desc = ct.utils.MultiFunctionDescriptor()
    desc.add_function(str(package), src_function_name=function, target_function_name=function)
    desc.default_function_name = function
    ct.utils.save_multifunction(desc, str(target))
    return target


def _reverse_blob(package: Path, weight_name: str) -> None:
    """Reverse the stored int8 codes of a compressed weight in ``weights/weight.bin``, in place."""
    spec = ct.utils.load_spec(str(package))
    offsets = [
        op.inputs["data"].arguments[0].value.blobFileValue.offset  # the codes, stored inline in the op
        for function in spec.mlProgram.functions.values()
        for block in function.block_specializations.values()
        for op in block.operations
        if op.type == "constexpr_blockwise_shift_scale" and op.outputs[0].name == weight_name
    ]
    assert len(set(offsets)) == 1 and len(offsets) == len(spec.mlProgram.functions), offsets  # one blob, every function
    weight_bin = _weight_bin(package)
    blob = bytearray(weight_bin.read_bytes())
    sentinel, _, size, data_offset = struct.unpack_from("<IIQQ", blob, offsets[0])
    assert sentinel == BLOB_SENTINEL
    blob[data_offset : data_offset + size] = blob[data_offset : data_offset + size][::-1]
    weight_bin.write_bytes(bytes(blob))


def _rename_op_output(package: Path, old: str, new: str) -> None:
    """Rename a value in the saved spec (its op's output and every reference to it)."""
    spec = ct.utils.load_spec(str(package))
    renamed = 0
    for function in spec.mlProgram.functions.values():
        for block in function.block_specializations.values():
            for op in block.operations:
                for output in op.outputs:
                    if output.name == old:
                        output.name, renamed = new, renamed + 1
                for argument in op.inputs.values():
                    for binding in argument.arguments:
                        if binding.WhichOneof("binding") == "name" and binding.name == old:
                            binding.name = new
    assert renamed >= 1
    _spec_path(package).write_bytes(spec.SerializeToString())


@pytest.mark.integration  # an int8 Core ML conversion (~10 s)
def test_int8_export_gates_the_shipped_weights(int8_export, tiny_ckpt, export_lengths) -> None:
    gate = int8_export.gate_inputs["export"]
    assert gate["source"] == SOURCE
    assert sorted(gate["cosine_by_shape"]) == sorted(str(n) for n in export_lengths)
    assert all(c >= 0.999 for c in gate["cosine_by_shape"].values()), gate
    assert len(gate["decode_cosine"]) == 16 and min(gate["decode_cosine"]) >= 0.999, gate
    assert int8_export.errors == []
    # what the gate runs: the package's dequantized int8 weights, not the fp32 checkpoint
    package = int8_export.packages["model"]
    ep = _prefill_program(tiny_ckpt, export_lengths)
    shipped = roundtrip_module(ep, map_to_parameters(package_weights(package)["prefill_16"], ep, package))
    weight = shipped.get_parameter("core.model.layers.0.attn.q_proj.weight")
    original = load_model(tiny_ckpt).layers[0].attn.q_proj.weight.detach()
    step = original.abs().amax(1, keepdim=True) / 127  # the int8 per-channel step
    assert not torch.equal(weight, original)
    assert bool(((weight - original).abs() <= step / 2 + 1e-4).all())  # rounded to the int8 grid (+ fp16 rounding)


@pytest.mark.integration
def test_weights_are_stored_once_and_read_back_the_same_from_every_function(int8_export, tiny_ckpt, tmp_path) -> None:
    """One multifunction package: its weight file is the size of one function's (not one copy per function),
    and the weights read back from each function are the same tensors."""
    package = int8_export.packages["model"]
    assert list(int8_export.packages) == ["model"] and package.name == "model.mlpackage"
    stored = package_weights(package)
    assert sorted(stored) == ["decode", "prefill_16", "prefill_32"]
    eps = {
        "prefill": _prefill_program(tiny_ckpt, [16, 32]),
        "decode": export_program(DecodeModule(build_layout(load_model(tiny_ckpt), "standard")), "decode", [16]),
    }
    mapped = {name: map_to_parameters(stored[name], eps["decode" if name == "decode" else "prefill"], package)
              for name in ("prefill_16", "prefill_32", "decode")}  # fmt: skip
    assert weight_sharing_errors(mapped) == [] and len(mapped["decode"]) >= 14
    one = _one_function_package(package, "decode", tmp_path / "decode.mlpackage")
    single, shared = _weight_bin(one).stat().st_size, _weight_bin(package).stat().st_size
    assert shared <= 1.05 * single, (shared, single)  # three functions, about one function's weights
    # the check can fail: one function's weights moved
    moved = {**mapped, "decode": {**mapped["decode"]}}
    q_proj = "core.model.layers.0.attn.q_proj.weight"
    moved["decode"][q_proj] = moved["decode"][q_proj] * 2
    assert weight_sharing_errors(moved) == [
        "functions prefill_16 and decode ship different weights for ['core.model.layers.0.attn.q_proj.weight']"
    ]


@pytest.mark.integration  # fp16 conversions, one int8 pass
def test_functions_with_different_weights_fail_the_export(tiny_ckpt, tmp_path, monkeypatch) -> None:
    """A decode function compressed otherwise than the prefill functions ships a second copy of the weights:
    the export fails, naming the parameters."""
    compress = api.compress

    def decode_only_int8(mlmodel: ct.models.MLModel, cfg: object) -> ct.models.MLModel:
        is_decode = "position" in [i.name for i in mlmodel.get_spec().description.input]
        return compress(mlmodel, api.ExportConfig(quantize="int8" if is_decode else "none"))

    monkeypatch.setattr(api, "compress", decode_only_int8)
    with pytest.raises(ExportError, match=r"model.mlpackage: functions prefill_16 and decode ship different weights "
                                          r"for \[.*core.model.layers.0.attn.q_proj.weight"):  # fmt: skip
        export_model(tiny_ckpt, pipeline_config(quantize="none"), tmp_path, TOKENIZER_FP)


@pytest.mark.integration  # an int4 Core ML conversion (~10 s)
def test_int4_per_block_export_gates_the_shipped_weights(int8_export, tiny_ckpt, tmp_path) -> None:
    """int4 per-block weights (block of 16 input channels): the gate reads the int4 codes back from the package."""
    result = export_model(tiny_ckpt, pipeline_config(quantize="int4", int4_block_size=16), tmp_path, TOKENIZER_FP,
                          raise_on_error=False)  # fmt: skip
    package = result.packages["model"]
    spec = ct.utils.load_spec(str(package))
    ops = [op for f in spec.mlProgram.functions.values() for b in f.block_specializations.values()
           for op in b.operations if op.type == "constexpr_blockwise_shift_scale"]  # fmt: skip
    assert ops and {op.inputs["data"].arguments[0].value.type.tensorType.dataType for op in ops} == {25}  # INT4
    ep = _prefill_program(tiny_ckpt, [16, 32])
    mapped = map_to_parameters(package_weights(package)["prefill_16"], ep, package)
    weight = mapped["core.model.layers.0.attn.q_proj.weight"]
    original = load_model(tiny_ckpt).layers[0].attn.q_proj.weight.detach()  # (32, 32): two blocks per row
    step = original.reshape(32, 2, 16).abs().amax(-1, keepdim=True) / 7  # int4 symmetric step per block
    error = (weight - original).reshape(32, 2, 16).abs()
    assert bool((error <= step / 2 + 1e-3).all()) and float(error.max()) > 1e-3  # on the int4 grid, not fp16
    assert len(torch.unique(weight.reshape(32, 2, 16)[0, 0])) <= 16  # at most 16 levels per block
    int8_bytes = _weight_bin(int8_export.packages["model"]).stat().st_size
    assert _weight_bin(package).stat().st_size < 0.7 * int8_bytes  # half the code bytes (+ scales, fp16 norms)
    gate = result.gate_inputs["export"]  # int4 on random weights: measured, and below the int8 threshold
    assert 0.98 < min(gate["cosine_by_shape"].values()) < 0.999 and result.contract["export"]["quantize"] == "int4"


@pytest.mark.integration  # a palettized Core ML conversion (~10 s)
def test_palettize4_fails_the_export(tiny_ckpt, tmp_path) -> None:
    """4-bit palettes pass a check on the fp32 program (cosine 1.0) and fail on the shipped weights (~0.98)."""
    with pytest.raises(ExportError) as failure:
        export_model(tiny_ckpt, pipeline_config(quantize="palettize4"), tmp_path, TOKENIZER_FP)
    message = str(failure.value)
    assert f"model.mlpackage prefill weights ({SOURCE}) vs eager cosine below 0.999 for shapes" in message
    assert f"model.mlpackage decode weights ({SOURCE}) vs eager cosine below 0.999" in message
    assert (tmp_path / "model.mlpackage").is_dir()  # written before the gate: it can be inspected


@pytest.mark.integration  # an int8 Core ML conversion (~10 s)
def test_corrupted_weight_in_the_saved_package_fails_the_export(tiny_ckpt, tmp_path, monkeypatch) -> None:
    save = api.save_functions

    def save_then_corrupt(models: dict, path: Path, default: str = "decode") -> None:
        save(models, path, default)
        _reverse_blob(path, LM_HEAD)  # the one stored copy, read by every function

    monkeypatch.setattr(api, "save_functions", save_then_corrupt)
    with pytest.raises(ExportError) as failure:
        export_model(tiny_ckpt, pipeline_config(quantize="int8"), tmp_path, TOKENIZER_FP)
    message = str(failure.value)
    assert f"model.mlpackage decode weights ({SOURCE}) vs eager cosine below 0.999" in message
    assert f"model.mlpackage prefill weights ({SOURCE}) vs eager cosine below 0.999" in message


@pytest.mark.integration
def test_mapping_refuses_a_const_it_cannot_map(int8_export, tiny_ckpt, export_lengths, tmp_path) -> None:
    package = tmp_path / "model.mlpackage"
    shutil.copytree(int8_export.packages["model"], package)
    ep = _prefill_program(tiny_ckpt, export_lengths)
    mapped = map_to_parameters(package_weights(package)["prefill_16"], ep, package)  # the clean copy maps
    assert {"core.model.embed.weight", "core.model.lm_head.weight"} <= set(mapped)  # tied: one const, two names
    _rename_op_output(package, LM_HEAD, "p_mystery_weight_quantized")
    expected = f"{package}: weight const 'p_mystery_weight_quantized' (shape [64, 32]) maps to no parameter"
    with pytest.raises(RoundTripError, match=re.escape(expected)):
        map_to_parameters(package_weights(package)["prefill_16"], ep, package)


@pytest.mark.integration
def test_mapping_refuses_a_parameter_without_a_const(int8_export, tiny_ckpt, export_lengths) -> None:
    package = int8_export.packages["model"]
    ep = _prefill_program(tiny_ckpt, export_lengths)
    weights = package_weights(package)["prefill_32"]
    q_proj = "p_core_model_layers_0_attn_q_proj_weight_cast_fp16"  # quantized at conversion (compression-info buffers)
    del weights[q_proj]
    missing = "no weight const for parameters ['core.model.layers.0.attn.q_proj.weight']"
    with pytest.raises(RoundTripError, match=re.escape(missing)):
        map_to_parameters(weights, ep, package)
    weights[q_proj] = np.zeros((32, 16), np.float16)
    with pytest.raises(RoundTripError, match=r"has shape \[32, 16\], parameter core.model.layers.0.attn.q_proj.weight"):
        map_to_parameters(weights, ep, package)
