"""The acceptance checklist: one gate test module per marker (DESIGN.md's gate table).

It ships with the plugin: ``pytest --run-dir runs/x`` (no paths), or a bare ``pytest`` in a project
with distillgates settings, collects it in any project; its fixtures are the plugin's
(:mod:`pytest_distillgates.fixtures`), which a project's own gates use too.
"""

from pathlib import Path

CHECKLIST_DIR = Path(__file__).resolve().parent
