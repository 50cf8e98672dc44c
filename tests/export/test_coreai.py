"""The Core AI target (export.target both, or coreai alone): model.aimodel converted by coreai-torch, compressed by
coreai-opt, and run here by Core AI's runtime (coreai-core's Linux reference runtime) in a worker process.

Real conversions and a real runtime (no stand-in): every test skips, naming the coreai extra, where it is not
installed (coreai-core has wheels for Linux x86-64 and macOS 26+ arm64 only).
"""

from __future__ import annotations

import copy
import json
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from distillgates.export.api import ExportResult, export_model
from distillgates.export.contract import kv_layout, verify_contract
from distillgates.export.functions import ASSET, COREAI_SOURCE, DECODE, function_names, prefill_function
from distillgates.io import tree_sha256
from distillgates.model import load_model
from distillgates.rundir import RunArtifactError, RunDir
from distillgates.runtime.coreai_engine import (
    CoreAIRuntime,
    CoreAIRuntimeError,
    CoreAIWorker,
    open_engine,
    unavailable,
)
from distillgates.runtime.torch_engine import TorchEngine

from .conftest import LENGTHS, TOKENIZER_FP, pipeline_config

pytestmark = [pytest.mark.integration,
              pytest.mark.skipif(unavailable() is not None, reason=str(unavailable()))]  # fmt: skip


@pytest.fixture(scope="session")
def coreai_fp32(tiny_ckpt: Path, tmp_path_factory: pytest.TempPathFactory) -> ExportResult:
    """fp32, uncompressed: the asset must compute what eager PyTorch does."""
    cfg = pipeline_config(target="both", quantize="none", compute_precision="fp32")
    return export_model(tiny_ckpt, cfg, tmp_path_factory.mktemp("coreai_fp32"), TOKENIZER_FP)


@pytest.fixture(scope="session")
def coreai_toy(tiny_ckpt: Path, tmp_path_factory: pytest.TempPathFactory) -> ExportResult:
    """The toy's settings: fp16 compute (the ANE's), int8 per-channel weights by coreai-opt."""
    cfg = pipeline_config(target="both", quantize="int8", compute_precision="fp16")
    return export_model(tiny_ckpt, cfg, tmp_path_factory.mktemp("coreai_toy"), TOKENIZER_FP)


def test_one_asset_holds_every_function_sharing_one_state(coreai_fp32: ExportResult, tiny_ckpt: Path) -> None:
    contract = json.loads(coreai_fp32.contract_path.read_text())
    section = contract["coreai"]
    asset = coreai_fp32.out_dir / ASSET
    assert section["path"] == ASSET and asset.is_dir()
    assert sorted(section["functions"]) == sorted(function_names(LENGTHS))  # as the runtime reads them from the asset
    states = [fn["states"] for fn in section["functions"].values()]
    assert all(s == states[0] for s in states) and len(states[0]) == 2 * load_model(tiny_ckpt).config.n_layers
    assert section["functions"][DECODE]["inputs"] == [{"name": "input_ids", "dtype": "INT32", "shape": [1, 1]},
                                                      {"name": "position", "dtype": "INT32", "shape": [1]}]
    assert verify_contract(contract, load_model(tiny_ckpt).config, LENGTHS) == []
    # the digests cover the asset as they cover the package: the identity gate checks both
    assert contract["package_sha256"] == {"model.mlpackage": tree_sha256(coreai_fp32.packages["model"]),
                                          ASSET: tree_sha256(asset)}
    # weights stored once for the 3 functions: one fp32 copy of the parameters plus the programs (this tiny model:
    # 145 KB for 83 KB of parameters; the toy's student: 3.3 MB for 3.2 MB), never 3 copies
    params = sum(p.numel() for p in load_model(tiny_ckpt).parameters()) * 4
    size = sum(f.stat().st_size for f in asset.rglob("*") if f.is_file())
    assert params < size < 2 * params, (size, params)


