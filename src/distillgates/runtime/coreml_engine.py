"""Core ML engine: the exported multifunction ``.mlpackage`` (``prefill_<L>`` functions + stateful
``decode``) behind the engine protocol.

Contract (``export/contract.json``, written by :mod:`distillgates.export`):
- ``prefill_<L>``: ``input_ids (1, L) int32`` right-padded to the enumerated ``L``, ``length (1,) int32``
  -> ``logits (1, V)`` of the last real token; writes KV slots ``0..L-1`` of its state.
- decode: ``input_ids (1, 1) int32``, ``position (1,) int32`` -> ``logits (1, V)``; writes slot
  ``position`` and attends slots ``<= position``.
- A vocabulary above the ANE's dimension limit comes as chunks ``logits_0 .. logits_{n-1}``
  ``(1, V_i)`` instead of ``logits``; the contract lists each function's outputs in vocabulary order
  (``packages.<name>.functions.<function>.outputs``) and :func:`join_logits` concatenates them.
- Every function declares the same states ``k_cache_i``/``v_cache_i`` ``(1, n_kv, S_max, hd)``
  (``kv.shared_state``). Then prefill writes the decode state itself: one ``MLState``, made by the
  decode function, is passed to every function (macOS 15: a state fits any function of the model
  whose state description matches; ANEMLL runs its prefill and infer functions on one state the
  same way), and nothing is copied. Without ``kv.shared_state`` prefill gets its own state and the
  KV is copied over (coremltools' ``MLState.read_state``/``write_state``, macOS 15).

Design choices:
- The engine talks to a small backend (:class:`PackageRunner`): ``MLPackageRunner`` wraps
  ``coremltools.models.MLModel`` (macOS: prediction and state need Core ML), and
  :class:`ExportedProgramStandIn` runs the same exported PyTorch programs with the same names
  on Linux, so the orchestration (padding to enumerated shapes, state hand-over, positions) is
  tested everywhere.
- Padded prefill slots past the prompt hold garbage that the decode mask never reads (slot >
  position) until decode overwrites them; rollback therefore only moves the position.
- ``extend`` runs one decode call per token: the decode package is one-token by contract; the
  prompt is not re-prefilled.
- A prompt longer than the largest enumerated length is prefilled in two parts: that length by its prefill
  function, the rest by decode calls (``extend``), so any prompt within ``max_seq_len`` runs (its TTFT grows by
  a decode step per token past the shape; the speed report measures the enumerated shapes). A prompt beyond
  ``max_seq_len`` (the KV state) is refused before anything runs.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch
from torch import Tensor, nn

from distillgates.runtime.base import EngineBase


def join_logits(outputs: Mapping[str, np.ndarray], names: Sequence[str]) -> Tensor:
    """Logits ``(V,)`` fp32 from a prediction's ``outputs``: the ``(1, V_i)`` arrays ``names``, in that order.

    Raises:
        ValueError: an output in ``names`` is missing from the prediction.
    """
    missing = [n for n in names if n not in outputs]
    if missing:
        raise ValueError(
            f"prediction has no outputs {missing} (has {sorted(outputs)}); contract.json lists {list(names)}"
        )
    chunks = [np.asarray(outputs[n], dtype=np.float32).reshape(-1) for n in names]
    return torch.from_numpy(np.concatenate(chunks))  # (V,)


class PackageRunner(Protocol):
    """One compiled model with state: what the engine needs from Core ML."""

    def new_state(self) -> Any: ...

    def predict(self, inputs: dict[str, np.ndarray], state: Any) -> dict[str, np.ndarray]: ...

    def read_state(self, state: Any, name: str) -> np.ndarray: ...

    def write_state(self, state: Any, name: str, value: np.ndarray) -> None: ...


class MLPackageRunner:
    """One function of a saved ``.mlpackage`` run by Core ML (macOS 15+: stateful prediction)."""

    def __init__(self, path: str | Path, function_name: str, compute_units: str = "ALL") -> None:
        import coremltools as ct

        if sys.platform != "darwin":
            raise RuntimeError(f"Core ML prediction needs macOS; cannot run {path} on {sys.platform}")
        self.path, self.function_name = Path(path), function_name
        self.model: Any = ct.models.MLModel(
            str(path), compute_units=getattr(ct.ComputeUnit, compute_units), function_name=function_name
        )

    def new_state(self) -> Any:
        return self.model.make_state()

    def predict(self, inputs: dict[str, np.ndarray], state: Any) -> dict[str, np.ndarray]:
        return self.model.predict(inputs, state=state)

    def read_state(self, state: Any, name: str) -> np.ndarray:
        return state.read_state(name)

    def write_state(self, state: Any, name: str, value: np.ndarray) -> None:
        state.write_state(name, value)


class ExportedProgramStandIn:
    """Stands in for ``MLModel.predict`` (which cannot run on Linux): runs the ``torch.export``
    program that the Core ML package was converted from, with the same input, output and state
    names. A "state" is a dict of numpy arrays copied into the program's mutable buffers around
    each call, mirroring Core ML's ``MLState``. Used only to test the engine's orchestration."""

    def __init__(
        self, program: Any, input_names: Sequence[str], output_names: Sequence[str], state_names: Sequence[str]
    ):
        self.module: nn.Module = program.module()
        self.input_names, self.output_names = list(input_names), list(output_names)
        buffers = dict(self.module.named_buffers())
        missing = [n for n in state_names if n not in buffers]
        if missing:
            raise ValueError(f"exported program has no buffers {missing} (has {sorted(buffers)})")
        self.state_shapes = {n: tuple(buffers[n].shape) for n in state_names}
        self.buffers = {n: buffers[n] for n in state_names}

    def new_state(self) -> dict[str, np.ndarray]:
        # Core ML states are fp16 (see export/wrappers.py): keep the stand-in honest about it
        return {n: np.zeros(shape, dtype=np.float16) for n, shape in self.state_shapes.items()}

    def predict(self, inputs: dict[str, np.ndarray], state: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        with torch.no_grad():
            for name, buffer in self.buffers.items():
                buffer.copy_(torch.from_numpy(state[name].astype(np.float32)))
            outputs = self.module(*(torch.from_numpy(inputs[n]) for n in self.input_names))
            for name, buffer in self.buffers.items():
                state[name] = buffer.numpy().astype(np.float16)
        outputs = outputs if isinstance(outputs, tuple) else (outputs,)
        return {n: o.numpy() for n, o in zip(self.output_names, outputs, strict=True)}

    def read_state(self, state: dict[str, np.ndarray], name: str) -> np.ndarray:
        return state[name].copy()

    def write_state(self, state: dict[str, np.ndarray], name: str, value: np.ndarray) -> None:
        if value.shape != state[name].shape:
            raise ValueError(f"state {name}: shape {value.shape} != {state[name].shape}")
        state[name] = value.astype(np.float16)


class CoreMLEngine(EngineBase):
    """Engine over one prefill runner per enumerated length and a decode runner, sharing one KV state layout.

    Args:
        prefill: enumerated length -> runner of its ``prefill_<L>`` function.
        decode: runner of the ``decode`` function.
        contract: the parsed ``contract.json`` (``enumerated_lengths``, ``kv.state_names``,
            ``kv.shared_state``, ``model_config.max_seq_len``, ``packages``: each function's
            logits names in order).
    """

    def __init__(self, prefill: Mapping[int, PackageRunner], decode: PackageRunner, contract: dict[str, Any]) -> None:
        from distillgates.export.contract import find_function
        from distillgates.export.functions import DECODE, prefill_function

        for key in ("enumerated_lengths", "kv", "model_config", "packages"):
            if key not in contract:
                raise ValueError(f"contract.json: missing field {key!r}")
        self.lengths = sorted(int(n) for n in contract["enumerated_lengths"])
        if sorted(prefill) != self.lengths:
            raise ValueError(f"prefill runners for lengths {sorted(prefill)}, contract.json enumerates {self.lengths}")
        self.prefill_runners, self.decode_runner = dict(prefill), decode
        self.contract = contract
        self.state_names = list(contract["kv"]["state_names"])
        self.shared_state = bool(contract["kv"].get("shared_state", False))
        self.max_seq_len = int(contract["model_config"]["max_seq_len"])
        self.logits_names: dict[int | str, list[str]] = {}  # enumerated length (its prefill) or "decode" -> names
        functions: list[tuple[int | str, str]] = [(n, prefill_function(n)) for n in self.lengths] + [(DECODE, DECODE)]
        for slot, function in functions:
            found = find_function(contract, function)
            if found is None:
                raise ValueError(f"contract.json: no package lists the function {function!r}")
            self.logits_names[slot] = [o["name"] for o in found[1]["outputs"]]
        self.state = decode.new_state()
        self._token = np.zeros((1, 1), dtype=np.int32)  # (1, 1) decode input, filled in place
        self._position = np.zeros((1,), dtype=np.int32)  # (1,)
        self.tokens: list[int] = []
        self.pending = None

    @classmethod
    def from_export_dir(cls, export_dir: str | Path, compute_units: str = "ALL") -> CoreMLEngine:
        """Load each function ``contract.json`` lists (``MLModel(path, function_name=...)``; macOS)."""
        from distillgates.export.contract import find_function
        from distillgates.export.functions import DECODE, prefill_function

        export_dir = Path(export_dir)
        contract_path = export_dir / "contract.json"
        contract = json.loads(contract_path.read_text(encoding="utf-8"))
        if "packages" not in contract or "enumerated_lengths" not in contract:
            raise ValueError(f"{contract_path}: packages/enumerated_lengths missing (contract_version >= 2 expected)")

        def runner(function: str) -> MLPackageRunner:
            found = find_function(contract, function)
            if found is None or "path" not in contract["packages"][found[0]]:
                raise ValueError(f"{contract_path}: no package with a path lists the function {function!r}")
            return MLPackageRunner(export_dir / contract["packages"][found[0]]["path"], function, compute_units)

        lengths = sorted(int(n) for n in contract["enumerated_lengths"])
        return cls({n: runner(prefill_function(n)) for n in lengths}, runner(DECODE), contract)

    @property
    def position(self) -> int:
        return len(self.tokens)

    def padded_length(self, n: int) -> int:
        """Smallest enumerated length that holds ``n`` tokens (``n`` at most the largest)."""
        return next(length for length in self.lengths if length >= n)

    def prefill(self, prompt_ids: Sequence[int]) -> Tensor:
        n = len(prompt_ids)
        if n == 0:
            raise ValueError("need at least one prompt token")
        if n > self.max_seq_len:
            raise ValueError(f"prompt of {n} tokens exceeds max_seq_len {self.max_seq_len} (the KV state's length)")
        if n > self.lengths[-1]:  # the largest enumerated shape, then the rest a decode step a token
            self.prefill(prompt_ids[: self.lengths[-1]])
            return self.extend(prompt_ids[self.lengths[-1]:])
        length = self.padded_length(n)
        input_ids = np.zeros((1, length), dtype=np.int32)  # (1, L) right-padded; pad keys are masked
        input_ids[0, :n] = np.asarray(prompt_ids, dtype=np.int32)
        runner = self.prefill_runners[length]
        feed = {"input_ids": input_ids, "length": np.array([n], dtype=np.int32)}
        if self.shared_state:  # prefill writes the decode state: slots past the prompt are masked until decoded
            out = runner.predict(feed, self.state)
        else:
            prefill_state = runner.new_state()
            out = runner.predict(feed, prefill_state)
            for name in self.state_names:  # hand the prompt's KV over to the decode function's state
                self.decode_runner.write_state(self.state, name, runner.read_state(prefill_state, name))
        self.tokens = [int(t) for t in prompt_ids]
        self.pending = None
        return join_logits(out, self.logits_names[length])  # (V,)

    def decode_step(self, token: int) -> Tensor:
        if self.pending is not None and token != self.pending:
            raise ValueError(f"token {self.pending} is pending (not in the KV state); extend() writes it")
        self.pending = None
        if self.position + 1 > self.max_seq_len:
            raise ValueError(f"sequence of {self.position + 1} tokens exceeds max_seq_len {self.max_seq_len}")
        self._token[0, 0] = token
        self._position[0] = self.position
        out = self.decode_runner.predict({"input_ids": self._token, "position": self._position}, self.state)
        self.tokens.append(int(token))
        return join_logits(out, self.logits_names["decode"])  # (V,)

    def extend(self, token_ids: Sequence[int]) -> Tensor:
        ids = ([self.pending] if self.pending is not None else []) + [int(t) for t in token_ids]
        if not ids:
            raise ValueError("need at least one token to write")
        self.pending = None
        logits = None
        for token in ids:
            logits = self.decode_step(token)
        assert logits is not None
        return logits

    def read_kv(self, length: int) -> list[tuple[Tensor, Tensor]]:
        """Prefix K/V per layer ``(n_kv, length, hd)`` (for the prompt cache)."""
        if length > self.position:
            raise ValueError(f"only {self.position} tokens in the KV state, asked for {length}")
        arrays = {n: self.decode_runner.read_state(self.state, n) for n in self.state_names}
        n_layers = len(self.state_names) // 2
        return [
            (torch.from_numpy(arrays[f"k_cache_{i}"][0, :, :length].copy()),
             torch.from_numpy(arrays[f"v_cache_{i}"][0, :, :length].copy()))
            for i in range(n_layers)
        ]  # fmt: skip

    def write_kv(self, token_ids: Sequence[int], kv: Sequence[tuple[Tensor, Tensor]]) -> None:
        length = len(token_ids)
        for i, (k, v) in enumerate(kv):
            for name, value in ((f"k_cache_{i}", k), (f"v_cache_{i}", v)):
                array = self.decode_runner.read_state(self.state, name)
                array[0, :, :length] = value.numpy()
                self.decode_runner.write_state(self.state, name, array)
        self.tokens = [int(t) for t in token_ids]
        self.pending = None


def stand_in_engine(
    model: Any, lengths: Sequence[int], layout: str = "standard", shared_state: bool = True
) -> CoreMLEngine:
    """A :class:`CoreMLEngine` whose runners are :class:`ExportedProgramStandIn` over the export
    engineer's prefill/decode wrappers of ``model`` (Linux tests and parity checks), with a contract
    shaped as the export writes it (``shared_state``: one state for all functions, else copied)."""
    from distillgates.export.contract import expected_io, kv_layout
    from distillgates.export.convert import export_program
    from distillgates.export.functions import DECODE, PACKAGE, prefill_function
    from distillgates.export.layout import build_layout
    from distillgates.export.wrappers import DecodeModule, PrefillModule

    lengths = sorted(int(n) for n in lengths)
    core = build_layout(model.eval(), layout).eval()
    kv = {**kv_layout(model.config), "shared_state": shared_state}
    runners, functions = {}, {}
    for kind, module in (("prefill", PrefillModule(core)), ("decode", DecodeModule(core))):
        program = export_program(module, kind, lengths)
        io = expected_io(kind, model.config.vocab_size)
        runners[kind] = ExportedProgramStandIn(program, io["inputs"], io["outputs"], kv["state_names"])
        names = [prefill_function(n) for n in lengths] if kind == "prefill" else [DECODE]
        functions.update({name: {"outputs": [{"name": o} for o in io["outputs"]]} for name in names})
    contract = {
        "enumerated_lengths": lengths,
        "kv": kv,
        "model_config": {"max_seq_len": model.config.max_seq_len},
        "packages": {PACKAGE: {"functions": functions}},
    }
    return CoreMLEngine(dict.fromkeys(lengths, runners["prefill"]), runners["decode"], contract)
