"""Core AI engine: the exported ``export/model.aimodel`` run by Core AI's runtime, in a worker process, behind
the engine protocol.

Design choices:
- The runtime runs in its own process (``multiprocessing`` spawn). A runtime error can be a Swift
  ``fatalError`` that aborts the process (an index_put with a tensor index does: see
  :mod:`distillgates.export.wrappers`); here it becomes a :class:`CoreAIRuntimeError` naming the
  asset, the function, the call and the runtime's last words (the worker's stderr goes to a file),
  never a dead pytest session.
- The KV state lives in the worker: every function of the asset declares the same states (coreai-torch
  shares them by name), so one dict of ``NDArray`` s, updated in place by each call, serves prefill
  and decode, as one ``MLState`` does for Core ML (``kv.shared_state``).
- The orchestration (padding to an enumerated length, positions, multi-turn ``extend``, rollback) is
  :class:`distillgates.runtime.coreml_engine.CoreMLEngine`'s: a :class:`CoreAIRunner` is one of its
  package runners.
- On Linux the runtime is coreai-core's local reference implementation, single-threaded: an oracle of
  what the artifact computes (parity, greedy outputs), never a speed figure. macOS 27 loads the OS
  framework with a compute-unit preference (``SpecializationOptions``); only there is it a speed path.
"""

from __future__ import annotations

import asyncio
import json
import multiprocessing
import os
import sys
import tempfile
from collections.abc import Callable, Mapping
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import numpy as np

from distillgates.runtime.coreml_engine import CoreMLEngine

INSTALL_HINT = ("pip install 'distillgates[coreai]' (coreai-torch, coreai-core, coreai-opt; coreai-core has wheels for "
                "Linux x86-64 and macOS 26+ arm64 only)")  # fmt: skip
COMPUTE_UNITS = {"ALL": None, "CPU_ONLY": "cpu", "CPU_AND_GPU": "gpu", "CPU_AND_NE": "neural_engine"}


class CoreAIRuntimeError(RuntimeError):
    """The Core AI runtime failed: an error it raised, or its process died (a runtime fatal error)."""


def unavailable() -> str | None:
    """Why Core AI cannot convert or run here, naming the extra to install; None when it can."""
    import importlib.util

    for module in ("coreai_torch", "coreai", "coreai_opt"):
        if importlib.util.find_spec(module) is None:
            return f"Core AI needs the coreai extra ({module} is not installed): {INSTALL_HINT}"
    return None


def specialization(compute_units: str) -> Any:
    """Core AI's ``SpecializationOptions`` preferring ``compute_units`` (an ``export.compute_units`` value) on macOS
    (the OS framework, macOS 27); None for ``ALL`` and off macOS, where the runtime takes no options."""
    kind = COMPUTE_UNITS[compute_units]
    if sys.platform != "darwin" or kind is None:
        return None
    from coreai.runtime import ComputeUnitKind, SpecializationOptions  # type: ignore[attr-defined]

    return SpecializationOptions.from_preferred_compute_unit_kind(getattr(ComputeUnitKind, kind)())


def _describe(fn: Any) -> dict[str, Any]:
    desc = fn.desc

    def arrays(names: list[str], get: Any) -> list[dict[str, Any]]:
        return [{"name": n, "dtype": str(d.dtype).upper(), "shape": list(d.shape)} for n in names for d in [get(n)]]

    return {"inputs": arrays(desc.input_names, desc.input_descriptor),
            "outputs": arrays(desc.output_names, desc.output_descriptor),
            "states": arrays(desc.state_names, desc.state_descriptor)}  # fmt: skip