def test_contract_verification_holds_the_asset_to_the_functions(coreai_fp32: ExportResult, tiny_ckpt: Path) -> None:
    contract = json.loads(coreai_fp32.contract_path.read_text())
    contract["coreai"]["functions"][DECODE]["inputs"][1]["name"] = "pos"
    del contract["coreai"]["functions"][prefill_function(LENGTHS[0])]
    errors = verify_contract(contract, load_model(tiny_ckpt).config, LENGTHS)
    assert any(e.startswith(f"{ASSET}: decode: inputs are ['input_ids', 'pos']") for e in errors), errors
    assert any(e.startswith(f"{ASSET}: functions ") for e in errors), errors


@pytest.mark.parametrize("precision", ["fp32", "toy"])
def test_the_asset_matches_eager_in_every_function(precision: str, coreai_fp32, coreai_toy) -> None:
    """Every prefill length, padded and not, and 16 decode steps in the shared state, by cosine and argmax: in fp32
    and in the toy's fp16 compute with int8 weights."""
    result = {"fp32": coreai_fp32, "toy": coreai_toy}[precision]
    parity = result.gate_inputs["coreai_parity"]  # what the coreai_parity gates read
    assert parity["source"] == COREAI_SOURCE
    assert sorted(parity["cosine_by_shape"]) == sorted(str(n) for n in LENGTHS)
    assert min(parity["cosine_by_shape"].values()) >= 0.999 and len(parity["decode_cosine"]) == 16
    assert min(parity["decode_cosine"]) >= 0.999 and parity["top1_agreement"] >= 0.95
    if precision == "fp32":
        assert min(parity["cosine_by_shape"].values()) > 0.999999 and parity["top1_agreement"] == 1.0
    else:
        contract = json.loads(result.contract_path.read_text())["coreai"]
        assert contract["compressed_by"] == "coreai-opt" and contract["quantize"] == "int8"
        assert {s["dtype"] for s in contract["functions"][DECODE]["states"]} == {"FLOAT16"}


def test_gemma3_features_reach_the_asset(tmp_path: Path) -> None:
    """Gemma 3's scaled embeddings, GeGLU, four norms a layer, attention scale and sliding layers (a window shorter
    than every enumerated length, its state a ring) run in Core AI's runtime as in eager PyTorch (fp32)."""
    from distillgates.config import ExportConfig
    from distillgates.export.coreai import coreai_parity, export_coreai

    from .conftest import gemma3_model

    model = gemma3_model()
    made = export_coreai(model, ExportConfig(compute_precision="fp32"), LENGTHS, tmp_path)
    parity = coreai_parity(made["path"], model, LENGTHS)
    assert min(parity["cosine_by_shape"].values()) > 0.99999 and min(parity["decode_cosine"]) > 0.99999
    assert parity["top1_agreement"] == 1.0
    # the sliding layer's state is a ring of its window (5 slots), which the 16 decode steps wrap
    states = {s["name"]: s["shape"] for s in parity["functions"][DECODE]["states"]}
    assert states == kv_layout(model.config)["state_shapes"] and states["k_cache_0"][2] == 5


def test_fp16_scaling_makes_an_overflowing_fp16_asset_finite(tmp_path: Path) -> None:
    """A model whose residual stream leaves fp16's range: as trained (fp16_scaling none) the fp16 asset's logits are
    NaN and the headroom scan names the layers over; with fp16_scaling auto the stream is exported scaled by a power
    of two, the scan is clean and Core AI's fp16 runtime matches eager fp32 within the parity gate."""
    from distillgates.export.api import export_transformer

    from .conftest import overflowing_model

    model = overflowing_model("gemma3", vocab_size=64)  # Llama's o_proj/down_proj scaling: test_headroom.py
    rows = [torch.randint(0, 64, (1, n), generator=torch.Generator().manual_seed(n)) for n in (12, 30)]
    results = {}
    for scaling in ("none", "auto"):
        cfg = pipeline_config(target="both", quantize="none", compute_precision="fp16", fp16_scaling=scaling).export
        results[scaling] = export_transformer(model, cfg, LENGTHS, tmp_path / scaling, TOKENIZER_FP,
                                              raise_on_error=False, calibration=rows)  # fmt: skip
    before, after = (results[s].gate_inputs for s in ("none", "auto"))
    assert before["fp16_headroom"]["over"] and before["fp16_headroom"]["residual_scale"] == 1.0
    assert before["coreai_parity"]["non_finite"] > 0
    assert after["fp16_headroom"]["over"] == [] and after["fp16_headroom"]["residual_scale"] < 1.0
    assert after["fp16_headroom"]["max_peak_unscaled"] == before["fp16_headroom"]["max_peak"]
    parity = after["coreai_parity"]
    assert parity["non_finite"] == 0 and min(parity["cosine_by_shape"].values()) >= 0.999
    assert min(parity["decode_cosine"]) >= 0.999 and parity["top1_agreement"] >= 0.95


