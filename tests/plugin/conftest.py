"""pytester fixtures: fabricated pipeline run directories (good and violating) and a copy of the checklist.

Fabricating report.json is how the gate *logic* is tested quickly; the real pipeline is gated
by the default run (gates/ against a built run dir). A fabricated run also holds a real tiny
student checkpoint and the export contract's record of it, so the identity gates compare real
model fingerprints.
"""

from __future__ import annotations

import copy
import functools
import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from distillgates.config import load_config, to_dict
from distillgates.data.chat import prompt_wrapper_sha256
from distillgates.data.fingerprints import dataset_sha256
from distillgates.data.registry import tool_registry_sha256
from distillgates.eval.sharding import outputs_sha256, write_outputs
from distillgates.gates.session import resolve_hardware
from distillgates.io import tree_sha256
from distillgates.model import Transformer, model_fingerprint, save_model
from distillgates.project import EMBEDDED_CONFIG
from distillgates.rundir import RunDir
from pytest_distillgates.checklist import CHECKLIST_DIR

from ..conftest import tiny_model_config

# The `pytester` fixture comes from pytest's pytester plugin, enabled for the whole run by the
# top-level tests/conftest.py (`pytest_plugins = ["pytester"]`) or `-p pytester`: pytest refuses
# `pytest_plugins` in a nested conftest like this one.

SHAPES = ("128", "192", "256")
TOKENIZER_FP = "tok-" + "a" * 60
GOOD_DATASET_SHA256 = "d" * 64  # write_run puts the sha256 of the eval set it writes in its place
GOOD_OUTPUTS_SHA256 = "o" * 64  # write_run puts the sha256 of the eval outputs it writes in its place


def metrics(**overrides: Any) -> dict[str, Any]:
    flat = {
        "n": 200, "tool_selection": 0.97, "json_validity": 1.0, "arg_match_strict": 0.9, "arg_match_lax": 0.95,
        "f1_strict_macro": 0.91, "f1_lax_macro": 0.95, "f1_strict_micro": 0.9, "f1_lax_micro": 0.94,
        "privacy_ok_rate": 1.0, "controls_with_integration": 0, "fixture_hit_rate": 1.0,
        "median_tokens_out": 20.0, "median_tokens_out_tool_items": 22.0, "false_tool_calls_tool_absent": 0,
        "ttfa_tokens_p50": 12.0, "ttfa_tokens_p95": 18.0, "failure_reasons": {},
        "items_with_pii": 20, "control_items": 30, "tool_absent_items": 40, "ttfa_items": 150,
    }
    flat.update(overrides)
    return flat


@functools.cache
def tiny_student() -> Transformer:
    """The fabricated runs' student (one per test session: its fingerprint is in the good report)."""
    return Transformer(tiny_model_config()).eval()


@functools.cache
def this_profile() -> str:
    """This machine's hardware profile key (detected)."""
    return resolve_hardware(None)[0]


def run_config() -> dict[str, Any]:
    """``header.config``: the toy config, enumerating the fabricated report's shapes."""
    config = to_dict(load_config(EMBEDDED_CONFIG))
    config["shapes"]["lengths"] = [int(s) for s in SHAPES]
    return config


def tps_per_process(level: float, processes: int = 6, samples: int = 16, shift: int = 1) -> list[list[float]]:
    """TPS samples of ``processes`` speed worker processes around ``level`` (a lasting offset per process, which
    ``shift`` varies, and a spread within it; deterministic)."""
    return [[level * (1 + 0.01 * ((k * shift) % 3 - 1)) * (1 + 0.02 * ((i * 7) % 5 - 2) / 2) for i in range(samples)]
            for k in range(processes)]


