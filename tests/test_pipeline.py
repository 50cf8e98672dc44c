"""The main job end to end on a tiny config: every step, the report, caching and resume."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from distillgates.cli import main as cli_main
from distillgates.config import load_config
from distillgates.eval.report import read_report
from distillgates.pipeline import STEPS, Pipeline, run_pipeline, train_role
from distillgates.project import EMBEDDED_CONFIG as TOY
from distillgates.rundir import RunDir
from distillgates.train.on_policy import on_policy_step


def tiny_config(path: Path) -> Path:
    """The embedded toy config shrunk to seconds: few items, tiny models, a handful of steps."""
    cfg = yaml.safe_load(TOY.read_text())
    cfg["name"] = "tiny"
    cfg["threads"] = 1
    cfg["data"].update(n_train=48, n_eval=12, eval_min_per_shape=0)
    cfg["tokenizer"]["vocab_size"] = 700
    small = {"vocab_size": 700, "d_model": 32, "n_layers": 1, "n_heads": 2, "n_kv_heads": 1, "ffn_hidden": 64}
    cfg["student"].update(small)
    cfg["drafter"].update(small)
    cfg["teacher"]["model"].update(small)
    # 2 of the 4 steps after the copy rows and the curriculum: a teacher.train.ema_decay has steps to average
    cfg["teacher"]["train"].update(steps=4, copy_steps=1, curriculum_steps=1, batch_size=4)
    cfg["teacher"]["check"] = {"items": 4, "min_call_rate": 0.0}  # a 4-step teacher calls no tool: checked, not refused
    cfg["kd"].update(batch_size=16, max_new_tokens=24)
    cfg["train"].update(steps=6, batch_size=4, warmup_steps=1, ckpt_every=3, eval_every=6, log_every=1)
    cfg["speed"].update(n_prompts=2, warmup=1, repeats=1, max_new_tokens=8, speculative_workers=3,
                        speculative_samples=8)
    out = path / "tiny.yaml"
    out.write_text(yaml.safe_dump(cfg))
    return out


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("pipeline")
    config = tiny_config(root)
    return config, run_pipeline(config, root / "run")


@pytest.mark.integration  # builds the tiny end-to-end run (~25 s)
def test_every_step_runs_and_the_report_validates(tiny_run: tuple[Path, Path]) -> None:
    config, run_dir = tiny_run
    manifest = json.loads((run_dir / "manifest.json").read_text())
    assert [s.name for s in STEPS if s.name in manifest] == [s.name for s in STEPS]
    report = read_report(run_dir / "reports" / "report.json")  # schema-validated, no null fingerprint
    assert set(report["quality"]) == {"student", "teacher"}
    assert report["speed"]["backend"] == "torch" and report["speed"]["export"] is False
    assert set(report["gate_inputs"]) >= {"determinism", "qat", "export", "ane_lint", "prompt_cache", "speculative"}
    assert report["gate_inputs"]["determinism"]["coverage"] == 1.0
    assert sorted(p.name for p in (run_dir / "export").glob("*.mlpackage")) == ["model.mlpackage"]  # one package
    headroom = report["gate_inputs"]["fp16_headroom"]  # scanned on the first 32 training conversations
    assert headroom["rows"] == 32 and 0 < headroom["max_peak"] < headroom["limit"] and headroom["over"] == []
    # export.target both (the toy's): the Core AI asset, its parity and its eval, where the coreai extra is installed
    from distillgates.runtime.coreai_engine import unavailable

    coreai_eval = report["gate_inputs"]["coreai_eval"]
    if unavailable() is None:
        assert (run_dir / "export" / "model.aimodel").is_dir()
        assert min(report["gate_inputs"]["coreai_parity"]["cosine_by_shape"].values()) > 0.99
        n = report["quality"]["student"]["n"]  # every drawn item (fewer than export.coreai_eval_items, 32)
        assert coreai_eval["items"] == n and coreai_eval["identical"] + len(coreai_eval["differing_ids"]) == n
        assert len(coreai_eval["item_scores"]) == n  # the coreai quality gates' intervals
    else:
        assert coreai_eval == report["gate_inputs"]["coreai_parity"] == {"skipped": unavailable()}
    # timed in speed worker processes as the gates time (one thread, compilation in the warm-up), not in this one
    assert "speed worker process" in report["speed"]["measured_in"] and report["speed"]["threads"] == 1
    lengths = yaml.safe_load(config.read_text())["shapes"]["lengths"]
    assert list(report["speed"]["per_shape"]) == [str(n) for n in lengths]  # every enumerated shape timed
    hardware = report["header"]["hardware"]  # what timed the speed figures
    assert hardware["export_path"] == "pytorch_eager" and hardware["export_dir"] is None
    speculative = report["gate_inputs"]["speculative"]
    assert [len(p) for p in speculative["tps_plain"]] == [len(p) for p in speculative["tps_speculative"]] == [8] * 3
    # the drafter alone too, and the TTFT of each mode, in the same processes
    assert all([len(p) for p in speculative[key]] == [8] * 3
               for key in ("tps_drafter", "ttft_plain", "ttft_speculative", "ttft_drafter"))
    assert 0 < len(speculative["rollback_rate_per_item"]) <= 12  # the eval items (12 here, speculative_items 32)
    low, high = speculative["speedup_ci"]
    assert low <= speculative["speedup"] <= high


@pytest.mark.integration
def test_rerun_skips_fresh_steps_and_a_changed_section_reruns_only_its_steps(
    tiny_run: tuple[Path, Path], tmp_path: Path
) -> None:
    config, run_dir = tiny_run
    run_dir = Path(shutil.copytree(run_dir, tmp_path / "run"))
    before = json.loads((run_dir / "manifest.json").read_text())
    run_pipeline(config, run_dir)
    assert json.loads((run_dir / "manifest.json").read_text()) == before  # nothing re-ran

    data = yaml.safe_load(config.read_text())
    data["speed"]["repeats"] = 2
    changed = tmp_path / "changed.yaml"
    changed.write_text(yaml.safe_dump(data))
    run_pipeline(changed, run_dir)
    after = json.loads((run_dir / "manifest.json").read_text())
    rerun = {name for name in before if name != "_started" and after[name] != before[name]}
    assert rerun == {"speed", "report"}


@pytest.mark.integration
def test_constrained_tool_calls_rerun_only_eval(tiny_run: tuple[Path, Path], tmp_path: Path) -> None:
    """``eval.constrained_tool_calls``: the student is evaluated (and its shards re-run) under
    constrained JSON decoding; a different runner fingerprint, nothing upstream re-runs."""
    config, run_dir = tiny_run
    run_dir = Path(shutil.copytree(run_dir, tmp_path / "run"))
    before = json.loads((run_dir / "manifest.json").read_text())
    old = read_report(run_dir / "reports" / "report.json")
    data = yaml.safe_load(config.read_text())
    data["eval"] = {"constrained_tool_calls": True}
    changed = tmp_path / "constrained.yaml"
    changed.write_text(yaml.safe_dump(data))
    run_pipeline(changed, run_dir)
    after = json.loads((run_dir / "manifest.json").read_text())
    # coreai_eval compares the asset's outputs with the eval's: it follows the eval
    assert {name for name in before if name != "_started" and after[name] != before[name]} == {"eval", "coreai_eval",
                                                                                                "report"}
    new = read_report(run_dir / "reports" / "report.json")
    runner = "runner_fingerprint"
    assert new["quality"]["student"]["fingerprints"][runner] != old["quality"]["student"]["fingerprints"][runner]
    assert new["quality"]["teacher"]["fingerprints"][runner] == old["quality"]["teacher"]["fingerprints"][runner]
    assert new["quality"]["student"]["json_validity"] in (None, 1.0)  # None: the tiny student called no tool
    determinism = new["gate_inputs"]["determinism"]
    assert determinism["coverage"] == 1.0 and determinism["mismatches"] == 0



@pytest.mark.integration
def test_an_on_policy_student_step_scores_its_samples_with_the_runs_teacher(tiny_run: tuple[Path, Path],
                                                                             tmp_path: Path) -> None:
    """``train.on_policy``: the student step loads the run's local teacher (as for ``teacher_mode: online``) and
    the drawn steps train on the student's samples."""
    config, run_dir = tiny_run
    run_dir = Path(shutil.copytree(run_dir, tmp_path / "run"))
    data = yaml.safe_load(config.read_text())
    data["train"]["on_policy"] = {"share": 0.5, "max_new_tokens": 8, "max_turns": 1}
    changed = tmp_path / "on_policy.yaml"
    changed.write_text(yaml.safe_dump(data))
    cfg = load_config(changed)
    shutil.rmtree(run_dir / "student")
    train_role(cfg, RunDir(run_dir), "student")
    log = [json.loads(line) for line in (run_dir / "student" / "train_log.jsonl").read_text().splitlines()]
    drawn = [r["on_policy"] for r in log if "total" in r]
    assert drawn == [on_policy_step(cfg.train, step) for step in range(cfg.train.steps)] and any(drawn)

