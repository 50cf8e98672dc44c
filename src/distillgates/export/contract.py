"""``contract.json``: what a runtime may rely on, read back from the saved ``.mlpackage``.

Everything in the contract comes from the spec loaded from disk (``ct.utils.load_spec``), not from
the in-memory model, so a name that was not really set shows up here as the converter's default.

The export writes one multifunction package (``packages.model``): a function ``prefill_<L>`` per
enumerated prompt length ``L`` (static shape ``(1, L)``) and ``decode`` (``(1, 1)``), sharing one
copy of the weights. ``packages`` maps names to packages generically (a runtime looks a function up
in whichever package lists it); ``kv.shared_state`` says whether every function declares the same
states, so that one ``MLState`` serves them all.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import coremltools as ct
from coremltools.proto import FeatureTypes_pb2

from distillgates.config import ModelConfig
from distillgates.export.functions import function_kind, function_names
from distillgates.export.layout import head_widths, logits_names
from distillgates.export.wrappers import state_names

CONTRACT_VERSION = 3  # 2: one multifunction package, functions prefill_<L> and decode; 3: kv.state_shapes per state
INPUTS = {"prefill": ["input_ids", "length"], "decode": ["input_ids", "position"]}
LOGITS_SEMANTICS = {
    "prefill": "logits (1, V) of the last real token (index length-1); input_ids right-padded to an enumerated length",
    "decode": "logits (1, V) of the token at `position`; writes KV slot `position`",
}


def expected_io(kind: str, vocab_size: int) -> dict[str, list[str]]:
    """Input and output names of the ``kind`` package: outputs ``logits``, or ``logits_0 ..`` for a split head."""
    return {"inputs": INPUTS[kind], "outputs": logits_names(vocab_size)}


def logits_semantics(kind: str, vocab_size: int) -> str:
    """What the ``kind`` package's logits are (``packages.<kind>.logits`` of the contract)."""
    names = logits_names(vocab_size)
    if len(names) == 1:
        return LOGITS_SEMANTICS[kind]
    return (
        f"{LOGITS_SEMANTICS[kind]}; split along V into {len(names)} outputs {', '.join(names)} of widths "
        f"{head_widths(vocab_size)} (each within the ANE dimension limit): concatenate them in this order"
    )


def _array(arr: Any) -> dict[str, Any]:
    return {
        "dtype": FeatureTypes_pb2.ArrayFeatureType.ArrayDataType.Name(arr.dataType),
        "shape": [int(d) for d in arr.shape],
    }


def _describe_function(desc: Any) -> dict[str, Any]:
    return {
        "inputs": [{"name": f.name, **_array(f.type.multiArrayType)} for f in desc.input],
        "outputs": [{"name": f.name, **_array(f.type.multiArrayType)} for f in desc.output],
        "states": [{"name": f.name, **_array(f.type.stateType.arrayType)} for f in desc.state],
    }


def describe_package(path: str | Path) -> dict[str, Any]:
    """Functions (inputs, outputs, states: names, dtypes, shapes), default function and spec version
    of a saved package; a single-function package is described as one function ``main``."""
    spec = ct.utils.load_spec(str(path))
    desc = spec.description
    functions = {f.name: _describe_function(f) for f in desc.functions} or {"main": _describe_function(desc)}
    return {
        "functions": functions,
        "default_function": desc.defaultFunctionName or "main",
        "specification_version": int(spec.specificationVersion),
    }


def shared_state(packages: dict[str, Any]) -> bool:
    """Whether every function of every package in the contract declares the same states (one ``MLState``)."""
    states = [f["states"] for pkg in packages.values() for f in pkg["functions"].values()]
    return bool(states) and all(s == states[0] for s in states)


def find_function(contract: dict[str, Any], name: str) -> tuple[str, dict[str, Any]] | None:
    """``(package name, function description)`` of the function ``name`` in the contract, or None."""
    for package, pkg in contract["packages"].items():
        if name in pkg.get("functions", {}):
            return package, pkg["functions"][name]
    return None


def kv_layout(cfg: ModelConfig, bytes_per_elem: int = 2) -> dict[str, Any]:
    """KV-cache figures (Core ML states are fp16: 2 bytes per element). Each layer's K and V states hold
    ``max_seq_len`` positions, a sliding layer's ``ring_len`` when its window is narrower
    (``ModelConfig.state_len``)."""
    shapes = {f"{kind}_cache_{i}": [1, cfg.n_kv_heads, cfg.state_len(i), int(cfg.head_dim or 0)]
              for i in range(cfg.n_layers) for kind in ("k", "v")}  # fmt: skip
    return {
        "layers": cfg.n_layers,
        "kv_heads": cfg.n_kv_heads,
        "head_dim": cfg.head_dim,
        "seq_len": cfg.max_seq_len,
        "ring_len": cfg.ring_len,
        "bytes_per_elem": bytes_per_elem,
        "bytes": sum(math.prod(shape) for shape in shapes.values()) * bytes_per_elem,
        "state_shapes": shapes,
        "state_names": state_names(cfg.n_layers),
    }