def good_report() -> dict[str, Any]:
    slices = {"shape": {s: metrics() for s in SHAPES}, "kind": {"single": metrics()}, "locale": {"en": metrics()},
              "tool_absent": {"true": metrics()}}
    return {
        "schema_version": 1,
        "header": {
            "hardware": {"soc": "test", "os": "Linux", "ram_gb": 8.0, "torch_version": "2.13.0",
                         "coremltools_version": "9.0", "export_path": None, "hardware_profile_key": "test"},
            "fingerprints": {
                "dataset_sha256": GOOD_DATASET_SHA256, "tool_registry_sha256": tool_registry_sha256(),
                "tokenizer_fingerprint": TOKENIZER_FP, "prompt_wrapper_sha256": prompt_wrapper_sha256(),
                "runner_fingerprint": "r" * 64, "model_fingerprint": model_fingerprint(tiny_student()),
            },
            "config_sha256": "c" * 64, "git_sha": "0" * 40, "created_at": "2026-01-01T00:00:00+00:00",
            "config": run_config(),
        },
        "quality": {"student": {**metrics(tool_selection=1.0, f1_lax_macro=59 / 60),  # = good_item_scores()
                                "slices": slices, "outputs_sha256": GOOD_OUTPUTS_SHA256},
                    "teacher": {**metrics(median_tokens_out=30.0), "slices": copy.deepcopy(slices)}},
        "speed": {
            "backend": "torch", "export": False, "hardware_profile_key": "test",
            "ttft_ms": {"p50": 10.0, "p90": 11.0, "p95": 12.0, "samples": [10.0, 11.0, 12.0]},
            "tps": {"p50": 100.0, "p90": 110.0, "p95": 120.0, "samples": [100.0, 110.0, 120.0]},
            "kv_bytes": {"layers": 4, "kv_heads": 2, "head_dim": 32, "seq_len": 256, "bytes_per_elem": 4,
                         "bytes": 262144},
            "peak_memory_bytes": 2**29,  # 0.5 GiB of the header's 8 GB
            "per_shape": {s: {"prompt_tokens": int(s) - 40, "new_tokens": 32,
                              "ttft_ms": {"p50": 8.0, "p90": 9.0, "p95": 9.5, "samples": [8.0, 9.0, 9.5]},
                              "tps": {"p50": 90.0, "p90": 95.0, "p95": 99.0, "samples": [85.0, 90.0, 99.0]}}
                          for s in SHAPES},
        },
        "gate_inputs": {
            "determinism": {"coverage": 1.0, "duplicates": 0, "missing": 0, "mismatches": 0, "sharded_equal": True,
                            "n_shards": 2, "items_per_shard": [60, 60], "unsharded_sha256": GOOD_OUTPUTS_SHA256},
            "qat": {"probe_cosine_min": 0.9995, "probe_cosine": {"layer0_attn": 0.9995, "layer0_mlp": 0.9999},
                    "has_nan": False},
            "export": {"cosine_by_shape": {s: 0.9999 for s in SHAPES}, "decode_cosine": [0.9999, 0.9998],
                       "int64_on_attention": [], "lint_errors": [],
                       "contract_ok": True},
            "fp16_headroom": {"source": "PyTorch scan", "limit": 65504.0, "rows": 32, "tokens": 4000,
                              "peaks": {"layers.0.mlp": 40.0, "layers.0.mlp.down_proj.input": 55.0},
                              "worst": "layers.0.mlp.down_proj.input", "max_peak": 55.0, "margin": 1191.0, "over": []},
            "ane_lint": {"source": "op-eligibility lint (static MIL)", "ineligible_ops": [], "over_limits": [],
                         "limits": {"max_rank": 5, "max_dim": 16384}, "op_eligible_share": 0.99, "by_op_type": {}},
            # as a Mac's export records it (off macOS a run has none, and the residency gates skip)
            # measured on this machine: the gates bind them to the session's hardware profile
            "ane_residency": {"source": "MLComputePlan", "compute_units": "ALL", "functions": {
                **{f"prefill_{s}": {"residency": 0.95, "by_op_type": {}} for s in SHAPES},
                "decode": {"residency": 0.93, "by_op_type": {}}}, "hardware_profile_key": this_profile()},
            "coreml_parity": {"source": "MLModel.predict", "cosine_by_shape": {s: 0.9999 for s in SHAPES},
                              "decode_cosine": [0.9999, 0.9998], "hardware_profile_key": this_profile()},
            # the .aimodel run by Core AI's runtime (export.target both): measured on Linux too
            "coreai_parity": {"source": "model.aimodel run by Core AI's runtime", "cosine_by_shape": {
                s: 0.9999 for s in SHAPES}, "decode_cosine": [0.9999, 0.9998], "top1_agreement": 0.9,
                "top1_gaps": [0.0] * 18 + [0.02, 0.05],
                "non_finite": 0},
            "coreai_eval": {"source": "model.aimodel run by Core AI's runtime", "items": 32, "identical": 31,
                            "differing_ids": ["toy-eval-000000"],
                            "student": {"f1_lax_macro": 1.0, "tool_selection": 1.0, "json_validity": 1.0,
                                        "fixture_hit_rate": 1.0},
                            "item_scores": [{**row, "f1_lax": 1.0, "f1_strict": 1.0}
                                            for row in good_item_scores()[:32]]},
            "prompt_cache": {"ttft_cold_ms": [10.0, 11.0, 10.5], "ttft_hit_ms": [4.0, 4.2, 4.1], "hit_rate": 1.0},
            "speculative": {"identical": True, "speedup": 1.6, "acceptance_rate": 0.7, "tokens_per_worker_step": 2.1,
                            "tps_plain": tps_per_process(100.0), "tps_speculative": tps_per_process(160.0, shift=2),
                            "ttft_plain": tps_per_process(10.0), "ttft_speculative": tps_per_process(10.1, shift=2),
                            "ttft_drafter": tps_per_process(4.0), "tps_drafter": tps_per_process(300.0),
                            "rollback_rate_per_item": [0.0] * 60 + [0.5] * 2},
            "teacher": {"kind": "openai", "determinism": True, "retries": 0, "cache_hits": 0, "records": 10,
                        "tokens": 1000, "kd_positions": 900, "kd_coverage": 0.97},
        },
    }