@pytest.mark.integration
def test_eval_batch_size_reruns_only_eval_with_the_same_outputs(tiny_run: tuple[Path, Path], tmp_path: Path) -> None:
    """``eval.batch_size``: the student's items decoded together (and its shards likewise); the outputs
    equal the batch-1 run's, the runner fingerprint differs, nothing upstream re-runs."""
    from distillgates.eval.sharding import read_outputs

    config, run_dir = tiny_run
    single = read_outputs(run_dir / "eval" / "outputs.jsonl")
    run_dir = Path(shutil.copytree(run_dir, tmp_path / "run"))
    before = json.loads((run_dir / "manifest.json").read_text())
    data = yaml.safe_load(config.read_text())
    data["eval"] = {"batch_size": 4}
    changed = tmp_path / "batched.yaml"
    changed.write_text(yaml.safe_dump(data))
    run_pipeline(changed, run_dir)
    after = json.loads((run_dir / "manifest.json").read_text())
    # coreai_eval compares the asset's outputs with the eval's: it follows the eval
    assert {name for name in before if name != "_started" and after[name] != before[name]} == {"eval", "coreai_eval",
                                                                                                "report"}
    assert read_outputs(run_dir / "eval" / "outputs.jsonl") == single
    old, new = (read_report(d / "reports" / "report.json")["quality"]["student"] for d in (tiny_run[1], run_dir))
    assert new["fingerprints"]["runner_fingerprint"] != old["fingerprints"]["runner_fingerprint"]
    report = read_report(run_dir / "reports" / "report.json")
    determinism = report["gate_inputs"]["determinism"]
    assert determinism["coverage"] == 1.0 and determinism["mismatches"] == 0


NOISE = ("Failed to load _MLModelProxy", "has not been tested with coremltools", "Core ML only supports fp16 states",
         "Running MIL", "LeafSpec")  # fmt: skip


