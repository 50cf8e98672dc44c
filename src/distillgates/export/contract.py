"""``contract.json``: what a runtime may rely on, read back from the saved ``.mlpackage`` files.

Everything in the contract comes from the spec loaded from disk (``ct.utils.load_spec``), not from
the in-memory model, so a name that was not really set shows up here as the converter's default.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import coremltools as ct
from coremltools.proto import FeatureTypes_pb2

from distillgates.config import ModelConfig
from distillgates.export.layout import head_widths, logits_names
from distillgates.export.lint import enumerated_lengths
from distillgates.export.wrappers import state_names

CONTRACT_VERSION = 1
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


def describe_package(path: str | Path) -> dict[str, Any]:
    """Inputs, outputs, states (names, dtypes, shapes) and enumerated lengths of a saved package."""
    spec = ct.utils.load_spec(str(path))
    desc = spec.description
    return {
        "inputs": [{"name": f.name, **_array(f.type.multiArrayType)} for f in desc.input],
        "outputs": [{"name": f.name, **_array(f.type.multiArrayType)} for f in desc.output],
        "states": [{"name": f.name, **_array(f.type.stateType.arrayType)} for f in desc.state],
        "enumerated_lengths": enumerated_lengths(spec),
        "specification_version": int(spec.specificationVersion),
    }


def kv_layout(cfg: ModelConfig, bytes_per_elem: int = 2) -> dict[str, Any]:
    """KV-cache figures (Core ML states are fp16: 2 bytes per element)."""
    return {
        "layers": cfg.n_layers,
        "kv_heads": cfg.n_kv_heads,
        "head_dim": cfg.head_dim,
        "seq_len": cfg.max_seq_len,
        "bytes_per_elem": bytes_per_elem,
        "bytes": cfg.kv_cache_bytes(cfg.max_seq_len, bytes_per_elem),
        "state_shape": [1, cfg.n_kv_heads, cfg.max_seq_len, cfg.head_dim],
        "state_names": state_names(cfg.n_layers),
    }


def verify_contract(contract: dict[str, Any], cfg: ModelConfig, lengths: list[int]) -> list[str]:
    """Mismatches between a contract and what the model config and shapes require (empty: ok)."""
    errors = []
    kv = kv_layout(cfg)
    for kind in INPUTS:
        expected = expected_io(kind, cfg.vocab_size)
        pkg = contract["packages"].get(kind)
        if pkg is None:
            errors.append(f"{kind}: package missing from the contract")
            continue
        for side in ("inputs", "outputs"):
            names = [f["name"] for f in pkg[side]]
            if names != expected[side]:
                errors.append(f"{kind}: {side} are {names}, expected {expected[side]}")
        errors += [f"{kind}: input {f['name']} is {f['dtype']}, expected INT32" for f in pkg["inputs"]
                   if f["dtype"] != "INT32"]  # fmt: skip
        states = {s["name"]: s for s in pkg["states"]}
        if sorted(states) != sorted(kv["state_names"]):
            errors.append(f"{kind}: states {sorted(states)} != {sorted(kv['state_names'])}")
        errors += [f"{kind}: state {n} has shape {s['shape']}, expected {kv['state_shape']}"
                   for n, s in states.items() if s["shape"] != kv["state_shape"]]  # fmt: skip
        widths = [f["shape"][-1] for f in pkg["outputs"]]
        if widths != head_widths(cfg.vocab_size) or sum(widths) != cfg.vocab_size:
            errors.append(f"{kind}: logits last dims {widths}, expected {head_widths(cfg.vocab_size)} "
                          f"(summing to the vocabulary, {cfg.vocab_size})")  # fmt: skip
    prefill = contract["packages"].get("prefill")
    if prefill is not None and prefill["enumerated_lengths"] != sorted(lengths):
        errors.append(f"prefill: enumerated lengths {prefill['enumerated_lengths']} != {sorted(lengths)}")
    for key in ("model_fingerprint", "tokenizer_fingerprint"):
        if not contract.get(key):
            errors.append(f"{key} is missing")
    return errors