def test_a_perturbed_weight_fails_parity(tiny_ckpt: Path, tmp_path: Path) -> None:
    """The injected violation: the asset shipped from a model whose one weight moved, gated against the checkpoint."""
    from distillgates.config import ExportConfig
    from distillgates.export.coreai import coreai_parity, export_coreai

    model = load_model(tiny_ckpt)
    perturbed = load_model(tiny_ckpt)
    with torch.no_grad():
        perturbed.layers[0].mlp.down_proj.weight.mul_(3.0)
    made = export_coreai(perturbed, ExportConfig(compute_precision="fp32"), LENGTHS, tmp_path)
    parity = coreai_parity(made["path"], model, LENGTHS)
    assert min(parity["cosine_by_shape"].values()) < 0.999 and min(parity["decode_cosine"]) < 0.999


@pytest.mark.parametrize(("quantize", "group", "levels"),
                         [("int4", 0, 16), ("palettize4", 8, 16), ("palettize6", 0, 64)])  # fmt: skip
@pytest.mark.parametrize("tied", [True, False])
def test_coreai_opt_puts_every_weight_on_its_grid(quantize: str, group: int, levels: int, tied: bool) -> None:
    """What the asset is converted from: every linear holds at most ``levels`` values per int4 block (a row's
    ``int4_block_size`` input channels), per palette (``group`` output channels, else the tensor), and more than that
    across the tensor where there is more than one block or palette. The embedding table is int8 per row, and a tied
    LM head is that table (the asset stores it once); an untied head is a linear like the others."""
    from distillgates.config import ExportConfig
    from distillgates.export.coreai import coreai_modules
    from distillgates.model import Transformer

    from ..conftest import tiny_model_config

    torch.manual_seed(0)
    model = Transformer(tiny_model_config(vocab_size=64, max_seq_len=48, tie_embeddings=tied)).eval()
    cfg = ExportConfig(compute_precision="fp32", quantize=quantize, palettize_group_size=group)
    core = coreai_modules(model, cfg, LENGTHS)["prefill"].core.model
    linears = {n: m.weight.detach() for n, m in core.named_modules() if isinstance(m, torch.nn.Linear)}
    assert len(linears) == 7 * model.config.n_layers + 1 and "lm_head" in linears
    if tied:
        assert torch.equal(linears.pop("lm_head"), core.embed.weight)
    for name, weight in linears.items():
        width = cfg.int4_block_size if quantize == "int4" else group * weight.shape[1] if group else weight.numel()
        blocks = weight.reshape(-1, width)
        assert max(len(torch.unique(b)) for b in blocks) <= levels, name
        assert len(blocks) == 1 or len(torch.unique(weight)) > levels, name
    stored = core.embed.parametrizations.weight[0]  # the table the gather reads
    assert stored.quantized_data.dtype == torch.int8 and stored.scale.shape == (model.config.vocab_size, 1)
    dequantized = (stored.quantized_data.float() - stored.zero_point) * stored.scale
    torch.testing.assert_close(core.embed.weight.detach(), dequantized)