ITEMS_PER_SHAPE = 120  # enough for the drift gates to be powered (docs/gates.md): 40 are not
PACKAGES = ("model.mlpackage", "model.aimodel")  # the export's multifunction package and Core AI asset


def good_item_scores() -> list[dict[str, Any]]:
    """``eval/item_scores.json`` rows of the good run: per shape, 120 eligible items, 2 of them with F1 lax 0 and 4
    with F1 strict 0.5 (means 0.983 and 0.983)."""
    return [{"id": f"{shape}-{i}", "shape": shape, "f1_lax": 0.0 if i < 2 else 1.0, "f1_strict": 0.5 if i < 4 else 1.0,
             "selection_ok": True, "privacy_ok": True, "calls_emitted": 1, "calls_valid": 1, "fixture_calls": 1,
             "fixture_hits": 1}
            for shape in SHAPES for i in range(ITEMS_PER_SHAPE)]


def write_run(
    root: Path, report: dict[str, Any], model: Transformer | None = None, eval_set: dict[str, Any] | None = None,
    item_scores: list[dict[str, Any]] | None = None,
) -> Path:
    """A run dir: ``report``, the student's per-item scores (default :func:`good_item_scores`), the eval set's header
    (``eval_set`` overrides its fields), ``model`` (default: the tiny student) as the student checkpoint, stand-ins
    of the exported packages, and an export contract recording the checkpoint's fingerprint and their digests."""
    run = RunDir(root)
    for folder in (run.reports_dir, run.data_dir, run.model_dir("student"), run.export_dir, run.eval_dir):
        folder.mkdir(parents=True, exist_ok=True)
    header = {"__header__": True, "dataset_version": 1, "tokenizer_fingerprint": TOKENIZER_FP,
              "tool_registry_sha256": tool_registry_sha256(), "prompt_wrapper_sha256": prompt_wrapper_sha256()}
    run.dataset("eval").write_text(json.dumps(header | (eval_set or {})) + "\n")
    fingerprints = report.get("header", {}).get("fingerprints", {})
    if fingerprints.get("dataset_sha256") == GOOD_DATASET_SHA256:  # the good report: evaluated on this eval set
        report = copy.deepcopy(report)
        report["header"]["fingerprints"]["dataset_sha256"] = dataset_sha256(run.dataset("eval"))
    outputs = [{"id": f"{shape}-{i}", "turns": [], "calls": [], "answer": "ok", "tokens_out": 20, "ttfa_tokens": None}
               for shape in SHAPES for i in range(ITEMS_PER_SHAPE)]
    write_outputs(run.eval_outputs, outputs)
    report = json.loads(json.dumps(report).replace(GOOD_OUTPUTS_SHA256, outputs_sha256(outputs)))
    run.report.write_text(json.dumps(report))
    rows = good_item_scores() if item_scores is None else item_scores
    run.item_scores.write_text(json.dumps({"role": "student", "items": rows}))
    model = model or tiny_student()
    save_model(run.model_path(), model)
    for name in PACKAGES:  # stand-ins for the exported packages: the identity gate checks their digests
        (run.export_dir / name / "Data").mkdir(parents=True, exist_ok=True)
        (run.export_dir / name / "Data" / "weight.bin").write_bytes(name.encode())
    run.contract.write_text(json.dumps({"model_fingerprint": model_fingerprint(model), "package_sha256": {
        name: tree_sha256(run.export_dir / name) for name in PACKAGES}}))
    return root


def set_key(report: dict[str, Any], dotted: str, value: Any) -> dict[str, Any]:
    node = report
    *parents, last = dotted.split(".")
    for part in parents:
        node = node[part]
    if value is DELETE:
        del node[last]
    else:
        node[last] = value
    return report


DELETE = object()


def project_file(root: Path, setting: str, relpath: str, text: str) -> Path:
    """Write a project's own file (e.g. thresholds) and name it in the project's distillgates.yaml."""
    path = root / relpath
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    settings = root / "distillgates.yaml"
    lines = [line for line in settings.read_text().splitlines() if not line.startswith(f"{setting}:")] \
        if settings.exists() else []
    settings.write_text("\n".join([*lines, f"{setting}: {relpath}"]) + "\n")
    return path

