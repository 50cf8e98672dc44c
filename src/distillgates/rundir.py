"""The run directory: one object owns its layout (torchtune's checkpointer owns ``output_dir``).

Every step of the pipeline, the speed harness, the training recipe, the gates and the plugin ask a
:class:`RunDir` for a path or a loaded artifact; nobody spells ``student/model.pt``. Layout::

    manifest.json            step fingerprints, output checksums, timings (pipeline.py)
    data/                    tokenizer/, train.jsonl, eval.jsonl,         (data step)
                             skipped_rows.jsonl (data.invalid_rows: skip)
    teacher/                 the toy teacher (save_pretrained)             (teacher step)
    kd/                      kd.jsonl, build.json                          (kd step)
    cache/kd/                API response cache: survives KD rebuilds      (kd step)
    student/, drafter/       model.pt, hf/ (HF format + tokenizer), checkpoint.pt, init.json,
                             qat_probe.json                                 (training)
    export/                  model.mlpackage, contract.json, gate_inputs.json  (export step)
                             ane_lint.json; ane_residency.json, coreml_parity.json (macOS only)
    reports/speed.json       (speed step)
    eval/                    quality.json, determinism.json, outputs.jsonl, item_scores.json (eval step)
    reports/report.json      the validated report                          (report step)

Loaded artifacts (items per split, the tokenizer) are read once per object.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from distillgates.config import Config
    from distillgates.model import Transformer

ROLES = ("student", "drafter")


class RunArtifactError(ValueError):
    """An artifact the caller needs is missing from (or unreadable in) the run directory."""


class RunDir:
    """Paths and artifacts of one pipeline run directory."""

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)
        self._items: dict[str, list[dict[str, Any]]] = {}
        self._tokenizer: Any = None

    def __repr__(self) -> str:
        return f"RunDir({str(self.root)!r})"

    # -- layout --------------------------------------------------------------------------
    @property
    def manifest(self) -> Path:
        return self.root / "manifest.json"

    @property
    def data_dir(self) -> Path:
        return self.root / "data"

    @property
    def tokenizer_dir(self) -> Path:
        return self.data_dir / "tokenizer"

    def dataset(self, split: str) -> Path:
        """``data/<split>.jsonl`` (``train`` or ``eval``)."""
        if split not in ("train", "eval"):
            raise ValueError(f"split must be 'train' or 'eval', got {split!r}")
        return self.data_dir / f"{split}.jsonl"

    @property
    def teacher_dir(self) -> Path:
        """The teacher this run trains: the toy teacher, or ``teacher.path`` fine-tuned (:meth:`teacher_model_dir`)."""
        return self.root / "teacher"

    @property
    def teacher_check(self) -> Path:
        """The local teacher's figures on held-out tool items (:mod:`distillgates.teacher.check`)."""
        return self.root / "teacher_check.json"

    def teacher_model_dir(self, cfg: Config) -> Path:
        """The local teacher's model directory: ``teacher.path`` when given (a GGUF file: its converted checkpoint,
        :func:`distillgates.checkpoints.checkpoint_dir`) and not fine-tuned, else the teacher this run trained (the
        toy teacher, or ``teacher.path`` fine-tuned on the training rows)."""
        if cfg.teacher is not None and cfg.teacher.path and cfg.teacher.finetune is None:
            from distillgates.checkpoints import checkpoint_dir

            return checkpoint_dir(cfg.teacher.path)
        return self.teacher_dir

    @property
    def kd_dir(self) -> Path:
        return self.root / "kd"

    @property
    def kd_set(self) -> Path:
        return self.kd_dir / "kd.jsonl"

    @property
    def kd_build(self) -> Path:
        """How the KD set was built (teacher kind, determinism, retries): the HTTP determinism gate's input."""
        return self.kd_dir / "build.json"

    @property
    def kd_cache(self) -> Path:
        """API response cache, outside ``kd/`` so it survives a rebuild (its keys are request hashes)."""
        return self.root / "cache" / "kd"

    def model_dir(self, role: str) -> Path:
        if role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {role!r}")
        return self.root / role

    def model_path(self, role: str = "student") -> Path:
        return self.model_dir(role) / "model.pt"

    def hf_model_dir(self, role: str = "student") -> Path:
        """The trained model in Hugging Face format, with the run's tokenizer (``save_pretrained``)."""
        return self.model_dir(role) / "hf"

    def qat_probe(self, role: str = "student") -> Path:
        return self.model_dir(role) / "qat_probe.json"

    @property
    def export_dir(self) -> Path:
        return self.root / "export"

    @property
    def contract(self) -> Path:
        return self.export_dir / "contract.json"

    def package_digests(self) -> tuple[dict[str, str | None], Any]:
        """(the sha256 (:func:`distillgates.io.tree_sha256`) of every package the export recorded and of every
        ``*.mlpackage`` and ``*.aimodel`` in ``export/``, None where one is missing; the ``package_sha256`` the export
        recorded in ``contract.json``)."""
        from distillgates.io import tree_sha256

        recorded = self.read_json(self.contract).get("package_sha256")
        names = set(recorded) if isinstance(recorded, dict) else set()
        names |= {p.name for pattern in ("*.mlpackage", "*.aimodel") for p in self.export_dir.glob(pattern)}
        return {n: tree_sha256(self.export_dir / n) if (self.export_dir / n).exists() else None
                for n in sorted(names)}, recorded

    def verify_packages(self) -> dict[str, str]:
        """The exported packages' digests when they are the ones the export recorded, else a
        :class:`RunArtifactError` naming each missing, changed or unrecorded package."""
        current, recorded = self.package_digests()
        if not isinstance(recorded, dict) or not recorded:
            raise RunArtifactError(f"{self.contract}: no package_sha256 recorded (exported before package digests, "
                                   "or no package): re-run the export step")
        wrong = [f"{name}: sha256 {str(current[name])[:12]} (None: missing), the export recorded "
                 f"{str(recorded.get(name))[:12]} (None: not recorded)" for name in current
                 if current[name] != recorded.get(name)]
        if wrong:
            raise RunArtifactError(f"{self.export_dir}: not the packages the export wrote: " + "; ".join(wrong))
        return current  # type: ignore[return-value]  # every digest equals a recorded string

    @property
    def export_gate_inputs(self) -> Path:
        return self.export_dir / "gate_inputs.json"

    @property
    def reports_dir(self) -> Path:
        return self.root / "reports"

    @property
    def speed_report(self) -> Path:
        return self.reports_dir / "speed.json"

    @property
    def report(self) -> Path:
        return self.reports_dir / "report.json"

    @property
    def eval_dir(self) -> Path:
        return self.root / "eval"

    @property
    def quality(self) -> Path:
        return self.eval_dir / "quality.json"

    @property
    def determinism(self) -> Path:
        return self.eval_dir / "determinism.json"

    @property
    def eval_outputs(self) -> Path:
        """The student's per-item eval outputs (the reported run, also the determinism check's unsharded arm)."""
        return self.eval_dir / "outputs.jsonl"

    @property
    def item_scores(self) -> Path:
        """The student's per-item outcomes (:func:`distillgates.eval.scorer.item_rows`), one row per eval item."""
        return self.eval_dir / "item_scores.json"

    def student_item_scores(self) -> list[dict[str, Any]]:
        """The rows of :attr:`item_scores`, checked: a malformed row names the file and its index."""
        data = self.read_json(self.require(self.item_scores, "run the eval step"))
        rows = data.get("items") if isinstance(data, dict) else None
        if not isinstance(rows, list):
            raise RunArtifactError(f"{self.item_scores}: expected an object with an 'items' list")
        fields: dict[str, Any] = {"id": str, "shape": str, "f1_lax": (float, type(None)),
                                  "f1_strict": (float, type(None)), "selection_ok": bool, "privacy_ok": bool,
                                  "calls_emitted": int, "calls_valid": int, "fixture_calls": int, "fixture_hits": int,
                                  "top_up": (bool, type(None))}  # absent (None) before top-up rows were marked
        for i, row in enumerate(rows):
            bad = [k for k, kind in fields.items() if not isinstance(row, dict) or not isinstance(row.get(k), kind)]
            if bad:
                raise RunArtifactError(f"{self.item_scores}: items[{i}]: fields {bad} missing or of the wrong type")
        return rows

    @property
    def shards_dir(self) -> Path:
        return self.eval_dir / "shards"

    # -- artifacts -------------------------------------------------------------------------
    def require(self, path: Path, hint: str = "") -> Path:
        """``path`` if it exists, else a :class:`RunArtifactError` naming it (and how to make it)."""
        if not path.exists():
            raise RunArtifactError(f"{path}: artifact not found in run dir {self.root}{f' ({hint})' if hint else ''}")
        return path

    def read_json(self, path: Path) -> Any:
        """Parsed JSON of a run artifact; a missing or malformed file names the file (and line)."""
        self.require(path)
        try:
            return json.loads(path.read_text())
        except json.JSONDecodeError as err:
            raise RunArtifactError(f"{path}:{err.lineno}: invalid JSON: {err.msg}") from err

    def optional_json(self, path: Path) -> Any | None:
        """Parsed JSON of an artifact a run may not have (e.g. ``qat_probe.json`` when QAT is off)."""
        return self.read_json(path) if path.exists() else None

    def items(self, split: str) -> list[dict[str, Any]]:
        """The validated items of ``data/<split>.jsonl`` (read once)."""
        if split not in self._items:
            from distillgates.data.dataset import read_dataset

            self._items[split] = read_dataset(self.require(self.dataset(split), "run the data step"))[1]
        return self._items[split]

    def tokenizer(self) -> Any:
        """The run's tokenizer (``data/tokenizer``), loaded once."""
        if self._tokenizer is None:
            from distillgates.tokenizer import load_tokenizer

            self._tokenizer = load_tokenizer(self.require(self.tokenizer_dir, "run the data step"))
        return self._tokenizer

    def load_model(self, role: str = "student") -> Transformer:
        """The trained student or drafter checkpoint (checksum verified), in eval mode."""
        from distillgates.model import load_model

        return load_model(self.require(self.model_path(role), f"run the {role} step")).eval()

    def has_model(self, role: str) -> bool:
        return self.model_path(role).is_file()