@pytest.mark.parametrize("quantize", ["int8", "int4"])
def test_a_qat_grid_reaches_the_asset_exactly(quantize: str, qat_ckpt) -> None:
    """int8/int4 take the Core ML export's codes and scales, not coreai-opt's own grid (int4 ``max|block| / 7.5``,
    codes in [-8, 7]): weights trained on the export's grid (QAT) reach the asset's modules unchanged, as they reach
    the Core ML package (``qat_exact_weights``)."""
    from distillgates.config import ExportConfig
    from distillgates.export.coreai import coreai_modules
    from distillgates.export.grid import int4_block_grid

    model = load_model(qat_ckpt[0])  # every linear but the tied head on an int8 per-channel grid
    linears = {n: m for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and n != "lm_head"}
    if quantize == "int4":  # on the export's int4 grid instead, as int4 QAT leaves them
        with torch.no_grad():
            for module in linears.values():
                codes, scale = int4_block_grid(module.weight, 32)
                module.weight.copy_((codes * scale[..., None]).reshape(module.weight.shape))
    core = coreai_modules(model, ExportConfig(compute_precision="fp32", quantize=quantize), LENGTHS)["prefill"]
    for name, module in linears.items():
        assert torch.equal(core.core.model.get_submodule(name).weight, module.weight), name


@pytest.mark.parametrize("quantize", ["int8", "int4"])
def test_a_split_head_ships_the_core_ml_grid_in_the_asset(quantize: str) -> None:
    """A vocabulary over the ANE's 16384 rows splits the LM head into chunks, copies of its rows that are linears of
    their own (tied or not): the asset's chunks hold the Core ML package's codes and scales as every other linear does
    (not coreai-opt's own grid), and the contract says the head is compressed as linears, not read from the table."""
    from distillgates.config import ExportConfig
    from distillgates.export.convert import attach_weight_grids
    from distillgates.export.coreai import compression, coreai_modules
    from distillgates.export.layout import build_layout
    from distillgates.model import Transformer

    from ..conftest import tiny_model_config

    torch.manual_seed(0)
    model = Transformer(tiny_model_config(vocab_size=16400, max_seq_len=48, tie_embeddings=True)).eval()
    cfg = ExportConfig(compute_precision="fp32", quantize=quantize)
    grids = attach_weight_grids(build_layout(copy.deepcopy(model), "standard"), quantize, cfg.int4_block_size)
    assert sorted(name for name in grids if name.startswith("lm_head_chunks")) == [
        "lm_head_chunks.0.weight", "lm_head_chunks.1.weight"]  # fmt: skip
    core = coreai_modules(model, cfg, LENGTHS)["prefill"].core  # data-free grids: what the package computes
    for name, grid in grids.items():
        stored = core.get_submodule(name.removesuffix(".weight")).parametrizations.weight[0]
        assert torch.equal(stored.quantized_data.float(), grid.codes) and torch.equal(stored.scale, grid.scale), name
    assert compression(cfg, model.config).endswith(
        "(the LM head too: 2 chunks of its rows); embedding: int8 per row (coreai-opt w8)")


