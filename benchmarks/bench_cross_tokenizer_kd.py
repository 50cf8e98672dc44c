"""KD from a teacher with another tokenizer: sequence-level KD alone vs byte-mapped top-k KD + CE.

The teacher is a toy run's trained teacher (the toy tokenizer), served on loopback by
:class:`~distillgates.teacher.server.TeacherServer` and queried by the HTTP client, exactly as an
API teacher would be. The student gets another tokenizer: a GPT-2-style byte-level BPE (words keep
their leading space, ``--vocab`` entries) trained here on the same training conversations. The KD
set is built twice (greedy teacher: the same answers): with the old 1:1 rule (text-only turns)
and with the byte mapping (:func:`distillgates.teacher.tokens.map_by_bytes`); both coverages are
reported, with that of a third set built from the same teacher as a *local* teacher (in-process,
:class:`~distillgates.teacher.local.StudentTokensTeacher`: the ``kd`` step's ``teacher.kind: local``
with another tokenizer; ``--kd-only`` stops there). Two students are then trained from scratch with
the toy recipe, same seed and steps:

- ``seq_kd``: CE on the teacher's text (each item's reference replaced by the teacher's completion;
  items where the teacher did not finish, or whose text misses a fact the recipe's targets need, are
  dropped: ``train_items`` counts the rest), ``train.kd.weight = 0``;
- ``seq_kd_plus_topk``: the same plus the byte-mapped top-k KD (the toy's forward KL, T = 2).

Both are scored by the project's eval (:func:`distillgates.eval.evaluate.evaluate`) on the first
``--eval-items`` held-out items, for each of ``--seeds``. Small on purpose (one CPU core):
``--items`` training items, ``--steps`` steps, QAT off, no init from the teacher (its vocabulary is
not the student's); far from the toy pipeline's student (600 steps on 4000 items, initialised from
the teacher), so the figures compare the two arms, not the toy's quality.

Usage (from the repository root)::

    taskset -c 0 .venv/bin/python benchmarks/bench_cross_tokenizer_kd.py /tmp/toyrun \\
        --items 400 --eval-items 100 --steps 400 --seeds 1 --out benchmarks/results/cross_tokenizer_kd_seed1.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from distillgates.config import APIConfig, Config, TeacherConfig, load_config
from distillgates.data.chat import render_conversation
from distillgates.project import EMBEDDED_CONFIG
from distillgates.rundir import RunDir
from distillgates.teacher.http import HTTPTeacher
from distillgates.teacher.kd import build_kd_set, read_kd_set
from distillgates.teacher.local import LocalTeacher, StudentTokensTeacher, local_teacher
from distillgates.teacher.server import TeacherServer
from distillgates.tokenizer import SPECIAL_TOKENS, wrap_tokenizer

METRICS = ("tool_selection", "json_validity", "f1_lax_macro", "f1_strict_macro", "fixture_hit_rate")


def gpt2_style_tokenizer(texts: list[str], vocab_size: int) -> Any:
    """A byte-level BPE with GPT-2's own split (`` ?\\p{L}+``: words absorb their leading space), so its
    tokens differ from the toy tokenizer's (which never joins a space to a word)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=2, special_tokens=list(SPECIAL_TOKENS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    backend.train_from_iterator(texts, trainer=trainer)
    return wrap_tokenizer(backend)


def has_targets(item: dict[str, Any]) -> bool:
    """Whether the reference holds every span the recipe's targets need (the call, its argument values, the
    answer's facts); a teacher text that misses one cannot be a training reference and is dropped."""
    from distillgates.data.targets import reference_spans

    try:
        reference_spans(item)
    except ValueError:
        return False
    return True


def build(cfg: Config, tok: Any, items: list[dict[str, Any]], out: Path, map_bytes: bool) -> dict[str, Any]:
    """The KD set at ``out`` (no response cache: it keeps turns as mapped, so each rule asks the teacher)."""
    teacher = HTTPTeacher(cfg.teacher.api if cfg.teacher else APIConfig(), tok, api_key="", map_bytes=map_bytes)
    start = time.perf_counter()
    result = build_kd_set(cfg, teacher, items, out, progress=False)
    teacher.close()
    return {"seconds": round(time.perf_counter() - start, 1), "positions": result.positions,
            "covered": result.covered, "coverage": round(result.coverage, 4)}  # fmt: skip


def build_local(cfg: Config, teacher_dir: Path, tok: Any, items: list[dict[str, Any]], out: Path) -> dict[str, Any]:
    """The KD set at ``out`` from the teacher as a local one (the ``kd`` step's ``teacher.kind: local``): the
    teacher in-process, its turns moved onto the student's tokens (:func:`distillgates.teacher.local.local_teacher`)."""
    teacher = local_teacher(teacher_dir, tok)
    assert isinstance(teacher, StudentTokensTeacher)  # another tokenizer
    start = time.perf_counter()
    result = build_kd_set(dataclasses.replace(cfg, teacher=TeacherConfig(kind="local", path=str(teacher_dir))),
                          teacher, items, out, progress=False)  # fmt: skip
    return {"seconds": round(time.perf_counter() - start, 1), "positions": result.positions,
            "covered": result.covered, "coverage": round(result.coverage, 4)}  # fmt: skip