SPEED_OVERRIDE = '''
import pytest

# --- test override: synthetic speed worker processes (the gate statistics are what is under test) ---
import random as _random

SLOWDOWN = {slowdown!r}
NOISE = {noise!r}
TAIL = {tail!r}
PROCESSES = {processes!r}


class _SyntheticArm:
    """One synthetic worker process: TTFT ~10 ms and TPS ~100 tokens/s times ``factor`` (TPS divided); every 10th
    request ``tail`` times slower in TTFT (a regression of the slow tail only). ``noise``: a log-normal sigma, or a
    fixed list of factors."""

    def __init__(self, factor, tail, seed, noise):
        self.factor, self.tail, self.rng, self.noise, self.calls = factor, tail, _random.Random(seed), noise, 0

    def measure(self, n):
        ttft, tps = [], []
        for _ in range(n):
            if isinstance(self.noise, list):
                noise = self.noise[self.calls % len(self.noise)]
            else:
                noise = self.rng.lognormvariate(0, self.noise)
            ttft.append(10.0 * self.factor * noise * (self.tail if self.calls % 10 == 9 else 1.0))
            tps.append(100.0 / self.factor / noise)
            self.calls += 1
        return {{"ttft_ms": ttft, "tps": tps}}

    def close(self):
        pass


def _processes(factor, tail, seed, noise, offsets=(1.0,)):
    """Starts synthetic processes; the i-th has the lasting offset ``offsets[i % len(offsets)]``."""
    started = [0]

    def start():
        started[0] += 1
        return _SyntheticArm(factor * offsets[started[0] % len(offsets)], tail, 1000 * seed + started[0], noise)

    return start


@pytest.fixture(scope="session")
def speed_candidate():
    return _processes(SLOWDOWN, TAIL, 1, NOISE, PROCESSES)


@pytest.fixture(scope="session")
def speed_reference():
    return lambda record, rebless: _processes(1.0, 1.0, 7, 0.02)


@pytest.fixture(scope="session")
def speed_reference_record():
    return lambda: {{"code": {{"commit": "synthetic"}}, "artifacts": {{}}}}
'''


@pytest.fixture(scope="session")
def own_profile() -> str:
    return this_profile()


@pytest.fixture
def gates_project(pytester: pytest.Pytester) -> Callable[..., Path]:
    """Copy the shipped checklist into ``gates/`` of the pytester dir, so tests name its files by short paths
    (``gates/test_privacy.py``); its fixtures come from the plugin as in any project. ``slowdown`` adds a
    ``gates/conftest.py`` that swaps in synthetic speed worker processes (``noise``, ``tail``, per-process
    ``processes`` offsets). (The shipped checklist
    collected in place: tests/plugin/test_checklist.py.)
    """

    def make(slowdown: float | None = None, noise: float | list[float] = 0.02, tail: float = 1.0,
             processes: tuple[float, ...] = (1.0,)) -> Path:
        target = pytester.path / "gates"
        target.mkdir(exist_ok=True)
        for path in CHECKLIST_DIR.glob("test_*.py"):
            shutil.copy(path, target / path.name)
        if slowdown is not None:
            (target / "conftest.py").write_text(SPEED_OVERRIDE.format(slowdown=slowdown, noise=noise, tail=tail,
                                                                      processes=processes))
        # hypothesis/benchmark/xdist cost ~4 s per in-process run and are not needed by the gates
        pytester.makeini("[pytest]\naddopts = -p no:cacheprovider -p no:hypothesispytest -p no:benchmark -p no:xdist "
                         "--import-mode=importlib\n")
        return target

    return make


@pytest.fixture(scope="session")
def toy_data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The embedded toy's data folder (its tokenizer and items: the speed sampler's prompts), built once a session
    (a minute of CPU); ``shutil.copytree(toy_data, run / "data", dirs_exist_ok=True)`` puts it in a run."""
    from distillgates.data.build import build_data

    out = tmp_path_factory.mktemp("toy-data") / "data"
    build_data(load_config(EMBEDDED_CONFIG), out)
    return out


@pytest.fixture
def make_run(tmp_path: Path) -> Callable[..., Path]:
    """``make_run(name, **{dotted.key: value})``: a run dir with the good report, keys overridden
    (``eval_set.<field>`` overrides a field of the eval set's header instead; ``item_scores`` replaces the
    per-item scores)."""

    def make(name: str = "run", **changes: Any) -> Path:
        report, eval_set = good_report(), {}
        item_scores = changes.pop("item_scores", None)
        for dotted, value in changes.items():
            if dotted.startswith("eval_set."):
                eval_set[dotted.removeprefix("eval_set.")] = value
            else:
                set_key(report, dotted.replace("__", "."), value)
        return write_run(tmp_path / name, report, eval_set=eval_set, item_scores=item_scores)

    return make