def function_errors(packages: dict[str, Any], cfg: ModelConfig, lengths: list[int], where: str = "") -> list[str]:
    """Mismatches between the functions ``packages`` list (``{name: {"functions": ...}}``) and what the model
    config and shapes require: one ``prefill_<L>`` per enumerated length and ``decode``, their input, output
    and state names, int32 inputs, shapes; each message starts with ``where``."""
    errors = []
    kv = kv_layout(cfg)
    wanted = function_names(lengths)
    functions = {name: fn for pkg in packages.values() for name, fn in pkg.get("functions", {}).items()}
    listed = [name for pkg in packages.values() for name in pkg.get("functions", {})]
    if sorted(listed) != sorted(wanted):
        errors.append(f"functions {sorted(listed)} != {sorted(wanted)} (one prefill_<L> per enumerated length, decode)")
    for name in wanted:
        if name not in functions:
            errors.append(f"{name}: function missing from the contract")
            continue
        fn, kind = functions[name], function_kind(name)
        expected = expected_io(kind, cfg.vocab_size)
        for side in ("inputs", "outputs"):
            names = [f["name"] for f in fn[side]]
            if names != expected[side]:
                errors.append(f"{name}: {side} are {names}, expected {expected[side]}")
        errors += [f"{name}: input {f['name']} is {f['dtype']}, expected INT32" for f in fn["inputs"]
                   if f["dtype"] != "INT32"]  # fmt: skip
        ids_shape = next((f["shape"] for f in fn["inputs"] if f["name"] == "input_ids"), None)
        want_shape = [1, 1] if kind == "decode" else [1, int(name.removeprefix("prefill_"))]
        if ids_shape != want_shape:
            errors.append(f"{name}: input_ids shape {ids_shape}, expected {want_shape}")
        states = {s["name"]: s for s in fn["states"]}
        if sorted(states) != sorted(kv["state_names"]):
            errors.append(f"{name}: states {sorted(states)} != {sorted(kv['state_names'])}")
        errors += [f"{name}: state {n} has shape {s['shape']}, expected {kv['state_shapes'][n]}"
                   for n, s in states.items() if s["shape"] != kv["state_shapes"].get(n)]  # fmt: skip
        widths = [f["shape"][-1] for f in fn["outputs"]]
        if widths != head_widths(cfg.vocab_size) or sum(widths) != cfg.vocab_size:
            errors.append(f"{name}: logits last dims {widths}, expected {head_widths(cfg.vocab_size)} "
                          f"(summing to the vocabulary, {cfg.vocab_size})")  # fmt: skip
    return [where + m for m in errors]


def verify_contract(contract: dict[str, Any], cfg: ModelConfig, lengths: list[int]) -> list[str]:
    """Mismatches between a contract and what the model config and shapes require (empty: ok); the Core AI
    asset's functions (``coreai``, target both or coreai) are held to the same requirements, and must share one
    state. ``kv.shared_state`` describes the Core ML package, or with target coreai (no package) the asset."""
    coreai = contract.get("coreai", {})
    if not contract["packages"] and "functions" not in coreai:
        return ["no exported artifact: neither a Core ML package (packages) nor a Core AI asset (coreai.functions)"]
    errors = function_errors(contract["packages"], cfg, lengths) if contract["packages"] else []
    if "functions" in coreai:
        errors += function_errors({"coreai": coreai}, cfg, lengths, where=f"{coreai.get('path')}: ")
        if not shared_state({"coreai": coreai}):
            errors.append(f"{coreai.get('path')}: its functions do not declare the same states")
    if contract.get("enumerated_lengths") != sorted(lengths):
        errors.append(f"enumerated lengths {contract.get('enumerated_lengths')} != {sorted(lengths)}")
    states = shared_state(contract["packages"] or {"coreai": coreai})
    if contract["kv"].get("shared_state") != states:
        errors.append(f"kv.shared_state is {contract['kv'].get('shared_state')}, but the functions' states say "
                      f"{states}")  # fmt: skip
    for key in ("model_fingerprint", "tokenizer_fingerprint"):
        if not contract.get(key):
            errors.append(f"{key} is missing")
    return errors
