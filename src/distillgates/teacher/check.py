"""A local teacher answers held-out tool items before the KD step, and a teacher that does not call tools is refused.

An instruct model never tuned on the user's tools makes no tool call at all, and nothing distilled from it can:
the ``check`` step, between the teacher and the KD set, evaluates the teacher on the eval split's first
``teacher.check.items`` items that expect a call (nothing is trained on them), writes the figures
(``teacher_check.json``) and refuses a teacher whose share of replies with a tool call is below
``teacher.check.min_call_rate``, naming them. Its own step: an edit to the scorer re-runs the check, never the
teacher's training (and the KD set only when the figures change).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from distillgates.devices import resolve_device
from distillgates.io import atomic_write_json

if TYPE_CHECKING:
    from distillgates.config import Config
    from distillgates.rundir import RunDir


class TeacherRefused(ValueError):
    """The teacher failed its check: distilling from it cannot give a student that calls tools."""


def teacher_runner(cfg: Config, run: RunDir, tokenizer: Any) -> Any:
    """What evaluates the teacher: an API teacher through its client; a local one on ``cfg.device`` through
    the runtime engine (CPU, the run's tokenizer: identical weights via ``from_hf``) or its own generation (another
    tokenizer, whose turns come back in the run's format as an API's do, or another device)."""
    from distillgates.eval.runners import TeacherRunner

    assert cfg.teacher is not None
    if cfg.teacher.kind == "openai":
        from distillgates.teacher.http import HTTPTeacher

        return TeacherRunner(HTTPTeacher(cfg.teacher.api, tokenizer), cfg.eval.max_new_tokens)
    from distillgates.hf import from_hf
    from distillgates.runtime.torch_engine import TorchEngine
    from distillgates.teacher.local import StudentTokensTeacher, local_teacher

    device = resolve_device(cfg.device)
    local = local_teacher(run.teacher_model_dir(cfg), tokenizer, cfg.teacher.chat_template, device)
    if isinstance(local, StudentTokensTeacher) or device != "cpu":
        return TeacherRunner(local, cfg.eval.max_new_tokens)
    return TorchEngine(from_hf(local.model).eval())


def check_teacher(cfg: Config, run: RunDir) -> dict[str, Any]:
    """Evaluate the local teacher on the first ``teacher.check.items`` eval items that expect a tool call, write the
    figures (``call_rate``: the share of them whose reply makes a call), and refuse (:class:`TeacherRefused`) a
    teacher below ``teacher.check.min_call_rate``, naming them. An API teacher, or ``items: 0``, is not checked."""
    from distillgates.eval.broker import FixturePolicy
    from distillgates.eval.evaluate import evaluate
    from distillgates.eval.scorer import is_tool_item

    assert cfg.teacher is not None
    check = cfg.teacher.check
    if cfg.teacher.kind != "local" or not check.items:
        figures: dict[str, Any] = {"checked": False, "why": "an API teacher" if cfg.teacher.kind != "local" else
                                   "teacher.check.items: 0"}  # fmt: skip
        atomic_write_json(run.teacher_check, figures)
        return figures
    tokenizer = run.tokenizer()
    items = [item for item in run.items("eval") if is_tool_item(item)][: check.items]
    where = f"teacher.path {cfg.teacher.path}" if cfg.teacher.path else "the toy teacher"
    if not items:
        raise TeacherRefused(f"teacher check: the eval split has no item that expects a tool call to check {where} "
                             "on (teacher.check.items: 0 turns the check off)")  # fmt: skip
    metrics, _, scores = evaluate(teacher_runner(cfg, run, tokenizer), items, tokenizer, return_outputs=True,
                                  max_calls=cfg.eval.max_calls, max_new_tokens=cfg.eval.max_new_tokens,
                                  policy=FixturePolicy(cfg.eval.missing_fixture, cfg.eval.mock_result),
                                  privacy=cfg.eval.privacy)  # fmt: skip
    calls = sum(s.calls_emitted > 0 for s in scores)
    figures = {
        "checked": True, "items": len(items), "with_call": calls, "call_rate": calls / len(items),
        "min_call_rate": check.min_call_rate,
        **{key: metrics[key] for key in ("tool_selection", "json_validity", "arg_match_lax", "f1_lax_macro")},
    }  # fmt: skip
    figures["passed"] = figures["call_rate"] >= check.min_call_rate
    atomic_write_json(run.teacher_check, figures)
    if figures["passed"]:
        return figures
    fix = ("train it longer (teacher.finetune.steps, lr)" if cfg.teacher.finetune is not None else
           "fine-tune it on your rows first (teacher.finetune)" if cfg.teacher.path else
           "train it longer (teacher.train)")  # fmt: skip
    raise TeacherRefused(
        f"teacher check: {where} calls a tool on {calls} of {len(items)} held-out tool items (call rate "
        f"{figures['call_rate']:.2f} < teacher.check.min_call_rate {check.min_call_rate}; tool selection "
        f"{metrics['tool_selection']:.2f}, JSON validity {_fmt(metrics['json_validity'])}, F1 lax "
        f"{metrics['f1_lax_macro']:.2f}): nothing distilled from it can call tools; {fix}. Figures: {run.teacher_check}"
    )


def _fmt(value: float | None) -> str:
    return "n/a (no call)" if value is None else f"{value:.2f}"
