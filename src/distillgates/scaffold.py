"""``distillgates init``: scaffold a project that uses the installed package.

Writes the project settings (``distillgates.yaml``), a pipeline config to edit (the embedded toy
task), the gate thresholds (the embedded defaults), a ``baselines/`` folder and three GitHub
workflows: quality gates on Linux and speed gates on an Apple-silicon runner (pull requests and main, on the
cached run), both installing ``distillgates`` from the package index rather than referring to this repository's
paths, and a nightly one that calls both on a run rebuilt from scratch.
Nothing is overwritten: when any of the files exists, nothing is written and the error names them.
"""

from __future__ import annotations

from pathlib import Path

from distillgates import __version__
from distillgates.io import atomic_write_text
from distillgates.project import EMBEDDED_CONFIG, EMBEDDED_THRESHOLDS, SETTINGS_FILE

TEMPLATES = Path(__file__).resolve().parent / "templates"
CONFIG_HEADER = ("# Your pipeline config (written by `distillgates init` from the embedded toy task); edit it.\n"
                 "# Every field: docs/configuration.md of distillgates.\n")
THRESHOLDS_HEADER = ("# Gate thresholds (written by `distillgates init` from the embedded defaults); a key removed\n"
                     "# here falls back to the embedded default, and the gate report names the file of each.\n")


def _template(name: str) -> str:
    return (TEMPLATES / name).read_text().replace("@VERSION@", __version__)


def project_files() -> dict[str, str]:
    """Relative path -> content of every file ``init`` writes."""
    return {
        SETTINGS_FILE: _template("distillgates.yaml"),
        "configs/pipeline.yaml": CONFIG_HEADER + EMBEDDED_CONFIG.read_text(),
        "configs/gates.yaml": THRESHOLDS_HEADER + EMBEDDED_THRESHOLDS.read_text(),
        "baselines/README.md": _template("baselines-README.md"),
        ".github/workflows/distillgates-quality.yml": _template("quality-gates.yml"),
        ".github/workflows/distillgates-macos-speed.yml": _template("macos-speed-gates.yml"),
        ".github/workflows/distillgates-nightly.yml": _template("nightly-gates.yml"),
    }


def scaffold(root: Path) -> list[Path]:
    """Write the project files into ``root``; returns their paths.

    Raises:
        FileExistsError: naming every file that already exists (then nothing is written).
    """
    files = {root / rel: text for rel, text in project_files().items()}
    existing = [str(path) for path in files if path.exists()]
    if existing:
        raise FileExistsError(f"distillgates init writes nothing over existing files: {', '.join(existing)} "
                              "(move them away, or edit them by hand)")
    for path, text in files.items():
        atomic_write_text(path, text)
    return list(files)
