"""Export parity on what ships: the saved packages' (compressed) weights, read back into the exported program."""

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
from distillgates.export.convert import ExportError, export_program
from distillgates.export.layout import build_layout
from distillgates.export.roundtrip import SOURCE, RoundTripError, map_to_parameters, package_weights, roundtrip_module
from distillgates.export.wrappers import PrefillModule
from distillgates.model import load_model

from .conftest import TOKENIZER_FP, pipeline_config

LM_HEAD = "p_core_model_lm_head_weight_to_fp16_quantized"  # the tied embedding / LM head, int8 in the package
BLOB_SENTINEL = 0xDEADBEEF  # first field of each blob's metadata in weight.bin (coremltools' MILBlob format)


def _spec_path(package: Path) -> Path:
    return package / "Data" / "com.apple.CoreML" / "model.mlmodel"


def _prefill_program(ckpt: Path, lengths: list[int]) -> torch.export.ExportedProgram:
    return export_program(PrefillModule(build_layout(load_model(ckpt), "standard")), "prefill", lengths)


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
    assert len(offsets) == 1, offsets
    weight_bin = package / "Data" / "com.apple.CoreML" / "weights" / "weight.bin"
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
    assert renamed == 1
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
    shipped = roundtrip_module(_prefill_program(tiny_ckpt, export_lengths), int8_export.packages["prefill"])
    weight = shipped.get_parameter("core.model.layers.0.attn.q_proj.weight")
    original = load_model(tiny_ckpt).layers[0].attn.q_proj.weight.detach()
    step = original.abs().amax(1, keepdim=True) / 127  # the int8 per-channel step
    assert not torch.equal(weight, original)
    assert bool(((weight - original).abs() <= step / 2 + 1e-4).all())  # rounded to the int8 grid (+ fp16 rounding)


@pytest.mark.integration  # a palettized Core ML conversion (~10 s)
def test_palettize4_fails_the_export(tiny_ckpt, tmp_path) -> None:
    """4-bit palettes pass a check on the fp32 program (cosine 1.0) and fail on the shipped weights (~0.98)."""
    with pytest.raises(ExportError) as failure:
        export_model(tiny_ckpt, pipeline_config(quantize="palettize4"), tmp_path, TOKENIZER_FP)
    message = str(failure.value)
    assert f"prefill.mlpackage weights ({SOURCE}) vs eager cosine below 0.999 for shapes" in message
    assert f"decode.mlpackage weights ({SOURCE}) vs eager cosine below 0.999" in message
    assert (tmp_path / "prefill.mlpackage").is_dir()  # written before the gate: it can be inspected


@pytest.mark.integration  # an int8 Core ML conversion (~10 s)
def test_corrupted_weight_in_the_saved_package_fails_the_export(tiny_ckpt, tmp_path, monkeypatch) -> None:
    save = api._save_package

    def save_then_corrupt(mlmodel: ct.models.MLModel, path: Path) -> None:
        save(mlmodel, path)
        if path.name == "decode.mlpackage":
            _reverse_blob(path, LM_HEAD)

    monkeypatch.setattr(api, "_save_package", save_then_corrupt)
    with pytest.raises(ExportError) as failure:
        export_model(tiny_ckpt, pipeline_config(quantize="int8"), tmp_path, TOKENIZER_FP)
    message = str(failure.value)
    assert f"decode.mlpackage weights ({SOURCE}) vs eager cosine below 0.999" in message
    assert "prefill.mlpackage" not in message  # only the decode package was corrupted


@pytest.mark.integration
def test_mapping_refuses_a_const_it_cannot_map(int8_export, tiny_ckpt, export_lengths, tmp_path) -> None:
    package = tmp_path / "prefill.mlpackage"
    shutil.copytree(int8_export.packages["prefill"], package)
    ep = _prefill_program(tiny_ckpt, export_lengths)
    mapped = map_to_parameters(package_weights(package), ep, package)  # the clean copy maps
    assert {"core.model.embed.weight", "core.model.lm_head.weight"} <= set(mapped)  # tied: one const, two names
    _rename_op_output(package, LM_HEAD, "p_mystery_weight_quantized")
    expected = f"{package}: weight const 'p_mystery_weight_quantized' (shape [64, 32]) maps to no parameter"
    with pytest.raises(RoundTripError, match=re.escape(expected)):
        roundtrip_module(ep, package)


@pytest.mark.integration
def test_mapping_refuses_a_parameter_without_a_const(int8_export, tiny_ckpt, export_lengths) -> None:
    package = int8_export.packages["prefill"]
    ep = _prefill_program(tiny_ckpt, export_lengths)
    weights = package_weights(package)
    del weights["p_core_model_layers_0_attn_q_proj_weight_to_fp16_quantized"]
    missing = "no weight const for parameters ['core.model.layers.0.attn.q_proj.weight']"
    with pytest.raises(RoundTripError, match=re.escape(missing)):
        map_to_parameters(weights, ep, package)
    weights["p_core_model_layers_0_attn_q_proj_weight_to_fp16_quantized"] = np.zeros((32, 16), np.float16)
    with pytest.raises(RoundTripError, match=r"has shape \[32, 16\], parameter core.model.layers.0.attn.q_proj.weight"):
        map_to_parameters(weights, ep, package)