class CoreAIRuntime:
    """One ``.aimodel`` loaded by Core AI's runtime in this process, holding one KV state: what the worker process
    runs (:class:`CoreAIWorker`), and what the speed worker runs on macOS 27 (already a process of its own, whose
    peak memory must hold the model). A runtime fatal error kills this process."""

    def __init__(self, path: str | Path, compute_units: str = "ALL") -> None:
        from coreai.authoring import AIModelAsset

        self.path = Path(path)
        self._loop = asyncio.new_event_loop()  # the runtime's API is async; one loop serves every call
        self._executable = AIModelAsset.load(str(path)).executable(specialization(compute_units))
        model = self._loop.run_until_complete(self._executable.__aenter__())
        self._functions = {name: model.load_function(name) for name in model.function_names}
        self.functions = {name: _describe(fn) for name, fn in self._functions.items()}
        self._states = next(iter(self.functions.values()))["states"]
        self._state: dict[str, Any] = {}
        self.reset()

    def call(self, function: str, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        from coreai.runtime import NDArray

        feed: dict[str, Any] = {k: NDArray(np.ascontiguousarray(v, dtype=np.int32)) for k, v in inputs.items()}
        out = self._loop.run_until_complete(self._functions[function](inputs=feed, state=self._state))
        return {k: v.numpy() for k, v in out.items() if isinstance(v, NDArray)}

    def reset(self) -> None:
        from coreai.runtime import NDArray

        self._state.clear()
        self._state.update({s["name"]: NDArray(np.zeros(s["shape"], dtype=s["dtype"].lower())) for s in self._states})

    def read_state(self, name: str) -> np.ndarray:
        return self._state[name].numpy().copy()  # type: ignore[no-any-return]

    def write_state(self, name: str, value: np.ndarray) -> None:
        from coreai.runtime import NDArray

        self._state[name] = NDArray(np.ascontiguousarray(value, dtype=self._state[name].numpy().dtype))

    def close(self) -> None:
        if not self._loop.is_closed():
            self._loop.run_until_complete(self._executable.__aexit__(None, None, None))
            self._loop.close()

    def __enter__(self) -> CoreAIRuntime:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _serve(conn: Connection, path: str, compute_units: str, stderr_path: str) -> None:
    """The worker: load the asset, then answer ``(op, *args)`` requests until ``close`` or EOF."""
    fd = os.open(stderr_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(fd, 2)  # the runtime's fatal errors land here, for the parent's error message
    with CoreAIRuntime(path, compute_units) as runtime:
        conn.send(("ok", runtime.functions))
        ops: dict[str, Callable[..., Any]] = {"call": runtime.call, "reset": runtime.reset, "read": runtime.read_state,
                                              "write": runtime.write_state}  # fmt: skip
        while True:
            try:
                op, *args = conn.recv()
            except EOFError:
                return
            if op == "close":
                conn.send(("ok", None))
                return
            try:
                conn.send(("ok", ops[op](*args)) if op in ops else ("error", f"unknown request {op!r}"))
            except Exception as err:  # reported to the parent, which raises CoreAIRuntimeError
                conn.send(("error", f"{type(err).__name__}: {err}"))


class CoreAIWorker:
    """One ``.aimodel`` loaded by Core AI's runtime in a worker process, holding one KV state.

    Raises:
        CoreAIRuntimeError: the runtime raised, or its process died (named with the function and the call).
    """

    def __init__(self, path: str | Path, compute_units: str = "ALL", timeout_s: float = 600.0) -> None:
        reason = unavailable()
        if reason is not None:
            raise CoreAIRuntimeError(reason)
        if compute_units not in COMPUTE_UNITS:
            raise ValueError(f"compute_units must be one of {sorted(COMPUTE_UNITS)}, got {compute_units!r}")
        self.path, self.timeout_s, self.calls = Path(path), timeout_s, 0
        if not self.path.is_dir():
            raise CoreAIRuntimeError(f"{self.path}: no Core AI asset (an .aimodel folder) there")
        fd, self._stderr = tempfile.mkstemp(prefix="coreai-worker-", suffix=".stderr")
        os.close(fd)
        ctx = multiprocessing.get_context("spawn")  # a clean process: no forked torch threads
        self._conn, child = ctx.Pipe()
        self._process = ctx.Process(target=_serve, args=(child, str(self.path), compute_units, self._stderr),
                                    daemon=True)  # fmt: skip
        self._process.start()
        child.close()
        self.functions: dict[str, dict[str, Any]] = self._request(("describe",), "loading the asset", send=False)

    def _request(self, message: tuple[Any, ...], what: str, send: bool = True) -> Any:
        try:
            if send:
                self._conn.send(message)
            if not self._conn.poll(self.timeout_s):
                self.close()
                raise CoreAIRuntimeError(f"{self.path}: the Core AI runtime did not answer within {self.timeout_s:.0f} "
                                         f"s ({what})")  # fmt: skip
            status, value = self._conn.recv()
        except (EOFError, BrokenPipeError, ConnectionResetError) as err:
            self._process.join(5)
            raise CoreAIRuntimeError(
                f"{self.path}: the Core AI runtime process died (exit code {self._process.exitcode}) {what}: "
                f"{self.last_words()}") from err  # fmt: skip
        if status != "ok":
            raise CoreAIRuntimeError(f"{self.path}: the Core AI runtime failed {what}: {value}")
        return value

    def last_words(self) -> str:
        """The last lines the worker wrote to stderr (the runtime's fatal error), or a placeholder."""
        lines = [line for line in Path(self._stderr).read_text(errors="replace").splitlines() if line.strip()]
        return " | ".join(lines[-3:]) or "(nothing on stderr)"

    def call(self, function: str, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Run ``function`` on ``inputs`` (int32 arrays), updating the worker's state; its outputs."""
        if function not in self.functions:
            raise CoreAIRuntimeError(f"{self.path}: no function {function!r} (has {sorted(self.functions)})")
        self.calls += 1
        feed = {k: np.ascontiguousarray(v, dtype=np.int32) for k, v in inputs.items()}
        return self._request(("call", function, feed), f"in function {function!r}, call {self.calls}")  # type: ignore[no-any-return]

    def reset(self) -> None:
        self._request(("reset",), "resetting the state")

    def read_state(self, name: str) -> np.ndarray:
        return self._request(("read", name), f"reading state {name!r}")  # type: ignore[no-any-return]

    def write_state(self, name: str, value: np.ndarray) -> None:
        self._request(("write", name, value), f"writing state {name!r}")

    def close(self) -> None:
        if self._process.is_alive():
            try:
                self._conn.send(("close",))
                self._conn.poll(5)
            except (BrokenPipeError, OSError):
                pass  # already gone: terminated below
            self._process.join(5)
            if self._process.is_alive():
                self._process.terminate()
        self._conn.close()
        Path(self._stderr).unlink(missing_ok=True)

    def __enter__(self) -> CoreAIWorker:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class CoreAIRunner:
    """One function of a :class:`CoreAIWorker`'s asset: a package runner of :class:`CoreMLEngine`. Its state is
    the worker's (every function shares it)."""

    def __init__(self, worker: CoreAIWorker | CoreAIRuntime, function: str) -> None:
        self.worker, self.function = worker, function

    def new_state(self) -> CoreAIWorker | CoreAIRuntime:
        self.worker.reset()
        return self.worker

    def predict(self, inputs: dict[str, np.ndarray], state: Any) -> dict[str, np.ndarray]:
        return self.worker.call(self.function, inputs)

    def read_state(self, state: Any, name: str) -> np.ndarray:
        return self.worker.read_state(name)

    def write_state(self, state: Any, name: str, value: np.ndarray) -> None:
        self.worker.write_state(name, value)


def coreai_contract(contract: dict[str, Any], contract_path: Path | str = "contract.json") -> dict[str, Any]:
    """The contract as :class:`CoreMLEngine` reads it, with the Core AI asset as its one package."""
    section = contract.get("coreai")
    if not isinstance(section, dict) or "path" not in section:
        reason = section.get("skipped") if isinstance(section, dict) else None
        raise CoreAIRuntimeError(f"{contract_path}: no Core AI asset exported"
                                 + (f" ({reason})" if reason else " (export.target is not both)"))  # fmt: skip
    return {**contract, "packages": {"model": section}, "kv": {**contract["kv"], "shared_state": True}}


def open_engine(
    export_dir: str | Path, compute_units: str = "ALL", in_process: bool = False
) -> tuple[CoreMLEngine, CoreAIWorker | CoreAIRuntime]:
    """The engine over ``export_dir``'s ``model.aimodel`` (as ``contract.json`` lists it) and what runs it: a
    worker process (:class:`CoreAIWorker`), or with ``in_process`` this process (:class:`CoreAIRuntime`: the speed
    worker's, on macOS 27); close it when done."""
    from distillgates.export.functions import DECODE, prefill_function

    export_dir = Path(export_dir)
    contract_path = export_dir / "contract.json"
    contract = coreai_contract(json.loads(contract_path.read_text(encoding="utf-8")), contract_path)
    asset = export_dir / contract["packages"]["model"]["path"]
    worker = CoreAIRuntime(asset, compute_units) if in_process else CoreAIWorker(asset, compute_units)
    lengths = sorted(int(n) for n in contract["enumerated_lengths"])
    prefill = {n: CoreAIRunner(worker, prefill_function(n)) for n in lengths}
    return CoreMLEngine(prefill, CoreAIRunner(worker, DECODE), contract), worker