def train_and_eval(cfg: Config, tok: Any, items: list[dict[str, Any]], eval_items: list[dict[str, Any]],
                   kd_path: Path, work: Path, kd_weight: float) -> dict[str, Any]:  # fmt: skip
    from distillgates.eval.broker import FixturePolicy
    from distillgates.eval.evaluate import evaluate
    from distillgates.runtime.torch_engine import TorchEngine
    from distillgates.train.recipe import train_student

    train = dataclasses.replace(cfg.train, kd=dataclasses.replace(cfg.train.kd, weight=kd_weight))
    run_cfg = dataclasses.replace(cfg, train=train)
    start = time.perf_counter()
    train_student(run_cfg, "student", work, kd_path=kd_path, tokenizer=tok, train_items=items,
                  eval_items=eval_items[:8], progress=False)  # fmt: skip
    train_s = time.perf_counter() - start
    model = RunDir(work).load_model()
    quality = evaluate(TorchEngine(model), eval_items, tok, lengths=cfg.shapes.lengths, max_calls=cfg.eval.max_calls,
                       max_new_tokens=cfg.eval.max_new_tokens, progress=False,
                       policy=FixturePolicy(cfg.eval.missing_fixture, cfg.eval.mock_result), privacy=cfg.eval.privacy)
    log = [json.loads(line) for line in (work / "student" / "train_log.jsonl").read_text().splitlines()]
    last = next(r for r in reversed(log) if "total" in r)
    return {"train_seconds": round(train_s, 1), "final_train_ce": last["ce"], "final_train_total": last["total"],
            **{m: quality.get(m) for m in METRICS}}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("teacher_run", type=Path, help="a finished toy run (its teacher/ and data/ are read)")
    parser.add_argument("--config", default=str(EMBEDDED_CONFIG))
    parser.add_argument("--items", type=int, default=400, help="training items (each gets a KD record)")
    parser.add_argument("--eval-items", type=int, default=100)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--vocab", type=int, default=1024, help="the student tokenizer's vocabulary size")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0], help="training seeds (one KD set for all)")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--kd-only", action="store_true", help="build and report the KD sets, train nothing")
    args = parser.parse_args()
    torch.set_num_threads(1)
    run = RunDir(args.teacher_run)
    base = load_config(args.config)
    items, eval_items = run.items("train")[: args.items], run.items("eval")[: args.eval_items]
    tok = gpt2_style_tokenizer([render_conversation(it) for it in run.items("train")], args.vocab)
    assert base.student is not None and base.teacher is not None
    cfg = dataclasses.replace(
        base,
        teacher=TeacherConfig(kind="openai", api=APIConfig(base_url="http://127.0.0.1:1/v1")),
        kd=dataclasses.replace(base.kd, items=args.items),
        student=dataclasses.replace(base.student, vocab_size=len(tok)), drafter=None,
        train=dataclasses.replace(base.train, init_from="scratch", steps=args.steps, eval_every=args.steps,
                                  ckpt_every=args.steps, qat=dataclasses.replace(base.train.qat, enabled=False)),
    )  # fmt: skip
    t0 = time.perf_counter()
    report: dict[str, Any] = {"args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
                              "machine": f"{platform.machine()} {platform.processor() or ''}".strip(),
                              "torch_threads": 1, "student_vocab": len(tok)}  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp_name, TeacherServer(LocalTeacher(run.teacher_dir)) as server:
        tmp = Path(tmp_name)
        cfg = dataclasses.replace(cfg, teacher=TeacherConfig(kind="openai", api=APIConfig(base_url=server.base_url)))
        kd_path = tmp / "kd.jsonl"
        report["kd_old_rule"] = build(cfg, tok, items, tmp / "kd_old.jsonl", map_bytes=False)
        report["kd_byte_mapped"] = build(cfg, tok, items, kd_path, map_bytes=True)
        report["kd_local_teacher"] = build_local(cfg, run.teacher_dir, tok, items, tmp / "kd_local.jsonl")
        print({k: report[k] for k in ("kd_old_rule", "kd_byte_mapped", "kd_local_teacher")}, flush=True)
        # sequence-level KD: the teacher's finished conversations are the references
        _, records = read_kd_set(kd_path)
        by_id = {r["id"]: r for r in records if r["finish"] == "stop"}
        seq_items = [{**it, "reference": by_id[it["id"]]["completion_text"]} for it in items if it["id"] in by_id]
        seq_items = [it for it in seq_items if has_targets(it)]
        report["train_items"] = len(seq_items)
        arms = {} if args.kd_only else {"seq_kd": 0.0, "seq_kd_plus_topk": cfg.train.kd.weight}
        for seed in args.seeds:
            for name, weight in arms.items():
                run_cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, seed=seed))  # the recipe's seed
                figures = train_and_eval(run_cfg, tok, seq_items, eval_items, kd_path, tmp / f"{name}_{seed}", weight)
                report.setdefault(name, {})[f"seed_{seed}"] = figures
                print(name, seed, figures, flush=True)
        for name in arms:
            runs = list(report[name].values())
            values = {m: [r[m] for r in runs if r[m] is not None] for m in METRICS}  # None: nothing to rate
            report[name]["mean"] = {m: sum(v) / len(v) if v else None for m, v in values.items()}
    report["total_seconds"] = round(time.perf_counter() - t0, 1)
    print(json.dumps(report, indent=2))
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