@pytest.mark.integration  # the CLI in subprocesses on the tiny run (~18 s)
@pytest.mark.skipif(sys.platform == "darwin", reason="the coremltools native-runtime warnings are Linux-only")
def test_the_command_keeps_third_party_noise_out(tiny_run: tuple[Path, Path], tmp_path: Path) -> None:
    """`distillgates export` prints its own progress; DISTILLGATES_VERBOSE=1 shows what it hides."""
    config, run_dir = tiny_run
    run_dir = Path(shutil.copytree(run_dir, tmp_path / "run"))
    command = [sys.executable, "-m", "distillgates.cli", "export", str(config), "--run-dir", str(run_dir), "--force"]
    env = {k: v for k, v in os.environ.items() if k not in ("DISTILLGATES_VERBOSE", "TQDM_DISABLE")}
    outputs = {}
    for verbose in (False, True):
        extra = {"DISTILLGATES_VERBOSE": "1"} if verbose else {}
        done = subprocess.run(command, env={**env, **extra}, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr
        outputs[verbose] = done.stdout + done.stderr
    assert [n for n in NOISE if n in outputs[False]] == []
    assert "export" in outputs[False]
    assert [n for n in NOISE if n not in outputs[True]] == []


@pytest.mark.integration
def test_force_redoes_a_step(tiny_run: tuple[Path, Path], tmp_path: Path) -> None:
    config, run_dir = tiny_run
    run_dir = Path(shutil.copytree(run_dir, tmp_path / "run"))
    before = json.loads((run_dir / "manifest.json").read_text())
    assert cli_main(["speed", str(config), "--run-dir", str(run_dir), "--force"]) == 0
    after = json.loads((run_dir / "manifest.json").read_text())
    assert after["speed"]["finished_at"] >= before["speed"]["finished_at"]
    assert after["speed"]["fingerprint"] == before["speed"]["fingerprint"]
    assert after["data"] == before["data"]


def test_a_step_alone_names_what_to_run_first(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = tiny_config(tmp_path)
    assert cli_main(["eval", str(config), "--run-dir", str(tmp_path / "empty")]) == 2
    err = capsys.readouterr().err
    assert "needs data, teacher, student" in err and "distillgates data" in err


def test_changed_inputs_clear_a_resumable_steps_folder(tmp_path: Path) -> None:
    """A checkpoint from other inputs must never be resumed: the step folder starts empty."""
    cfg = load_config(tiny_config(tmp_path))
    pipeline = Pipeline(cfg, tmp_path / "run")
    student = next(s for s in STEPS if s.name == "student")
    stale = tmp_path / "run" / "student" / "checkpoint.pt"
    stale.parent.mkdir(parents=True)
    stale.write_bytes(b"from another config")
    pipeline._prepare_output(student, force=False)
    assert not stale.exists()
    stale.parent.mkdir(parents=True, exist_ok=True)
    stale.write_bytes(b"interrupted attempt of the same inputs")
    pipeline._prepare_output(student, force=False)  # same fingerprint as the recorded attempt: resume
    assert stale.exists()


@pytest.mark.integration  # on the tiny end-to-end run
def test_a_corrupted_artifact_in_a_cached_run_is_detected_and_rebuilt(
    tiny_run: tuple[Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The manifest records a checksum of every output: a malformed ``data/eval.jsonl`` is not reused."""
    config, run_dir = tiny_run
    run_dir = Path(shutil.copytree(run_dir, tmp_path / "run"))
    before = json.loads((run_dir / "manifest.json").read_text())
    eval_set = run_dir / "data" / "eval.jsonl"
    good = eval_set.read_bytes()
    eval_set.write_bytes(good + b'{"id": "broken"\n')
    run_pipeline(config, run_dir)
    assert "data/eval.jsonl changed since the step wrote it" in capsys.readouterr().err
    after = json.loads((run_dir / "manifest.json").read_text())
    assert after["data"]["finished_at"] >= before["data"]["finished_at"] and eval_set.read_bytes() == good
    # the rebuilt data is byte-identical, so nothing downstream re-runs (it depends on output checksums)
    assert {name for name in before if name not in ("_started", "data") and after[name] != before[name]} == set()


@pytest.mark.integration  # on the tiny end-to-end run
def test_the_report_step_runs_without_qat(tiny_run: tuple[Path, Path], tmp_path: Path) -> None:
    """With ``train.qat.enabled: false`` there is no ``student/qat_probe.json``: the report has no qat inputs."""
    config, run_dir = tiny_run
    run_dir = Path(shutil.copytree(run_dir, tmp_path / "run"))
    (run_dir / "student" / "qat_probe.json").unlink()
    pipeline = Pipeline(load_config(config), run_dir)
    pipeline.run_step(next(s for s in STEPS if s.name == "report"), force=True)
    report = read_report(run_dir / "reports" / "report.json")
    assert "qat" not in report["gate_inputs"] and "determinism" in report["gate_inputs"]


@pytest.mark.integration  # on the tiny end-to-end run
def test_the_report_is_the_eval_run_and_its_unsharded_arm(tiny_run: tuple[Path, Path]) -> None:
    """The student is evaluated once: the reported outputs are the determinism check's unsharded arm."""
    from distillgates.eval.sharding import outputs_sha256, read_outputs

    _, run_dir = tiny_run
    outputs = read_outputs(run_dir / "eval" / "outputs.jsonl")
    report = read_report(run_dir / "reports" / "report.json")
    assert len(outputs) == report["quality"]["student"]["n"]
    assert report["gate_inputs"]["determinism"]["unsharded_sha256"] == outputs_sha256(outputs)


def test_each_step_is_keyed_by_its_own_config_fields(tmp_path: Path) -> None:
    """``kd.items`` changes the KD set, never the teacher; the teacher's training fields change the teacher
    (and, through its outputs, everything after it) but not the data."""
    import dataclasses

    cfg = load_config(tiny_config(tmp_path))
    assert cfg.teacher is not None
    steps = {s.name: s for s in STEPS}

    def fingerprints(config) -> dict[str, str]:
        pipeline = Pipeline(config, tmp_path / "run")
        return {name: pipeline.fingerprint(step) for name, step in steps.items()}

    base = fingerprints(cfg)
    more_kd = fingerprints(dataclasses.replace(cfg, kd=dataclasses.replace(cfg.kd, items=7)))
    assert {n for n in base if base[n] != more_kd[n]} == {"kd", "report"}
    longer = dataclasses.replace(cfg.teacher, train=dataclasses.replace(cfg.teacher.train, steps=99))
    retrained = fingerprints(dataclasses.replace(cfg, teacher=longer))
    assert {n for n in base if base[n] != retrained[n]} == {"teacher", "report"}  # the rest follow its outputs


def test_seed_replaces_the_top_level_seed_and_keeps_the_data(tmp_path: Path, monkeypatch) -> None:
    """``--seed N``: another build of the same task (initialisation and batch order), in runs/<name>-seed<N>; the
    data (and so the eval set the drift baselines are keyed by) stays."""
    from distillgates.pipeline import default_run_dir, load_run

    config = tiny_config(tmp_path)
    (base, _), (other, _) = load_run(config), load_run(config, seed=7)
    assert (base.seed, base.train.seed, base.drafter_train.seed) == (0, 0, 0)
    assert (other.seed, other.train.seed, other.drafter_train.seed, other.data.seed) == (7, 7, 7, base.data.seed)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "pyproject.toml").write_text("")
    assert default_run_dir(other, 7).name == "tiny-seed7" and default_run_dir(base).name == "tiny"
    assert cli_main(["data", str(config)]) == 0 and cli_main(["data", str(config), "--seed", "7"]) == 0
    manifests = [json.loads((tmp_path / "runs" / n / "manifest.json").read_text()) for n in ("tiny", "tiny-seed7")]
    assert manifests[0]["data"]["outputs"] == manifests[1]["data"]["outputs"]  # the same files, byte for byte
    assert cli_main(["eval", str(config), "--seed", "7"]) == 2  # a step alone: the seed's own run, no student yet


@pytest.mark.integration  # tiny steps data..student twice (~20 s)
def test_student_seed_trains_another_student_of_the_same_teacher_and_kd_set(tmp_path: Path, monkeypatch) -> None:
    """``--student-seed M``: only the student's and drafter's seed change; the data, teacher, check and KD set are
    taken from runs/<name> (fresh there, same fingerprints), not rebuilt, and the student is trained anew."""
    from distillgates.pipeline import default_run_dir, load_run
    from distillgates.rundir import RunDir

    config = tiny_config(tmp_path)
    (base, _), (other, _) = load_run(config), load_run(config, student_seed=3)
    assert (other.seed, other.train.seed, other.drafter_train.seed) == (base.seed, 3, 3)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "pyproject.toml").write_text("")
    assert default_run_dir(other, None, 3).name == "tiny-student-seed3"
    assert default_run_dir(other, 2, 3).name == "tiny-seed2-student-seed3"
    for step in ("data", "teacher", "check", "kd", "student"):
        assert cli_main([step, str(config)]) == 0
    assert cli_main(["student", str(config), "--student-seed", "3"]) == 0
    runs = tmp_path / "runs"
    first, second = (json.loads((runs / n / "manifest.json").read_text()) for n in ("tiny", "tiny-student-seed3"))
    for step in ("data", "teacher", "check", "kd"):
        assert second[step] == first[step], step  # the same entry: taken over, not re-run
    assert second["student"]["inputs"]["config"]["train"]["seed"] == 3
    weights = [RunDir(runs / n).load_model().state_dict() for n in ("tiny", "tiny-student-seed3")]
    assert any(not torch_equal(a, weights[1][k]) for k, a in weights[0].items())
    pipeline = Pipeline(load_run(config, runs / "tiny-student-seed3", student_seed=3)[0], runs / "tiny-student-seed3")
    assert all(pipeline.stale_reason(step) is None for step in STEPS if step.name in second)


def torch_equal(a, b) -> bool:
    import torch

    return bool(torch.equal(a, b))


def test_the_committed_drift_baselines_are_another_builds_than_the_one_make_test_gates() -> None:
    """``make test`` gates runs/toy (the toy at its own seed) against baselines/common, blessed from a build of another
    seed (runs/toy-seed1, recorded in each entry's provenance): every CI run gates another build than the blessed one,
    as a machine of another CPU kind does (issue #40; docs/benchmarks.md, section 11). Re-bless with ``distillgates
    run --seed 1``, then ``pytest pytest_distillgates/checklist --run-dir runs/toy-seed1 --bless -m "f1_drift or
    shape_drift"``."""
    from distillgates.pipeline import load_run

    root = Path(__file__).parents[1]
    built = load_run(TOY)[0]  # make test's runs/toy
    for group in ("f1_drift", "shape_drift"):
        entries = json.loads((root / "baselines" / "common" / f"{group}.json").read_text())["entries"]
        blessed = {json.dumps(entry["provenance"]["seeds"], sort_keys=True) for entry in entries.values()}
        assert blessed == {json.dumps({"seed": 1, "train.seed": 1})}, f"baselines/common/{group}.json: not --seed 1"
    assert built.seed != 1 and built.train.seed != 1  # another teacher and student than the baselines' build


def test_the_student_is_retrained_when_its_qat_grid_follows_export_quantize_to_int4(tmp_path: Path) -> None:
    """With QAT on, int8 -> int4 (or another int4 block) changes the student's grid: the student step re-runs; with
    QAT off, or for int8 <-> none (both int8 QAT), only the export step's fingerprint moves."""
    import dataclasses

    cfg = load_config(tiny_config(tmp_path))
    steps = {s.name: s for s in STEPS}

    def fingerprints(qat: bool, **export: object) -> dict[str, str]:
        train = dataclasses.replace(cfg.train, qat=dataclasses.replace(cfg.train.qat, enabled=qat))
        config = dataclasses.replace(cfg, train=train, export=dataclasses.replace(cfg.export, **export))
        pipeline = Pipeline(config, tmp_path / "run")
        return {name: pipeline.fingerprint(steps[name]) for name in ("student", "export")}

    for qat in (True, False):
        int8, none = fingerprints(qat, quantize="int8"), fingerprints(qat, quantize="none")
        int4, block64 = fingerprints(qat, quantize="int4"), fingerprints(qat, quantize="int4", int4_block_size=64)
        assert int8["student"] == none["student"] and int8["export"] != none["export"]
        assert (int4["student"] != int8["student"]) is qat and (block64["student"] != int4["student"]) is qat


def test_fingerprints_cover_library_versions_and_the_measuring_machine(tmp_path: Path, monkeypatch) -> None:
    """A library upgrade re-runs the steps whose output depends on it; another machine re-runs the export
    (its figures) and speed, never training; the stale reason names what changed."""
    from distillgates import pipeline as pipeline_module

    cfg = load_config(tiny_config(tmp_path))
    steps = {s.name: s for s in STEPS}
    pipeline = Pipeline(cfg, tmp_path / "run")

    def fingerprints() -> dict[str, str]:
        return {name: pipeline.fingerprint(step) for name, step in steps.items()}

    base = fingerprints()
    versions = pipeline_module.library_versions()
    for library, expected in [("torch", {"teacher", "check", "kd", "student", "drafter", "export", "speed", "eval"}),
                              ("coremltools", {"export", "speed"}),
                              ("transformers", {"data", "teacher", "check", "kd", "eval"}),
                              ("tokenizers", {"data", "teacher", "check", "kd", "student", "drafter", "speed", "eval"}),
                              ("trl", {"teacher"}), ("peft", {"teacher"})]:
        upgraded = {**versions, library: "99.0"}
        monkeypatch.setattr(pipeline_module, "library_versions",
                            lambda names=pipeline_module.LIBRARIES, v=upgraded: {n: v[n] for n in names})
        changed = fingerprints()
        assert {n for n in base if base[n] != changed[n]} == expected, library
    monkeypatch.undo()
    other = {**pipeline_module.machine_identity(), "soc": "Apple M9 Max", "os": "macOS 99.0"}
    monkeypatch.setattr(pipeline_module, "machine_identity", lambda: other)
    changed = fingerprints()
    assert {n for n in base if base[n] != changed[n]} == {"export", "speed"}
    inputs = pipeline.inputs(steps["export"])
    pipeline.manifest["export"] = {"fingerprint": base["export"],
                                   "inputs": {**inputs, "env": {**inputs["env"], "machine": {}}}}
    assert pipeline.stale_reason(steps["export"]) == "inputs changed: env machine"


def test_ci_templates_key_their_cache_by_the_environment() -> None:
    from distillgates.pipeline import environment_key
    from distillgates.scaffold import TEMPLATES

    for name in ("quality-gates.yml", "macos-speed-gates.yml"):
        text = (TEMPLATES / name).read_text()
        step = next(line for line in text.splitlines() if "environment_key" in line)
        code = step.split("python -c '", 1)[1].split("'", 1)[0]
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
        assert out == environment_key() and len(out) == 16
        cache_key = next(line for line in text.splitlines() if "key: distillgates-run" in line)
        assert "${{ steps.env.outputs.key }}" in cache_key


# --------------------------------------------------------------------------------------
# The user's own OpenAI-format data


def own_data_config(path: Path, variants: int = 8, chat_template: str = "toy") -> Path:
    """The tiny config reading the ticketing/file-search dataset (written next to it) instead of the toy."""
    from .conftest import own_data_rows, write_jsonl

    write_jsonl(path / "rows.jsonl", own_data_rows(variants))
    cfg = yaml.safe_load(tiny_config(path).read_text())
    cfg["tokenizer"]["chat_template"] = chat_template
    cfg["data"] = {"source": "jsonl", "path": str(path / "rows.jsonl"), "eval_fraction": 0.25, "seed": 0}
    cfg["eval"] = {**cfg.get("eval", {}), "privacy": {"allow": ["create_ticket.reporter"]}}
    out = path / "own.yaml"
    out.write_text(yaml.safe_dump(cfg))
    return out


def test_data_step_on_own_files_reruns_on_their_content_and_a_bad_row_keeps_the_old_data(tmp_path: Path) -> None:
    from .conftest import own_data_rows, write_jsonl

    cfg = load_config(own_data_config(tmp_path))
    run = tmp_path / "run"
    Pipeline(cfg, run).run(["data"])
    data_step = next(s for s in STEPS if s.name == "data")
    assert Pipeline(cfg, run).stale_reason(data_step) is None
    before = {p.name: p.read_bytes() for p in (run / "data").glob("*.jsonl")}
    rows = own_data_rows(8)
    rows[3]["kind"] = "decline"  # an edited row: same config, new content
    write_jsonl(tmp_path / "rows.jsonl", rows)
    assert "inputs changed: files" in str(Pipeline(cfg, run).stale_reason(data_step))
    rows[4]["messages"][0]["role"] = "robot"
    write_jsonl(tmp_path / "rows.jsonl", rows)
    with pytest.raises(ValueError, match=r"rows\.jsonl:5: messages\[0\]\.role:"):
        Pipeline(cfg, run).run(["data"])
    assert {p.name: p.read_bytes() for p in (run / "data").glob("*.jsonl")} == before  # nothing lost


def test_an_eval_budget_that_cuts_a_reference_is_refused_by_the_check_and_eval_steps(tmp_path: Path) -> None:
    from distillgates.eval.runners import reference_output
    from distillgates.pipeline import step_eval

    cfg = load_config(own_data_config(tmp_path))
    run = tmp_path / "run"
    Pipeline(cfg, run).run(["data", "teacher", "check"])  # the default budget (96 tokens, 4 calls) holds them all
    items, tok = RunDir(run).items("eval"), RunDir(run).tokenizer()
    refs = [reference_output(i, tok) for i in items]
    turns = [[t["tokens"] for t in ref["turns"] if t["role"] == "assistant"] for ref in refs]
    longest = max(map(max, turns))
    cut = sum(longest in item for item in turns)
    short = dataclasses.replace(cfg, eval=dataclasses.replace(cfg.eval, max_new_tokens=longest - 1))
    refusal = rf"eval\.max_new_tokens {longest - 1} cuts the reference of {cut} of {len(items)} eval items, which " \
              rf"then fail whatever the model does \(the longest: [-\w]+, {longest} tokens in a turn .*\): set " \
              rf"eval\.max_new_tokens to at least {longest}"  # fmt: skip
    with pytest.raises(ValueError, match=refusal):
        Pipeline(short, run).run(["check"])
    with pytest.raises(ValueError, match=refusal):  # the eval step checks again (e.g. a budget lowered since)
        step_eval(short, RunDir(run))
    calls = max(len(ref["calls"]) for ref in refs)
    one_call = dataclasses.replace(cfg, eval=dataclasses.replace(cfg.eval, max_calls=calls - 1))
    with pytest.raises(ValueError, match=rf"eval\.max_calls {calls - 1} cuts the reference of \d+ of {len(items)} "
                       rf"eval items, .*\(the longest: [-\w]+, {calls} calls\): set eval\.max_calls to at least "
                       rf"{calls}"):  # fmt: skip
        Pipeline(one_call, run).run(["check"])
    exact = dataclasses.replace(cfg, eval=dataclasses.replace(cfg.eval, max_new_tokens=longest, max_calls=calls))
    Pipeline(exact, run).run(["check"])  # the longest reference fits exactly: accepted


@pytest.mark.integration  # the tiny end-to-end run on the ticketing/file-search data (~50 s each)
@pytest.mark.parametrize("chat_template", ["toy", "chatml"])
def test_own_data_runs_the_whole_pipeline(tmp_path: Path, chat_template: str) -> None:
    from distillgates.tokenizer import CHAT_TEMPLATES, load_tokenizer

    config = own_data_config(tmp_path, chat_template=chat_template)
    run_dir = run_pipeline(config, tmp_path / "run")
    assert load_tokenizer(run_dir / "data" / "tokenizer").chat_template == CHAT_TEMPLATES[chat_template].template
    header = {"toy": "<|assistant|>", "chatml": "<|im_start|>assistant\n"}[chat_template]
    kd_records = [json.loads(line) for line in (run_dir / "kd" / "kd.jsonl").read_text().splitlines()[1:]]
    assert kd_records and all(r["prompt_text"].endswith(header) for r in kd_records)
    report = read_report(run_dir / "reports" / "report.json")
    manifest = json.loads((run_dir / "manifest.json").read_text())
    assert {s.name for s in STEPS} == {name for name in manifest if not name.startswith("_")}
    items = [json.loads(line) for line in (run_dir / "data" / "eval.jsonl").read_text().splitlines()[1:]]
    assert items and all(item["tools"][0]["name"] == "create_ticket" for item in items)
    outputs = [json.loads(line) for line in (run_dir / "eval" / "outputs.jsonl").read_text().splitlines()]
    assert {o["id"] for o in outputs} == {item["id"] for item in items}
    assert report["quality"]["student"]["n"] == len(items)
    if chat_template == "chatml":  # the student's calls under constrained decoding, in the Hermes syntax
        data = yaml.safe_load(config.read_text())
        data["eval"]["constrained_tool_calls"] = True
        config.write_text(yaml.safe_dump(data))
        run_pipeline(config, run_dir)
        constrained = read_report(run_dir / "reports" / "report.json")["quality"]["student"]
        outputs = [json.loads(line) for line in (run_dir / "eval" / "outputs.jsonl").read_text().splitlines()]
        assert constrained["json_validity"] in (None, 1.0) and not any("unconstrained_reason" in o for o in outputs)


def test_a_teacher_that_calls_no_tool_is_refused_before_kd_with_its_figures(tmp_path: Path) -> None:
    from distillgates.teacher.check import TeacherRefused

    data = yaml.safe_load(tiny_config(tmp_path).read_text())
    data["teacher"]["check"] = {"items": 4, "min_call_rate": 0.5}
    config = tmp_path / "refused.yaml"
    config.write_text(yaml.safe_dump(data))
    refusal = (r"the toy teacher calls a tool on [01] of 4 held-out tool items \(call rate 0\.\d\d < "
               r"teacher\.check\.min_call_rate 0\.5; tool selection .*train it longer")
    with pytest.raises(TeacherRefused, match=refusal):
        run_pipeline(config, tmp_path / "run")
    check = json.loads((tmp_path / "run" / "teacher_check.json").read_text())
    assert check["items"] == 4 and check["call_rate"] < 0.5 and check["passed"] is False
    assert not (tmp_path / "run" / "kd").exists()  # refused before the KD step wrote anything
    manifest = json.loads((tmp_path / "run" / "manifest.json").read_text())
    assert "teacher" in manifest and "check" not in manifest and "kd" not in manifest  # a refusal is never cached


def test_student_and_drafter_fingerprints_cover_the_init_checkpoint_files(tmp_path: Path) -> None:
    """A checkpoint replaced in place (``train.init_from: hf:<dir>``) re-trains student and drafter."""
    checkpoint = tmp_path / "ckpt"
    checkpoint.mkdir()
    (checkpoint / "config.json").write_text("{}")
    (checkpoint / "model.safetensors").write_bytes(b"weights v1")
    cfg = yaml.safe_load(tiny_config(tmp_path).read_text())
    for section in ("train", "drafter_train"):  # the drafter trains with drafter_train when the config has one
        if section == "train" or cfg.get(section):
            cfg.setdefault(section, {})["init_from"] = f"hf:{checkpoint}"
    (tmp_path / "hf.yaml").write_text(yaml.safe_dump(cfg))
    config = load_config(tmp_path / "hf.yaml")
    steps = [s for s in STEPS if s.name in ("student", "drafter")]
    before = [Pipeline(config, tmp_path / "run").fingerprint(s) for s in steps]
    assert all(str(checkpoint / "model.safetensors") in Pipeline(config, tmp_path / "run").inputs(s)["files"]
               for s in steps)
    (checkpoint / "model.safetensors").write_bytes(b"weights v2")
    assert all(a != b for a, b in zip(before, [Pipeline(config, tmp_path / "run").fingerprint(s) for s in steps],
                                      strict=True))


@pytest.mark.integration
def test_an_int4_export_calibrates_on_the_runs_training_conversations(tiny_run: tuple[Path, Path],
                                                                      tmp_path: Path) -> None:
    """``export.calibration: clip_search``: the export step tokenizes the first ``calibration_rows`` training
    conversations and the package records its calibration; the student (QAT off) is trained once more."""
    config, run_dir = tiny_run
    run_dir = Path(shutil.copytree(run_dir, tmp_path / "run"))
    data = yaml.safe_load(config.read_text())
    data["train"]["qat"] = {"enabled": False}
    data["export"] = {"quantize": "int4", "int4_block_size": 16, "calibration": "clip_search", "calibration_rows": 4}
    data.setdefault("gates", {})["export_cosine_min"] = 0.95  # int4 of a 1-layer toy: ~0.99 (the plumbing is tested)
    changed = tmp_path / "int4.yaml"
    changed.write_text(yaml.safe_dump(data))
    Pipeline(load_config(changed), run_dir).run(["student", "export"])
    contract = json.loads((run_dir / "export" / "contract.json").read_text())
    assert contract["export"]["quantize"] == "int4" and contract["export"]["calibration"] == "clip_search"


@pytest.mark.integration
def test_the_quality_figures_leave_out_the_eval_top_up_and_the_drift_scores_keep_it(tiny_run: tuple[Path, Path],
                                                                                    tmp_path: Path) -> None:
    """Items ``data.eval_min_per_shape`` added power the drift gates (the student's per-item scores cover them) but
    are not the task's mix of shapes: the student's and the teacher's figures are over the items as drawn."""
    from distillgates.data.dataset import TOP_UP
    from distillgates.pipeline import step_eval
    from distillgates.rundir import RunDir

    config, run_dir = tiny_run
    run = RunDir(shutil.copytree(run_dir, tmp_path / "run"))
    lines = run.dataset("eval").read_text().splitlines()
    items = [json.loads(line) for line in lines[1:]]
    top_up = {item["id"] for item in items[len(items) // 2:]}
    run.dataset("eval").write_text("\n".join([lines[0], *(json.dumps({**i, TOP_UP: True} if i["id"] in top_up else i)
                                                         for i in items)]) + "\n")  # fmt: skip
    step_eval(load_config(config), run)
    quality = json.loads(run.quality.read_text())
    assert quality["student"]["n"] == quality["teacher"]["n"] == len(items) - len(top_up)
    assert {row["id"] for row in json.loads(run.item_scores.read_text())["items"]} == {i["id"] for i in items}


@pytest.mark.integration
def test_coreai_eval_names_the_items_the_asset_decodes_otherwise(tiny_run: tuple[Path, Path], tmp_path: Path) -> None:
    """The injected violation: one PyTorch output changed after the eval, so the asset's output of that item differs
    from it; the coreai_eval step names exactly that item, and the gate's share drops."""
    from distillgates.eval.sharding import read_outputs, write_outputs
    from distillgates.pipeline import coreai_eval_path, load_run, step_coreai_eval
    from distillgates.rundir import RunDir
    from distillgates.runtime.coreai_engine import unavailable

    if unavailable() is not None:
        pytest.skip(str(unavailable()))
    config, run_dir = tiny_run
    run_dir = Path(shutil.copytree(run_dir, tmp_path / "run"))
    cfg, _ = load_run(config, run_dir)
    run = RunDir(run_dir)
    before = json.loads(coreai_eval_path(run).read_text())  # decoded by 2 runtime workers side by side (default)
    one = dataclasses.replace(cfg, export=dataclasses.replace(cfg.export, coreai_eval_workers=1))
    step_coreai_eval(one, run)
    assert json.loads(coreai_eval_path(run).read_text()) == before  # the same outputs and scores, in item order
    outputs = read_outputs(run.eval_outputs)
    outputs[0] = {**outputs[0], "answer": outputs[0]["answer"] + " (another model's answer)"}
    write_outputs(run.eval_outputs, outputs)
    after = step_coreai_eval(cfg, run)
    measured = json.loads(coreai_eval_path(run).read_text())
    assert outputs[0]["id"] in measured["differing_ids"]
    assert set(measured["differing_ids"]) == set(before["differing_ids"]) | {outputs[0]["id"]}
    assert after["identical"] == before["identical"] - (outputs[0]["id"] not in before["differing_ids"])


def test_a_gemma3_student_in_the_ane_layout_is_refused_before_the_first_step(tmp_path: Path) -> None:
    """The ANE layout does not compute Gemma 3's features (the standard layout does): refused by the preflight, not
    minutes later in the export step."""
    from distillgates.pipeline import preflight

    data = yaml.safe_load(tiny_config(tmp_path).read_text())
    data["train"]["init_from"] = "scratch"
    data["student"].update(embed_scale=True, activation="gelu_tanh", sandwich_norm=True)
    data["export"].update(layout="ane", target="coreml")  # the Core AI target converts layout standard only
    (tmp_path / "gemma.yaml").write_text(yaml.safe_dump(data))
    with pytest.raises(ValueError, match=r"export.layout: ane does not compute Gemma 3's embed_scale, activation, "
                                         r"sandwich_norm \(the student's\): use layout: standard"):
        preflight(load_config(tmp_path / "gemma.yaml"))
    data["export"]["layout"] = "standard"
    (tmp_path / "gemma.yaml").write_text(yaml.safe_dump(data))
    preflight(load_config(tmp_path / "gemma.yaml"))


def test_the_preflight_names_a_missing_teacher_checkpoint_and_a_pretrained_student_without_its_tokenizer(
    tmp_path: Path,
) -> None:
    """Found before the first step, naming the setting: a ``teacher.path`` with no checkpoint, an ``init_from``
    checkpoint without ``tokenizer.path`` (the data step's trained tokenizer cannot index its embeddings)."""
    from distillgates.pipeline import preflight, step_teacher

    (tmp_path / "a.yaml").write_text(f"teacher:\n  kind: local\n  path: {tmp_path / 'nothing'}\n")
    with pytest.raises(FileNotFoundError, match=r"teacher\.path: no checkpoint at"):
        preflight(load_config(tmp_path / "a.yaml"))
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "b.yaml").write_text(f"train:\n  init_from: hf:{tmp_path / 'ckpt'}\n")
    with pytest.raises(ValueError, match=r"train\.init_from 'hf:.*': needs tokenizer\.path"):
        preflight(load_config(tmp_path / "b.yaml"))
    with pytest.raises(ValueError, match="config has no teacher section"):
        step_teacher(dataclasses.replace(load_config(tmp_path / "b.yaml"), teacher=None), RunDir(tmp_path / "run"))


@pytest.mark.integration
def test_target_coreai_ships_the_asset_alone_through_the_pipeline(tiny_run: tuple[Path, Path], tmp_path: Path) -> None:
    """``export.target: coreai``: the export step writes ``model.aimodel`` only (the earlier package removed), the
    coreai_eval step decodes through it, the report validates, and the checklist gates the asset: its parity as the
    export gates' cosines, the identity gate over its digest; the Core ML lints skip, saying why."""
    from distillgates.runtime.coreai_engine import unavailable

    if unavailable() is not None:
        pytest.skip(str(unavailable()))
    config, run_dir = tiny_run
    run_dir = Path(shutil.copytree(run_dir, tmp_path / "run"))
    data = yaml.safe_load(config.read_text())
    data["export"] = {**data.get("export", {}), "target": "coreai"}
    changed = tmp_path / "coreai.yaml"
    changed.write_text(yaml.safe_dump(data))
    Pipeline(load_config(changed), run_dir).run(["export", "coreai_eval", "report"])
    assert sorted(p.name for p in (run_dir / "export").iterdir() if p.is_dir()) == ["model.aimodel"]
    report = read_report(run_dir / "reports" / "report.json")
    assert report["gate_inputs"]["export"]["source"].startswith("model.aimodel run by Core AI's runtime")
    assert report["gate_inputs"]["coreai_eval"]["items"] == report["quality"]["student"]["n"]
    gates = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rs",
                            str(Path(__file__).parents[1] / "pytest_distillgates" / "checklist"),
                            f"--run-dir={run_dir}", "-m", "export or coreai_parity or determinism",
                            "-k", "not coreai_quality"],  # the tiny student's quality is not the toy's
                           capture_output=True, text=True, cwd=tmp_path)  # fmt: skip
    assert gates.returncode == 0, gates.stdout[-3000:]
    assert "export.target coreai: the export lints" in gates.stdout
    assert " failed" not in gates.stdout.splitlines()[-1]


def _coreai_speed_run(tiny_run: tuple[Path, Path], tmp_path: Path) -> tuple[Pipeline, Path]:
    """A copy of the tiny run configured to export the Core AI asset alone and time it (``speed.engine: coreai``)."""
    config, run_dir = tiny_run
    run_dir = Path(shutil.copytree(run_dir, tmp_path / "run"))
    data = yaml.safe_load(config.read_text())
    data["export"] = {**data.get("export", {}), "target": "coreai"}
    data["speed"]["engine"] = "coreai"
    changed = tmp_path / "coreai_speed.yaml"
    changed.write_text(yaml.safe_dump(data))
    return Pipeline(load_config(changed), run_dir), run_dir


@pytest.mark.integration
def test_speed_engine_coreai_off_macos_is_refused_naming_why(tiny_run: tuple[Path, Path], tmp_path: Path) -> None:
    """Core AI's Linux runtime computes what the asset computes, one thread, no device: the speed step refuses to
    time it (the speed worker says why), rather than report its seconds as the model's speed."""
    from distillgates.runtime.coreai_engine import unavailable
    from distillgates.speed_worker import WorkerError

    if sys.platform == "darwin":
        pytest.skip("on macOS the asset is timed: test_speed_engine_coreai_times_the_asset_on_macos")
    if unavailable() is not None:
        pytest.skip(str(unavailable()))
    pipeline, _ = _coreai_speed_run(tiny_run, tmp_path)
    pipeline.run(["export"])
    with pytest.raises(WorkerError, match=r"speed.engine coreai needs macOS 27 \(Core AI.s OS framework\)"):
        pipeline.run(["speed"])


@pytest.mark.integration
@pytest.mark.requires_macos
def test_speed_engine_coreai_times_the_asset_on_macos(tiny_run: tuple[Path, Path], tmp_path: Path) -> None:
    """macOS 27: the speed step's worker runs ``export/model.aimodel`` through Core AI's OS framework in its own
    process (its peak memory holds the model) and the report says what was timed."""
    from distillgates.runtime.coreai_engine import unavailable

    if unavailable() is not None:
        pytest.skip(str(unavailable()))
    pipeline, run_dir = _coreai_speed_run(tiny_run, tmp_path)
    pipeline.run(["export", "speed"])
    speed = json.loads((run_dir / "reports" / "speed.json").read_text())
    assert speed["speed"]["backend"] == "coreai" and speed["speed"]["export"] is True
    assert speed["hardware"]["export_path"] == "pytorch_exportedprogram_coreai"
    assert speed["speed"]["tps"]["p50"] > 0 and speed["speed"]["ttft_ms"]["p50"] > 0
