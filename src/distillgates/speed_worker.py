"""Speed worker: one process that measures the student, for the speed gates and the pipeline's speed step.

The speed gates (``pytest -m speed``) start two workers of this kind, the candidate (the current
code on the current artifacts) and the reference (the blessed commit's code, from a checkout, on
the blessed artifacts), and ask them in turn for samples, so both arms share the session's
machine state. Both are separate processes of the same interpreter and environment: neither
arm runs in the pytest process (symmetry), and each arm imports its own ``distillgates``.
The pipeline's speed step measures in workers too (:mod:`distillgates.gates.speed_ab`): the
speed report's figures and the speculative speedup, so that they are measured as the gates
measure (one torch thread, the first decode's compilation in the warm-up, a process of its own).

Protocol (line-based JSON on stdin/stdout, ``PROTOCOL_VERSION``): the worker first prints
``{"protocol": "distillgates-speed-worker", "version": 1, "backend": ...}``; then every request
line ``measure N`` is answered by one line ``{"ttft_ms": [...], "tps": [...]}`` (N generations at
batch 1 after the worker's warm-up, prompts rotating; a generation of fewer than two tokens has
no TPS sample), and ``quit`` (or end of input) ends it. Errors are answered as ``{"error": ...}``.
Requests the speed gates never send (so a blessed commit's worker need not know them), for a worker
started with ``--drafter``: ``measure-paired N``, answered by ``{"plain": {"ttft_ms": [...], "tps": [...]},
"speculative": {...}}`` (N generations of each, plain and speculative decoding with that drafter, after one untimed
generation of each: every prompt is decoded by both back to back, each first on every other prompt, so a slow
stretch of the machine and the caches the previous generation left fall on both alike), ``measure-drafter N``
(as ``measure N``, the drafter decoding alone) and
``report {"speed": SpeedConfig fields, "shapes": [lengths]}`` (the speed report's ``speed`` section,
:func:`distillgates.speed.measure_speed` on the run's eval prompts with their tools, and per enumerated prefill
shape; its ``peak_memory_bytes`` is this process's: model, tokenizer and engine, not the pipeline's).

    python -m distillgates.speed_worker --run-dir runs/toy --model runs/toy/student/model.pt
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import subprocess
import sys
import tempfile
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import IO, Any

PROTOCOL = "distillgates-speed-worker"
PROTOCOL_VERSION = 1
METRICS = ("ttft_ms", "tps")
N_PROMPTS = 8  # eval prompts measured, in rotation
MAX_NEW_TOKENS = 32

# (n generations, mode) -> samples per metric; for "paired", samples per metric of each of PAIRED
Sampler = Callable[[int, str], dict[str, Any]]
# request -> decoding mode: the student alone, the student alone and speculatively with the --drafter in pairs, the
# drafter alone
MODES = {"measure": "plain", "measure-paired": "paired", "measure-drafter": "drafter"}
PAIRED = ("plain", "speculative")
COREAI_NOT_TIMED = ("speed.engine coreai needs macOS 27 (Core AI's OS framework): Core AI's Linux runtime is a "
                    "single-threaded reference implementation, an oracle of what the asset computes, and what it times "
                    "is no device's speed (use speed.engine torch here)")
Reporter = Callable[[dict[str, Any]], dict[str, Any]]  # {speed: SpeedConfig fields, shapes} -> the speed section


def speed_sampler(run_dir: Path, model_path: Path, export_dir: Path | None = None,
                  drafter_path: Path | None = None, engine_name: str = "coreml") -> tuple[Sampler, str, Reporter]:
    """``(sampler, backend, reporter)``: the speed harness (:func:`distillgates.speed.measure_speed`) on the run's
    eval prompts, with the PyTorch engine on ``model_path`` or with ``export_dir`` (macOS) the export's
    ``engine_name``: ``coreml`` (the package) or ``coreai`` (the asset, run by Core AI in this process: macOS 27);
    with ``drafter_path`` the sampler also decodes speculatively, or with the drafter alone (PyTorch only; the
    drafter loads at its first use).

    Raises:
        ValueError: ``coreai`` off macOS (Core AI's Linux runtime is a single-threaded reference implementation:
            what it times is no device's speed).
    """
    import torch

    from distillgates.config import SpeedConfig
    from distillgates.data.chat import chat_format
    from distillgates.data.tools import item_tools
    from distillgates.hardware import hardware_header
    from distillgates.model import load_model
    from distillgates.rundir import RunDir
    from distillgates.runtime.speculative import SpeculativeDecoder
    from distillgates.runtime.torch_engine import TorchEngine
    from distillgates.speed import measure_paired, measure_speed

    torch.set_num_threads(1)  # shared CI cores: one thread gives the least noisy samples
    if export_dir is not None and drafter_path is not None:
        raise ValueError("speculative decoding is measured on the PyTorch engine: give --drafter or --export-dir")
    if export_dir is not None and engine_name == "coreai" and sys.platform != "darwin":
        raise ValueError(COREAI_NOT_TIMED)
    run = RunDir(run_dir)
    tokenizer = run.tokenizer()
    fmt = chat_format(tokenizer)
    items = run.items("eval")
    prompts = [fmt.prompt(item) for item in items[:N_PROMPTS]]
    model = load_model(model_path)
    engine: Any
    if export_dir is not None and engine_name == "coreai":  # macOS 27: the OS framework, in this process
        import atexit

        from distillgates.runtime.coreai_engine import open_engine

        contract = json.loads((export_dir / "contract.json").read_text(encoding="utf-8"))
        engine, runtime = open_engine(export_dir, contract["export"]["compute_units"], in_process=True)
        atexit.register(runtime.close)
        backend = "coreai"
    elif export_dir is not None:  # macOS only: MLModel.predict cannot run elsewhere
        from distillgates.runtime.coreml_engine import CoreMLEngine

        engine, backend = CoreMLEngine.from_export_dir(export_dir), "coreml"
    else:
        engine, backend = TorchEngine(model), "torch"
    stop_ids = fmt.stop_ids
    calls = [0]  # successive requests rotate the prompts, so small requests still cover them all
    engines: dict[str, Any] = {"plain": engine}  # the drafter's built at the first request that needs it

    def engine_of(mode: str) -> Any:
        if mode not in engines:
            if drafter_path is None:
                raise ValueError(f"no drafter: start the worker with --drafter to measure {mode} decoding")
            drafter = TorchEngine(load_model(drafter_path))
            engines.update(drafter=drafter, speculative=SpeculativeDecoder(engine, drafter))
        return engines[mode]

    def sample(n: int, mode: str = "plain") -> dict[str, Any]:
        start = calls[0] % len(prompts)
        calls[0] += 1
        chosen = ((prompts[start:] + prompts[:start]) * math.ceil(n / len(prompts)))[:n]
        if mode == "paired":
            return measure_paired({each: engine_of(each) for each in PAIRED}, tokenizer, chosen,
                                  max_new_tokens=MAX_NEW_TOKENS, stop_ids=stop_ids)
        cfg = SpeedConfig(n_prompts=n, warmup=1, repeats=1, max_new_tokens=MAX_NEW_TOKENS)
        result = measure_speed(engine_of(mode), tokenizer, chosen, cfg, model_config=model.config,
                               stop_ids=stop_ids, backend=backend)
        return {metric: result[metric]["samples"] for metric in METRICS}

    def report(request: dict[str, Any]) -> dict[str, Any]:
        cfg = SpeedConfig(**request["speed"])
        result = measure_speed(engine, tokenizer, [fmt.prompt(item) for item in items], cfg,
                               model_config=model.config, backend=backend, export=backend != "torch",
                               stop_ids=stop_ids, hardware_profile_key=hardware_header()["hardware_profile_key"],
                               tools=[item_tools(item) for item in items], shapes=request.get("shapes", ()))
        return {**result, "measured_in": f"a speed worker process of its own (python -m distillgates.speed_worker, "
                                         f"{result['threads']} torch thread): model, tokenizer and engine only; "
                                         f"{cfg.warmup} untimed warm-up generation(s) first, which hold the "
                                         "process's first decode and its compilation"}

    return sample, backend, report


def serve(sampler: Sampler, backend: str, stdin: IO[str], stdout: IO[str], reporter: Reporter | None = None) -> None:
    """Answer ``measure N`` (``measure-paired N``, ``measure-drafter N``, ``report {...}``) requests until ``quit``
    or end of input (see the module docstring)."""
    print(json.dumps({"protocol": PROTOCOL, "version": PROTOCOL_VERSION, "backend": backend}), file=stdout,
          flush=True)
    for line in stdin:
        words = line.split(maxsplit=1)
        answer: dict[str, Any]
        try:
            if words == ["quit"]:
                return
            if len(words) == 2 and words[0] in MODES and words[1].strip().isdigit() and int(words[1]) > 0:
                answer = sampler(int(words[1]), MODES[words[0]])
            elif len(words) == 2 and words[0] == "report" and reporter is not None:
                answer = reporter(json.loads(words[1]))
            else:
                answer = {"error": f"unknown request {line.strip()!r} (expected 'measure N' or 'quit')"}
        except (ValueError, TypeError) as err:  # a bad request (no drafter, bad settings): answered, not fatal
            answer = {"error": f"{line.strip()[:200]!r}: {type(err).__name__}: {err}"}
        print(json.dumps(answer), file=stdout, flush=True)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m distillgates.speed_worker", description=__doc__.splitlines()[0])
    parser.add_argument("--run-dir", type=Path, required=True, help="run whose tokenizer and eval prompts are used")
    parser.add_argument("--model", type=Path, required=True, help="student checkpoint (model.pt) to measure")
    parser.add_argument("--export-dir", type=Path, default=None, help="export (contract.json) to measure")
    parser.add_argument("--engine", choices=("coreml", "coreai"), default="coreml",
                        help="with --export-dir: its Core ML package, or its Core AI asset (macOS 27)")
    parser.add_argument("--drafter", type=Path, default=None,
                        help="drafter checkpoint: also answer 'measure-paired N' and 'measure-drafter N'")
    args = parser.parse_args(argv)
    sampler, backend, reporter = speed_sampler(args.run_dir, args.model, args.export_dir, args.drafter, args.engine)
    serve(sampler, backend, sys.stdin, sys.stdout, reporter)
    return 0


# ``python -m distillgates.speed_worker`` importing ``distillgates`` from PYTHONPATH alone: an editable install's
# finder (setuptools' ``__editable__..._finder`` on sys.meta_path) would otherwise resolve a module missing from
# the blessed code (``distillgates.speed_worker`` at a commit that predates it) to the current checkout's copy,
# silently mixing the two arms' code.
_ONLY_SOURCE_DIR = ("import runpy, sys; "
                    "sys.meta_path[:] = [f for f in sys.meta_path if not getattr(f, '__module__', '').startswith("
                    "'__editable__')]; "
                    "runpy.run_module('distillgates.speed_worker', run_name='__main__', alter_sys=True)")


class WorkerError(RuntimeError):
    """A speed worker could not start, spoke another protocol, or failed a request."""


class SpeedWorker:
    """Client of one worker process: ``measure(n)`` -> samples per metric.

    Args:
        name: the arm's name in messages ("candidate", "reference").
        source_dir: the ``src`` folder whose ``distillgates`` the worker imports (prepended to PYTHONPATH).
        args: the worker's command-line arguments (``--run-dir``, ``--model``, ``--export-dir``).
        env: the environment (default: this process's).
        cpu: pin the worker to this CPU (Linux) once it has loaded (loading is not measured and may use every
            CPU). The two processes of an A/B pair never measure at the same time, so pinning both to one CPU
            costs nothing and makes them share that CPU's other load instead of each getting whatever the
            scheduler's placement gives it.
    """

    def __init__(self, name: str, source_dir: Path, args: Sequence[str], env: Mapping[str, str] | None = None,
                 cpu: int | None = None) -> None:
        self.name = name
        environ = dict(os.environ if env is None else env)
        environ["PYTHONPATH"] = os.pathsep.join([str(source_dir), *filter(None, [environ.get("PYTHONPATH")])])
        environ.setdefault("OMP_NUM_THREADS", "1")
        self.command = [sys.executable, "-m", "distillgates.speed_worker", *args]  # what it runs, for messages
        self.stderr = tempfile.TemporaryFile("w+")  # noqa: SIM115 (closed by close()); a file, not a pipe: warnings can never fill it and block
        self.process = subprocess.Popen([sys.executable, "-c", _ONLY_SOURCE_DIR, *args], stdin=subprocess.PIPE,
                                        stdout=subprocess.PIPE, stderr=self.stderr, text=True, env=environ,
                                        cwd=source_dir.parent)
        self.cpu = cpu
        self.source_dir = source_dir
        self.backend: str | None = None

    def _read(self) -> dict[str, Any]:
        assert self.process.stdout is not None
        line = self.process.stdout.readline()
        if not line:
            self.process.wait(timeout=30)
            self.stderr.seek(0)
            stderr = self.stderr.read()
            raise WorkerError(f"{self.name} speed worker ({shlex.join(self.command)}, code from {self.source_dir}) "
                              f"exited with code {self.process.returncode}: {stderr.strip()[-2000:]}")
        try:
            return json.loads(line)
        except json.JSONDecodeError as err:
            raise WorkerError(f"{self.name} speed worker answered {line.strip()[:200]!r}, not JSON") from err

    def handshake(self) -> None:
        """Wait for the protocol line (the worker has loaded its model), then pin it to its CPU."""
        hello = self._read()
        if hello.get("protocol") != PROTOCOL or hello.get("version") != PROTOCOL_VERSION:
            raise WorkerError(f"{self.name} speed worker speaks {hello!r}, expected protocol {PROTOCOL!r} version "
                              f"{PROTOCOL_VERSION}")
        self.backend = hello.get("backend")
        if self.cpu is not None and hasattr(os, "sched_setaffinity"):  # Linux; macOS has no CPU affinity
            for thread in Path(f"/proc/{self.process.pid}/task").iterdir():  # every thread it has started
                os.sched_setaffinity(int(thread.name), {self.cpu})

    def _ask(self, request: str) -> dict[str, Any]:
        assert self.process.stdin is not None
        self.process.stdin.write(f"{request}\n")
        self.process.stdin.flush()
        answer = self._read()
        if "error" in answer:
            raise WorkerError(f"{self.name} speed worker failed {request[:200]!r}: {answer['error']}")
        return answer

    def measure(self, n: int, mode: str = "plain") -> dict[str, list[float]]:
        """``n`` samples per metric (``mode`` ``drafter``: the worker's ``--drafter`` decoding alone)."""
        request = f"{next(r for r, m in MODES.items() if m == mode)} {n}"
        return self._samples(request, self._ask(request))

    def measure_paired(self, n: int) -> dict[str, dict[str, list[float]]]:
        """``n`` samples per metric of each of :data:`PAIRED`, decoding every prompt with each (``measure-paired``)."""
        request = f"measure-paired {n}"
        answer = self._ask(request)
        return {mode: self._samples(request, answer.get(mode)) for mode in PAIRED}

    def _samples(self, request: str, answer: Any) -> dict[str, list[float]]:
        if not isinstance(answer, dict) or any(not isinstance(answer.get(m), list) for m in METRICS):
            raise WorkerError(f"{self.name} speed worker failed {request!r}: {answer!r}")
        return {metric: [float(s) for s in answer[metric]] for metric in METRICS}

    def report(self, speed_config: dict[str, Any], shapes: Sequence[int] = ()) -> dict[str, Any]:
        """The speed report's ``speed`` section, measured in this process with these ``SpeedConfig`` fields (and
        per enumerated prefill shape of ``shapes``)."""
        return self._ask(f"report {json.dumps({'speed': speed_config, 'shapes': list(shapes)})}")

    def close(self) -> None:
        if self.process.poll() is None:
            try:
                assert self.process.stdin is not None
                self.process.stdin.write("quit\n")
                self.process.stdin.close()
                self.process.wait(timeout=10)
            except (OSError, subprocess.TimeoutExpired):
                self.process.kill()
                self.process.wait()
        self.stderr.close()


if __name__ == "__main__":
    sys.exit(main())