def test_a_grouped_palette_ships_in_both_targets(tiny_ckpt: Path, tmp_path: Path) -> None:
    """palettize6 per 8 output channels: Core ML's package holds one 64-entry palette per 8 rows of each linear,
    coreai-opt's k-means the asset's; both pass their parity gates and the contract says what was done."""
    from .test_export import _program_from_disk

    cfg = pipeline_config(target="both", quantize="palettize6", palettize_group_size=8)
    result = export_model(tiny_ckpt, cfg, tmp_path, TOKENIZER_FP)
    prog = _program_from_disk(result.packages["model"])
    luts = [op for f in prog.functions.values() for op in f.operations if op.op_type == "constexpr_lut_to_dense"]
    assert luts and all(op.inputs["lut"].val.shape[-2] == 2**6 for op in luts)
    assert all(op.inputs["lut"].val.shape[0] == op.outputs[0].shape[0] // 8 for op in luts)  # a palette per 8 rows
    assert min(result.parity["cosine_by_shape"].values()) >= 0.999
    parity = result.gate_inputs["coreai_parity"]
    assert min(parity["cosine_by_shape"].values()) >= 0.999 and min(parity["decode_cosine"]) >= 0.999
    assert parity["top1_agreement"] >= 0.95
    section = json.loads(result.contract_path.read_text())["coreai"]
    assert section["compression"] == ("linears: k-means palette of 64 values per 8 output channels (coreai-opt); "
                                      "embedding (and the tied LM head): int8 per row (coreai-opt w8)")


def test_the_engine_over_the_asset_decodes_as_pytorch(coreai_fp32: ExportResult, tiny_ckpt: Path) -> None:
    """Greedy generation through the asset (prefill padded to an enumerated length, or a prompt past the largest one
    prefilled at that length and decoded on, then decode and a multi-turn extend, all in the worker's one state) gives
    PyTorch's tokens."""
    model = load_model(tiny_ckpt)
    engine, worker = open_engine(coreai_fp32.out_dir)
    with worker:
        for prompt in ([5, 9, 3], list(range(1, 21)), [7 * i % 60 + 1 for i in range(40)]):  # 40: 32, then decode
            want = list(TorchEngine(model).generate(prompt, max_new_tokens=8))
            assert list(engine.generate(prompt, max_new_tokens=8)) == want
        torch_engine = TorchEngine(model)
        list(torch_engine.generate([7, 8], max_new_tokens=3))
        list(engine.generate([7, 8], max_new_tokens=3))
        assert list(engine.continue_generate([11, 12], max_new_tokens=5)) == list(
            torch_engine.continue_generate([11, 12], max_new_tokens=5))


def test_the_in_process_runtime_decodes_as_the_worker_process(coreai_fp32: ExportResult) -> None:
    """The speed worker's path (macOS 27: the asset run in its own process, whose peak memory holds it) computes what
    the worker process computes: one runtime class serves both."""
    prompt = [7 * i % 60 + 1 for i in range(20)]
    engine, worker = open_engine(coreai_fp32.out_dir)
    with worker:
        want = list(engine.generate(prompt, max_new_tokens=8))
    engine, runtime = open_engine(coreai_fp32.out_dir, in_process=True)
    with runtime:
        assert isinstance(runtime, CoreAIRuntime) and list(engine.generate(prompt, max_new_tokens=8)) == want


def test_a_runtime_fatal_error_is_an_error_naming_the_function_and_call(tiny_ckpt: Path, tmp_path: Path) -> None:
    """The decode Core ML gets (an index_put, ``slice_update``) aborts Core AI's runtime (a Swift fatal error): the
    worker dies, the caller gets an error naming the asset, the function, the call and the runtime's message."""
    import coreai_torch

    from distillgates.export.convert import example_inputs
    from distillgates.export.layout import build_layout
    from distillgates.export.wrappers import DecodeModule, state_names

    model = load_model(tiny_ckpt)
    module = DecodeModule(build_layout(model, "standard"), kv_write="slice_update").eval()
    with torch.no_grad():
        program = torch.export.export(module, example_inputs("decode", 1))
        program = program.run_decompositions(coreai_torch.get_decomp_table())
    converter = coreai_torch.TorchConverter(mode=coreai_torch.TorchConverter.Mode.RELEASE)
    converter.add_exported_program(program, input_names=["input_ids", "position"], output_names=["logits"],
                                   state_names=state_names(model.config.n_layers), entrypoint_name=DECODE)
    converter.to_coreai().save_asset(tmp_path / ASSET)
    died = r"died \(exit code .*\) in function 'decode', call 1: .*Fatal error"
    with CoreAIWorker(tmp_path / ASSET) as worker, pytest.raises(CoreAIRuntimeError, match=died):
        worker.call(DECODE, {"input_ids": np.zeros((1, 1)), "position": np.array([1])})


def test_a_corrupted_asset_is_an_error_and_fails_the_identity_check(coreai_fp32: ExportResult,
                                                                    tmp_path: Path) -> None:
    run = RunDir(tmp_path / "run")
    shutil.copytree(coreai_fp32.out_dir, run.export_dir)
    assert set(run.verify_packages()) == {"model.mlpackage", ASSET}
    bytecode = next(p for p in (run.export_dir / ASSET).iterdir() if p.suffix == ".mlirb")
    bytecode.write_bytes(bytecode.read_bytes()[: len(bytecode.read_bytes()) // 2])  # a truncated program
    with pytest.raises(RunArtifactError, match=f"{ASSET}: sha256"):
        run.verify_packages()
    with pytest.raises(CoreAIRuntimeError, match=f"{ASSET}: the Core AI runtime"):
        CoreAIWorker(run.export_dir / ASSET).close()


def test_without_the_extra_the_export_records_why_and_ships_core_ml(tiny_ckpt: Path, tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    reason = "Core AI needs the coreai extra (coreai_torch is not installed): pip install 'distillgates[coreai]'"
    monkeypatch.setattr("distillgates.export.api.unavailable", lambda: reason)
    result = export_model(tiny_ckpt, pipeline_config(target="both"), tmp_path, TOKENIZER_FP)
    assert result.gate_inputs["coreai_parity"] == {"skipped": reason}
    contract = json.loads(result.contract_path.read_text())
    assert contract["coreai"] == {"skipped": reason} and list(contract["package_sha256"]) == ["model.mlpackage"]
    assert not (tmp_path / ASSET).exists()


def test_an_asset_of_an_earlier_target_is_removed(tiny_ckpt: Path, coreai_fp32: ExportResult, tmp_path: Path) -> None:
    shutil.copytree(coreai_fp32.out_dir / ASSET, tmp_path / ASSET)
    result = export_model(tiny_ckpt, pipeline_config(target="coreml"), tmp_path, TOKENIZER_FP)
    assert "coreai_parity" not in result.gate_inputs and not (tmp_path / ASSET).exists()


@pytest.fixture(scope="session")
def coreai_alone(tiny_ckpt: Path, coreai_fp32: ExportResult, tmp_path_factory: pytest.TempPathFactory) -> ExportResult:
    """``target: coreai`` at the toy's settings (fp16, int8), into a folder that held a target-both export."""
    out = tmp_path_factory.mktemp("coreai_alone")
    shutil.copytree(coreai_fp32.out_dir, out, dirs_exist_ok=True)
    cfg = pipeline_config(target="coreai", quantize="int8", compute_precision="fp16")
    return export_model(tiny_ckpt, cfg, out, TOKENIZER_FP, calibration=[torch.arange(1, 40)[None] % 60])


def test_target_coreai_ships_the_asset_alone(coreai_alone: ExportResult, tiny_ckpt: Path, tmp_path: Path) -> None:
    """No Core ML package (an earlier one is removed); the contract holds the asset to the functions; the export
    gates read the asset's own parity; the identity check covers it; the engine decodes through it."""
    out = coreai_alone.out_dir
    assert sorted(p.name for p in out.iterdir() if p.suffix in (".mlpackage", ".aimodel")) == [ASSET]
    contract = json.loads(coreai_alone.contract_path.read_text())
    model = load_model(tiny_ckpt)
    assert contract["packages"] == {} and coreai_alone.packages == {} and contract["ok"]
    assert sorted(contract["coreai"]["functions"]) == sorted(function_names(LENGTHS))
    assert contract["kv"]["shared_state"] and verify_contract(contract, model.config, LENGTHS) == []
    assert contract["package_sha256"] == {ASSET: tree_sha256(out / ASSET)}
    export = coreai_alone.gate_inputs["export"]
    assert export["source"] == COREAI_SOURCE and export["contract_ok"] and "lints_skipped" in export
    assert min(export["cosine_by_shape"].values()) >= 0.999 and min(export["decode_cosine"]) >= 0.999
    assert export["cosine_by_shape"] == coreai_alone.gate_inputs["coreai_parity"]["cosine_by_shape"]
    assert "skipped" in coreai_alone.gate_inputs["ane_lint"] and coreai_alone.headroom["max_peak"] > 0
    run = RunDir(tmp_path / "run")
    shutil.copytree(out, run.export_dir)
    assert set(run.verify_packages()) == {ASSET}
    engine, worker = open_engine(run.export_dir)  # reads the asset from a contract without a Core ML package
    with worker:
        tokens = list(engine.generate([5, 9, 3], max_new_tokens=6))
    assert len(tokens) == 6 and all(0 <= t < model.config.vocab_size for t in tokens)


def test_target_coreai_fails_its_parity_on_a_perturbed_asset(tiny_ckpt: Path, tmp_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """The injected violation on the Core AI-only path: the asset's functions built from a moved weight fail the
    export (its parity is the export gate's figure)."""
    from distillgates.export import coreai
    from distillgates.export.errors import ExportError

    built = coreai.coreai_modules

    def perturbed(*args: object, **kwargs: object) -> dict[str, torch.nn.Module]:
        modules = built(*args, **kwargs)  # type: ignore[arg-type]
        with torch.no_grad():
            modules["prefill"].core.model.layers[0].mlp.down_proj.weight.mul_(3.0)  # type: ignore[union-attr, operator]
        return modules

    monkeypatch.setattr(coreai, "coreai_modules", perturbed)
    cfg = pipeline_config(target="coreai", quantize="none", compute_precision="fp32")
    with pytest.raises(ExportError, match=rf"{ASSET} prefill \(model.aimodel run by Core AI's runtime.*cosine below"):
        export_model(tiny_ckpt, cfg, tmp_path, TOKENIZER_FP)
    result = export_model(tiny_ckpt, cfg, tmp_path, TOKENIZER_FP, raise_on_error=False)
    assert min(result.gate_inputs["export"]["cosine_by_shape"].values()) < 0.999


def test_target_coreai_without_the_extra_is_an_export_error(tiny_ckpt: Path, tmp_path: Path,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    from distillgates.export.errors import ExportError

    reason = "Core AI needs the coreai extra (coreai_torch is not installed): pip install 'distillgates[coreai]'"
    monkeypatch.setattr("distillgates.export.api.unavailable", lambda: reason)
    with pytest.raises(ExportError, match=r"export.target coreai: Core AI needs the coreai extra"):
        export_model(tiny_ckpt, pipeline_config(target="coreai"), tmp_path, TOKENIZER_FP)
    assert not list(tmp_path.iterdir())  # nothing written


def test_the_worker_refuses_a_missing_asset(tmp_path: Path) -> None:
    with pytest.raises(CoreAIRuntimeError, match="no Core AI asset"):
        CoreAIWorker(tmp_path / ASSET)


@pytest.mark.requires_macos
def test_the_compute_plan_places_the_asset(coreai_toy: ExportResult) -> None:
    """macOS 27: Core AI's compute plan of the toy-like asset, specialized for the Neural Engine, as the export
    records it in the contract."""
    from distillgates.export.coreai import coreai_compute_plan

    plan = coreai_compute_plan(coreai_toy.out_dir / ASSET, "CPU_AND_NE")
    assert plan["placed_operations"] > 0 and 0.0 <= plan["ane_share"] <= 1.0
    recorded = json.loads(coreai_toy.contract_path.read_text())["coreai"]["compute_plan"]
    assert recorded["placed_operations"] == plan["placed_operations"]


def test_the_compute_plan_needs_macos(coreai_fp32: ExportResult) -> None:
    if sys.platform == "darwin":
        pytest.skip("on macOS the plan is measured (test_the_compute_plan_places_the_asset)")
    from distillgates.export.coreai import coreai_compute_plan

    with pytest.raises(RuntimeError, match="needs macOS 27"):
        coreai_compute_plan(coreai_fp32.out_dir / ASSET)
