"""When the toy teacher learns to copy each value it must copy, over its training steps.

The toy's answers copy values the request never held from the tool result (the event id of a created calendar event,
the weather condition, the best document's title), and its calls copy argument values from the request (the event's
date and time, the city). A teacher that never learns one of them fails every F1 gate on that tool, and so does its
student (docs/benchmarks.md 11.4-11.6). This trains the toy teacher with the real recipe
(:func:`distillgates.teacher.toy.train_toy_teacher`, the config's ``teacher.train``) and, every ``--every`` steps,
measures on up to ``--items`` held-out single-call items per value the teacher-forced probability of the value where
the reference copies it (the product over the value's tokens: a result value at its last occurrence, in the answer;
an argument value where the call first writes it, after its key)::

    OMP_NUM_THREADS=2 .venv/bin/python benchmarks/bench_teacher_copy.py --seed 0 --run-dir runs/toy --out /tmp/c0.json

``--run-dir`` gives the data and tokenizer (``data.seed`` is the same for every seed, so any build's data serve);
``--stop-at`` ends the training early (the schedule stays the full run's). The teacher is not saved. ``--teacher``
scores a built teacher (a run's ``teacher/``) once instead of training one; with ``--without-preamble`` the rows lose
the text before the call, as the student's training rows do (``train.length.mask_excess``): score a student's
``student/hf`` so, in the context it decodes in.
"""

from __future__ import annotations

import argparse
import contextlib
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM

from distillgates.config import load_config
from distillgates.data.targets import encode_item
from distillgates.io import atomic_write_json
from distillgates.project import EMBEDDED_CONFIG
from distillgates.rundir import RunDir
from distillgates.teacher.toy import train_toy_teacher
from distillgates.train.data import without_preamble

# value: (tool, "result" for a value of the tool result the answer copies, "argument" for one the call copies)
VALUES = {"event_id": ("create_calendar_event", "result"), "condition": ("get_weather", "result"),
          "top": ("search_documents", "result"), "time": ("create_calendar_event", "argument"),
          "date": ("create_calendar_event", "argument"), "city": ("get_weather", "argument"),
          "a": ("calculate", "argument"), "b": ("calculate", "argument")}


class _Stop(Exception):
    pass


def probes(run: RunDir, n: int, preamble: bool = True) -> dict[str, list[tuple[list[int], list[int]]]]:
    """Per value: (the reference up to the occurrence measured, the value's tokens) of up to ``n`` eval items."""
    tokenizer, out = run.tokenizer(), {}
    # the token between a key and its value: a string's, a number's
    after_key = {tokenizer('"x":"', add_special_tokens=False)["input_ids"][-1],
                 tokenizer('"x":1', add_special_tokens=False)["input_ids"][-2]}
    for key, (tool, source) in VALUES.items():
        rows: list[tuple[list[int], list[int]]] = []
        for item in run.items("eval"):
            if len(rows) == n:
                break
            if len(item["fixtures"]) != 1 or item["fixtures"][0]["name"] != tool:
                continue
            values = item["fixtures"][0]["result"] if source == "result" else item["expected_calls"][0]["arguments"]
            if key not in values:  # an optional argument the request did not give
                continue
            ids = encode_item(tokenizer, item if preamble else without_preamble(item)).input_ids
            value = tokenizer(str(values[key]), add_special_tokens=False)["input_ids"]
            found = [i for i in range(len(ids) - len(value) + 1) if ids[i : i + len(value)] == value
                      and (source == "result" or ids[i - 1] in after_key)]  # fmt: skip
            at = found[-1] if source == "result" else found[0]  # an argument's first: the result may repeat it (12-6=6)
            rows.append((ids[: at + len(value)], value))
        out[key] = rows
    return out


@torch.no_grad()
def copy_probability(model: Any, rows: list[tuple[list[int], list[int]]]) -> float:
    """Mean over the rows of the teacher-forced probability of the value's tokens at its last occurrence."""
    total = 0.0
    for ids, value in rows:
        logp = model(torch.tensor([ids])).logits[0, -len(value) - 1 : -1].log_softmax(-1)  # (len(value), V)
        total += float(logp[torch.arange(len(value)), torch.tensor(value)].sum().exp())
    return total / len(rows)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", default=str(EMBEDDED_CONFIG))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--run-dir", type=Path, default=Path("runs/toy"), help="a toy build: its data and tokenizer")
    parser.add_argument("--every", type=int, default=100)
    parser.add_argument("--items", type=int, default=60, help="held-out items per value")
    parser.add_argument("--stop-at", type=int, default=None, help="the last step measured (default: the last)")
    parser.add_argument("--teacher", type=Path, default=None, help="score this model (teacher/, student/hf)")
    parser.add_argument("--without-preamble", action="store_true", help="rows as the student trains on: no preamble")
    parser.add_argument("--out", type=Path, required=True, help="the measurements, as JSON")
    args = parser.parse_args()
    cfg, run = load_config(args.config), RunDir(args.run_dir)
    rows, last = probes(run, args.items, not args.without_preamble), args.stop_at or cfg.teacher.train.steps - 1
    if args.teacher is not None:
        model = AutoModelForCausalLM.from_pretrained(args.teacher).eval()
        scores = {"model": str(args.teacher), "preamble": not args.without_preamble}
        scores |= {key: round(copy_probability(model, r), 3) for key, r in rows.items()}
        atomic_write_json(args.out, scores)
        print(scores)
        return 0
    result: dict[str, Any] = {"seed": args.seed, "threads": torch.get_num_threads(), "steps": []}
    start = time.perf_counter()

    def on_step(step: int, model: torch.nn.Module) -> None:
        if step % args.every and step != last:
            return
        model.eval()
        point: dict[str, Any] = {"step": step, "seconds": round(time.perf_counter() - start)}
        point |= {key: round(copy_probability(model, value_rows), 3) for key, value_rows in rows.items()}
        model.train()
        result["steps"].append(point)
        atomic_write_json(args.out, result)
        print(point, flush=True)
        if step == last:
            raise _Stop

    # --stop-at ends the training by raising from on_step: the measurements are written, the teacher is not wanted
    with tempfile.TemporaryDirectory() as tmp, contextlib.suppress(_Stop):
        train_toy_teacher(cfg, run.tokenizer(), run.items("train"), tmp, seed=args.seed, on_step=on_step)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
