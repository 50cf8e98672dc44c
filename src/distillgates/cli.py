"""The ``distillgates`` command.

``distillgates run`` runs the whole pipeline; the other subcommands run one step of it with
the same config and run directory (``data``, ``teacher``, ``kd``, ``student``, ``drafter``,
``export``, ``speed``, ``eval``), render a report (``report``), show the hardware profile
(``profile``) or serve a local teacher as an OpenAI-compatible API (``serve``).
``distillgates init`` scaffolds a project (config, thresholds, baselines, CI workflows).
With no config argument a command uses the project's (``distillgates.yaml`` or ``[tool.distillgates]``
in the working directory, :mod:`distillgates.project`), else the embedded toy task.
``python -m distillgates.train`` is the training recipe's entry under ``torchrun`` (DDP/FSDP).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import warnings
from collections.abc import Sequence
from pathlib import Path

from distillgates import __version__

# Third-party output a user of the command can do nothing about; the checks it warns of are ours.
_EXPECTED_WARNINGS = (
    (FutureWarning, r"`isinstance\(treespec, LeafSpec\)` is deprecated"),  # torch.export internals (torch 2.13)
    (UserWarning, r"torch\.quantize_per_tensor, torch\.quantize_per_channel"),  # torch.ao reference modules (QAT)
)


class _DropMessage(logging.Filter):
    def __init__(self, text: str) -> None:
        super().__init__()
        self.text = text

    def filter(self, record: logging.LogRecord) -> bool:
        return self.text not in record.getMessage()


def quiet_third_party() -> None:
    """Keep the command's output to its own progress and results (``DISTILLGATES_VERBOSE=1`` keeps it all).

    - tqdm bars (coremltools' MIL passes, transformers' weight loading): the steps show ``rich`` progress;
    - known deprecation warnings of torch internals (``_EXPECTED_WARNINGS``);
    - coremltools' "Core ML only supports fp16 states" per KV buffer: fp16 states are the export's design;
    - off macOS, coremltools' warnings ("Failed to load _MLModelProxy", untested torch version): it
      converts there but cannot load its native runtime, which the export step already accounts for.
    """
    os.environ.setdefault("TQDM_DISABLE", "1")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    for category, message in _EXPECTED_WARNINGS:
        warnings.filterwarnings("ignore", message=message, category=category)
    converter = logging.getLogger("coremltools.converters.mil.frontend.torch.converter")
    if not any(isinstance(f, _DropMessage) for f in converter.filters):
        converter.addFilter(_DropMessage("Core ML only supports fp16 states"))
    if sys.platform != "darwin":
        logging.getLogger("coremltools").setLevel(logging.ERROR)


def _add_common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("config", nargs="?", default=None,
                        help="pipeline YAML (default: the project's `config`, else the embedded toy task)")
    parser.add_argument("--run-dir", default=None,
                        help="where artifacts go (default: runs/<config name> in the project); reused across steps")
    parser.add_argument("--force", action="store_true", help="redo the step(s) even if cached results are fresh")
    parser.add_argument("--seed", type=int, default=None, metavar="N",
                        help="replace the config's seed and train.seed (the models' initialisation and batch order; "
                             "the data stay): another build of the same task, in runs/<config name>-seed<N> by default")
    parser.add_argument("--student-seed", type=int, default=None, metavar="M",
                        help="replace only the student's and drafter's train seed: another student of the same "
                             "teacher, in runs/<config name>-student-seed<M> by default, reusing the data, teacher and "
                             "KD set of runs/<config name> where they are fresh")


def build_parser() -> argparse.ArgumentParser:
    from distillgates import pipeline

    parser = argparse.ArgumentParser(
        prog="distillgates",
        description="Distill a teacher LLM into a small, fast student for Apple silicon and gate it.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    run = sub.add_parser(
        "run",
        help="run the whole pipeline: data, teacher, KD set, student, drafter, export, speed, eval, report",
        description="Run every step on a config (default: the embedded toy task). Finished steps whose inputs "
        "did not change are skipped; --force redoes them.",
    )
    _add_common(run)
    run.set_defaults(func=pipeline.cli_run)

    for step in pipeline.STEPS:
        if step.name == "report":  # `distillgates report` renders a report; `run` writes it
            continue
        step_parser = sub.add_parser(step.name, help=step.help, description=step.help)
        _add_common(step_parser)
        step_parser.set_defaults(func=pipeline.cli_step, step=step.name)

    report = sub.add_parser("report", help="render a report.json as a table (and Markdown with --markdown)")
    report.add_argument("path", help="path to report.json (e.g. runs/toy/reports/report.json)")
    report.add_argument("--markdown", default=None, help="also write the Markdown summary here")
    report.set_defaults(func=pipeline.cli_report)

    profile = sub.add_parser("profile", help="detect this machine and show the matching hardware profile")
    profile.add_argument("--profiles", default=None,
                         help="hardware profiles YAML (default: the project's `hardware_profiles`, else the embedded)")
    profile.add_argument("--hw-profile", default=None, help="check this profile key against the detected machine")
    profile.set_defaults(func=pipeline.cli_profile)

    init = sub.add_parser("init", help="scaffold a project: config, thresholds, baselines/, CI workflows",
                          description="Write a project's distillgates files into FOLDER (default: here); refuses "
                          "to overwrite any file that exists.")
    init.add_argument("folder", nargs="?", default=".", help="project folder (default: the working directory)")
    init.set_defaults(func=_cli_init)

    from distillgates.teacher import cli as teacher_cli

    teacher_cli.add_parser(sub)
    return parser


def _cli_init(args: argparse.Namespace) -> int:
    from distillgates.scaffold import scaffold

    for path in scaffold(Path(args.folder)):
        print(f"wrote {path}")
    print("next: edit configs/pipeline.yaml and configs/gates.yaml, then `distillgates run`, "
          "`pytest --bless` (commit baselines/) and `pytest`")
    return 0


def _project_defaults(args: argparse.Namespace) -> None:
    """Fill the config / profiles a command was not given from the working directory's project (the nearest
    at or above it, :meth:`Project.find`)."""
    if getattr(args, "config", "") is None or getattr(args, "profiles", "") is None:
        from distillgates.project import Project

        project = Project.find(Path.cwd())
        if getattr(args, "config", "") is None:
            args.config = str(project.config_path)
        if getattr(args, "profiles", "") is None:
            args.profiles = str(project.hardware_profiles_path)


def main(argv: Sequence[str] | None = None) -> int:
    if not os.environ.get("DISTILLGATES_VERBOSE"):
        quiet_third_party()  # before anything imports tqdm (it reads TQDM_* once, at import)
    args = build_parser().parse_args(argv)
    try:
        _project_defaults(args)
        return int(args.func(args) or 0)
    except Exception as err:
        # user-facing errors (bad config, dataset, checkpoint, export lint...) print one clear line;
        # anything else is a bug and keeps its traceback
        user_facing = isinstance(err, (ValueError, FileNotFoundError, FileExistsError)) or (
            type(err).__module__.startswith("distillgates.")
        )
        if not user_facing or os.environ.get("DISTILLGATES_TRACEBACK"):
            raise
        print(f"distillgates: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
